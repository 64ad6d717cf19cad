"""The device figures per block kind: hpcnn's own blocks timed forward and backward.

:func:`block_costs` times a kind's blocks at a tiny size (their fixed cost: ``overhead``) and at
two reference sizes per kind, a wide and a narrow one (:data:`EFFICIENCY_SHAPES`, chosen apart
from any experiment's sizes): each round times the matmul, then the blocks, and solves
time - overhead = FLOPs / (rate x efficiency) + cache bytes x elementwise for the two unknowns
(:func:`_solve_round`; the FLOPs and cache bytes from the blocks' ``spec()``). The linear kind has
a third, rectangular reference whose ReLU output is 8x its input, and a third unknown,
``activation``, the seconds per byte of that output. The figures are the medians over rounds.

These are the machine's figures for the framework's element-wise passes and per-call cost, not a
profile of the model being planned: re-planning another width or batch reruns nothing.

:func:`blocks_pass` and :func:`median_pass` (one forward and backward of a kind's blocks at a
size) are what the other measurements of blocks time (:mod:`.passes`, :mod:`.shared`).
"""
from __future__ import annotations

import time

import numpy as np

from hpcnn.nn.layers import Linear, ReLU
from hpcnn.nn.transformer import TransformerBlock
from hpcnn.plan.calibrate.timing import FULL_ROUNDS, MATMUL_N, median_seconds

# Reference blocks of the efficiency figures, a wide and a narrow one per kind: GPT blocks of
# width 256, 4 heads on 8 sequences of 64 tokens and of width 64, 2 heads on 32 sequences; a
# Linear and its ReLU, 512 -> 512 on 256 rows and 64 -> 64 on 2048 rows. The overhead figures
# time the same kinds at a tiny size: width 8, 2 heads, one sequence of 4; 8 -> 8 on 1 row.
EFFICIENCY_SHAPES = {"transformer": ((256, 4, (8, 64, 256)), (64, 2, (32, 64, 64))),
                     "linear": ((512, 512, (256, 512)), (64, 64, (2048, 64)),
                                (128, 1024, (512, 128)))}
OVERHEAD_SHAPES = {"transformer": (8, 2, (1, 4, 8)), "linear": (8, 8, (1, 8))}


def blocks_pass(kind: str, size: tuple, dtype: str):
    """(run, FLOPs forward, FLOPs backward, cache bytes, the ReLU's cache bytes (its output; 0
    for a transformer block, whose cache is all in the third)) of ``kind``'s blocks at ``size`` (one
    :data:`EFFICIENCY_SHAPES` entry): ``run()`` does one forward and one backward and returns
    their seconds (forward, backward); ``run(True)`` splits the backward as zero-bubble pipelines
    do (the input half, then the deferred weight halves, :mod:`hpcnn.nn.core`) and returns
    (forward, input half, weight half); the figures are the blocks' spec()."""
    a, b, shape = size
    blocks = ([TransformerBlock(a, b, dtype=dtype)] if kind == "transformer" else
              [Linear(a, b, dtype=dtype), ReLU(dtype=dtype)])
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    f_fwd = f_bwd = cache = act = 0.0
    for blk in blocks:
        s = blk.spec(shape)
        f_fwd, f_bwd = f_fwd + s.flops_fwd, f_bwd + s.flops_bwd
        if isinstance(blk, ReLU):
            act += s.bytes_cache
        else:
            cache += s.bytes_cache
        shape = s.out_shape

    def run(split: bool = False) -> tuple:
        t0 = time.perf_counter()
        y, caches = x, []
        for blk in blocks:
            y, c = blk.forward(y)
            caches.append(c)
        dy = np.ones_like(y)
        t1 = time.perf_counter()
        pending = [] if split else None
        for blk, c in zip(reversed(blocks), reversed(caches)):
            dy = blk.backward(dy, c, defer=pending) if split and blk.defers_weights else \
                blk.backward(dy, c)
        t2 = time.perf_counter()
        for linear, dy_l, cache_l in pending or ():
            linear.backward_weight(dy_l, cache_l)
        return (t1 - t0, t2 - t1, time.perf_counter() - t2) if split else (t1 - t0, t2 - t1)
    run()                                                    # warm-up
    run(True)
    return run, f_fwd, f_bwd, cache, act


def median_pass(run, repeats: int) -> tuple:
    """Median forward and backward seconds of ``repeats`` calls of a :func:`blocks_pass` run."""
    times = np.array([run() for _ in range(repeats)])
    return float(np.median(times[:, 0])), float(np.median(times[:, 1]))


def block_costs(kind: str, dtype: str, repeats: int = FULL_ROUNDS) -> tuple:
    """(efficiency, overhead seconds, elementwise seconds per cache byte, activation seconds per
    byte of the ReLU's output (None for a kind without one), forward share, (input, weight)
    split, the rounds' matmul rates F) of ``kind``'s blocks in this process.

    The overhead is the median forward + backward of the tiny blocks (:data:`OVERHEAD_SHAPES`).
    Each of ``repeats`` rounds then times the n x n matmul (its rate F) and the reference blocks
    and solves t - overhead = FLOPs / (F e) + bytes c (+ ReLU output bytes a) for 1/e and c
    (and a; :func:`_solve_round`); the figures are the medians over rounds. A change of load
    during the calibration moves both sides of a round's equations alike.

    The forward share is the part of a block's time beyond its matmul FLOPs (fixed cost and
    element-wise passes) spent in its forward: sum over the tiny and reference blocks of
    (t_fwd - FLOPs_fwd / (F e)) over that sum plus the backward's alike, each term at least 0,
    with each round's F and e. The FLOPs split 1 : 2 between forward and backward, the rest
    does not: layer norms, softmax and GELU cost about as much forward as backward.

    The split is what a zero-bubble pipeline's two backward halves each take as a fraction of the
    whole backward, medians over rounds and reference blocks: the halves add up to more than the
    whole (each runs its own passes over dy and the caches)."""
    tiny = blocks_pass(kind, OVERHEAD_SHAPES[kind], dtype)[0]
    o_fwd, o_bwd = median_pass(tiny, 10 * repeats)
    overhead = o_fwd + o_bwd
    refs = [blocks_pass(kind, size, dtype) for size in EFFICIENCY_SHAPES[kind]]
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((MATMUL_N, MATMUL_N)).astype(dtype) for _ in range(2))
    c = np.empty_like(a)
    inv_eff, per_byte, per_act, share, halves, rates = [], [], [], [], [], []
    for _ in range(repeats):
        rate = 2.0 * MATMUL_N ** 3 / median_seconds(lambda: np.matmul(a, b, out=c), 1)
        rates.append(rate)
        rows = [(ff, fb, q, qa, *run()) for run, ff, fb, q, qa in refs]
        u, w, v = _solve_round(rate, [(ff + fb, q, qa, max(tf + tb - overhead, 1e-9))
                                      for ff, fb, q, qa, tf, tb in rows])
        inv_eff.append(u)
        per_byte.append(w)
        per_act.append(v)
        fwd = o_fwd + sum(max(tf - ff * u / rate, 0.0) for ff, _, _, _, tf, _ in rows)
        bwd = o_bwd + sum(max(tb - fb * u / rate, 0.0) for _, fb, _, _, _, tb in rows)
        share.append(fwd / (fwd + bwd))
        for (run, *_), (*_, tb) in zip(refs, rows):
            _, t_in, t_w = run(True)
            halves.append((t_in / tb, t_w / tb))
    split = np.median(np.array(halves), axis=0)
    act = float(np.median(per_act)) if any(qa for *_, qa in refs) else None
    return (1.0 / float(np.median(inv_eff)), overhead, float(np.median(per_byte)), act,
            float(np.median(share)), (float(split[0]), float(split[1])), rates)


def _solve_round(rate: float, rows) -> tuple:
    """(1/e, c, a) of one round of :func:`block_costs` from its reference rows (FLOPs, cache
    bytes, ReLU output bytes, seconds beyond the overhead): the exact solution of all three
    when there are three references and it is physical (e <= 1, c >= 0, a >= 0), else one c for
    all bytes from the first two (a = c), with e = 1 or c = 0 where that solution is not."""
    if len(rows) >= 3:
        u, w, v = np.linalg.solve([[f / rate, q, qa] for f, q, qa, _ in rows[:3]],
                                  [t for *_, t in rows[:3]])
        if u >= 1 and w >= 0 and v >= 0:
            return float(u), float(w), float(v)
    (f1, q1, t1), (f2, q2, t2) = [(f, q + qa, t) for f, q, qa, t in rows[:2]]
    u, w = np.linalg.solve([[f1 / rate, q1], [f2 / rate, q2]], [t1, t2])
    if u < 1:                                  # faster than the matmul: e = 1, c from the narrow
        u, w = 1.0, (t2 - f2 / rate) / q2
    if w < 0:                                  # no element-wise share: e from the wide alone
        u, w = max(1.0, t1 * rate / f1), 0.0
    return float(u), float(w), float(w)
