"""Where ranks share cores: what a collective or a blocking exchange waits after compute.

Measured only when the node holds more ranks than cores; back-to-back timings (:mod:`.links`,
every rank in step) see neither figure.

- :func:`after_compute_points`: every rank loops over a few matmuls then one collective as the
  layout executor calls it (an in-place allreduce over groups of 2 and of all ranks, an
  all-to-all over all ranks), and the same loop without the call; the difference per call is the
  collective's seconds after that much compute, the wait for the last rank of the group to get a
  core included: the level's ``after_compute`` curves.
- :func:`handoff_points`: small GPTs of three sizes as 1F1B pipelines over all ranks through the
  step engine (:mod:`.runs`), each with p and 4p micro-batches; one wait per blocking exchange
  per size (:func:`_fit_handoff`) with the fill and drain weighted cores / ranks: the level's
  ``handoff`` points (what a rank waits for a peer to be given a core after that much compute)
  and ``bubble_weight``.

Figures of the machine's scheduler, its MPI and the framework, not of a model planned.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from hpcnn.plan import hybrid
from hpcnn.plan.calibrate.links import never_slower
from hpcnn.plan.calibrate.runs import engine_steps, gpt_config, gpt_model
from hpcnn.plan.calibrate.timing import counted, slowest

# Collectives after compute (after_compute_points): bytes per call, float32 matmuls of
# AFTER_MATMUL^3 before each call, calls per timed loop, rounds (loops with and without the
# call alternate in each).
AFTER_SIZES = (8, 1 << 12, 1 << 16, 1 << 20, 1 << 22)
AFTER_MATMUL = 256
AFTER_MATMULS = (1, 4, 16)
AFTER_CALLS = 8
AFTER_ROUNDS = 3
# The handoff's pipelines (handoff_points): (width, heads, context, sequences per micro-batch)
# of a GPT of one block per rank, the first the stage figure's block, each run with p and
# HANDOFF_MICRO x p micro-batches.
HANDOFF_SHAPES = ((8, 2, 4, 1), (64, 4, 64, 2), (128, 4, 64, 4))
HANDOFF_MICRO = 4
HANDOFF_ROUNDS = 3              # rounds over the pipelines, each's step the median over them


def after_compute_points(comm, sizes=AFTER_SIZES, matmuls=AFTER_MATMULS,
                         calls: int = AFTER_CALLS, rounds: int = AFTER_ROUNDS) -> dict:
    """The level's ``after_compute`` curves (:class:`hpcnn.plan.machine.Level`): {"KIND.N":
    [(c, bytes, seconds), ...]}, the same on every rank, for an in-place float32 MPI allreduce
    and an MPI all-to-all in which each rank ends with ``bytes``, an equal part from every
    rank of its group (what the layout executor's redistributions run), each over groups of N
    consecutive ranks (N = 2 where the ranks pair up and there are more than two, and N = all;
    all groups at once).

    Per number k of ``matmuls`` (float32, :data:`AFTER_MATMUL` cubed), kind and size, ``rounds``
    rounds each time four loops of ``calls`` iterations, between barriers: k matmuls alone, k
    matmuls then the call, alone, then the call. A loop's seconds per iteration is the slowest
    rank's; per round, the call's seconds are the mean of the two loops with it minus the mean
    of the two without, and c is the mean of the two without. A curve's figures are the
    medians over rounds, each size's seconds kept at most every larger size's
    (:func:`~.links.never_slower`) and at least 0.

    Back to back or after a barrier, a collective does not meet what it meets in training when
    the ranks share cores: the ranks of a group reach it one by one, each as the scheduler lets
    it finish its compute, and a rank that waits spins on a core another still needs."""
    comm = counted(comm)
    p = comm.size
    groups = {p: comm}
    if p > 2 and p % 2 == 0:
        groups[2] = comm.split(comm.rank // 2, comm.rank)
    calls_of = _collective_calls(comm, groups, sizes)
    a = np.ones((AFTER_MATMUL, AFTER_MATMUL), np.float32)
    out = np.empty_like(a)
    kinds = [(kind, n) for kind in ("allreduce", "alltoall") for n in sorted(groups)]
    got = {(kind, n, k, s): [] for k in matmuls for kind, n in kinds for s in sizes}
    try:
        for _ in range(rounds):
            for kind, n, k, s in got:
                fn = calls_of(kind, n, s)
                fn()                                                  # warms the path
                t = [_matmul_loop(comm, a, out, k, calls, f) for f in (None, fn, None, fn)]
                got[kind, n, k, s].append(((t[0] + t[2]) / 2, (t[1] + t[3] - t[0] - t[2]) / 2))
    finally:
        if 2 in groups and p > 2:
            groups[2].free()
    return comm.bcast_object(_curves(got, kinds, matmuls, sizes), root=0)


def _curves(got: dict, kinds, matmuls, sizes) -> dict:
    """{"KIND.N": [(c, bytes, seconds), ...]} of :func:`after_compute_points`' rounds ``got``:
    medians over rounds, each size's seconds at least 0 and at most every larger size's."""
    curves = {}
    for kind, n in kinds:
        for k in matmuls:
            rows = [got[kind, n, k, s] for s in sizes]
            c = float(np.median([c for per_size in rows for c, _ in per_size]))
            secs = [max(0.0, float(np.median([t for _, t in per_size]))) for per_size in rows]
            curves.setdefault(f"{kind}.{n}", []).extend(
                (c, float(s), t) for s, t in zip(sizes, never_slower(secs)))
    return curves


def _collective_calls(comm, groups: dict, sizes):
    """(kind, n, size) -> a function of no argument making that call of
    :func:`after_compute_points` on its own buffers (made once): an in-place float32 allreduce
    over ``groups[n]``, or an all-to-all over ``groups[n]`` of an equal part from every rank."""
    p = comm.size
    words = {s: max(s // 4, p) for s in sizes}
    bufs = {s: np.zeros(words[s], np.float32) for s in sizes}
    recv = {s: np.zeros(words[s], np.float32) for s in sizes}

    def call(kind, n, s):
        if kind == "allreduce":
            return lambda: groups[n].bare_allreduce(bufs[s])
        counts = [words[s] // n] * n
        return lambda: groups[n].bare_alltoall(bufs[s], recv[s], counts)
    return call


def _matmul_loop(comm, a, out, k: int, calls: int, fn=None) -> float:
    """Seconds per iteration (slowest rank) of ``calls`` iterations of k matmuls a @ a into
    ``out``, each followed by ``fn()`` where given, between barriers."""
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        for _ in range(k):
            np.matmul(a, a, out=out)
        if fn is not None:
            fn()
    return slowest(comm, (time.perf_counter() - t0) / calls)


def handoff_points(comm, machine, weight: float, steps: int = 16, shapes=None,
                   rounds: int = HANDOFF_ROUNDS) -> tuple:
    """Where ranks share cores: (the level's ``handoff`` points [(after_s, seconds), ...], its
    ``bubble_weight``), measured on pipelines through ``hpcnn train``'s step engine.

    Per shape of :data:`HANDOFF_SHAPES` (``shapes``; width, heads, context, sequences per
    micro-batch), :func:`hpcnn.engine.step.train_step` (on the context :func:`hpcnn.train.setup`
    builds) trains a GPT of one block per rank on the bundled sonnet text as a 1F1B pipeline
    over all of ``comm``'s ranks, AdamW, twice: with p micro-batches (fill and drain are most of
    the step) and with :data:`HANDOFF_MICRO` x p (the steady state is), all of them in turn in
    each of ``rounds`` rounds. Each step is the slowest rank's, a run's the median over
    ``steps`` after the first fifth, a pipeline's the median over rounds.
    :func:`hpcnn.plan.hybrid.price` of the same layouts on ``machine`` (the figures measured
    before) with a bubble weight w and a constant handoff h is affine in h: with w = ``weight``
    (what :func:`~hpcnn.plan.calibrate.measure` passes: cores / ranks of the node), one h per
    shape (>= 0) prices its two steps best (least squares of their relative errors). A point is
    (the shape's stage pass, the mean of forward and backward at its 4p micro-batches, its h).

    The weight is cores / ranks, not fitted: in the fill and drain the ranks that compute get
    up to a core each, their rate alone, where the all-at-once rates give each cores / ranks of
    one (fitted with the waits, it wandered between calibrations: the error is flat along w
    against h). A rank that blocks on a peer waits until the scheduler gives that peer a core,
    and the longer its pass, the longer the wait; during a pipeline's fill and drain the ranks
    that compute run faster than the all-at-once rates. With one pipeline both effects cancel;
    two separate them."""
    p = counted(comm).size
    pipes = [(shape, micro) for shape in (HANDOFF_SHAPES if shapes is None else shapes)
             for micro in (p, HANDOFF_MICRO * p)]
    timed = [[_pipeline_step(comm, shape, micro, steps) for shape, micro in pipes]
             for _ in range(rounds)]                       # the pipelines in turn, each round
    runs = [(float(np.median([t[i][0] for t in timed])),) + timed[0][i][1:]
            for i in range(len(pipes))]
    return _fit_handoff([runs[i:i + 2] for i in range(0, len(runs), 2)], machine, weight)


def _pipeline_step(comm, shape: tuple, micro: int, steps: int) -> tuple:
    """(median step, hybrid.Transformer, hybrid.Layout) of a GPT of one block of ``shape``
    (width, heads, context, sequences per micro-batch) per rank of ``comm``, a 1F1B pipeline of
    ``micro`` micro-batches trained ``steps`` steps by the step engine (:func:`handoff_points`)."""
    p = counted(comm).size
    layout = hybrid.Layout(1, 1, p, micro, "1f1b", "none")
    cfg = gpt_config(p, shape, layout, steps)
    return engine_steps(comm, cfg, steps), gpt_model(cfg), layout


def _affine_fit(base, grow, meas) -> float:
    """The x of least squares of the relative errors (base + x grow - meas) / meas, arrays of
    prices affine in x and their measured steps (:func:`_fit_handoff`)."""
    return float(np.sum(grow * (meas - base) / meas**2) / np.sum(grow**2 / meas**2))


def _fit_handoff(runs, machine, weight: float) -> tuple:
    """(points, weight) pricing ``runs`` (per shape, the :func:`_pipeline_step` of its two
    pipelines) best on ``machine`` with the bubble weight ``weight``: one flat handoff per
    shape (:func:`handoff_points`)."""
    def priced(model, layout, h: float) -> float:
        m = replace(machine, levels=tuple(replace(lv, handoff=((0.0, h),), bubble_weight=weight)
                                          for lv in machine.levels))
        return hybrid.price(model, layout, m).step_s

    waits = []
    for pair in runs:
        bare = np.array([priced(mo, lay, 0.0) for _, mo, lay in pair])
        grow = np.array([priced(mo, lay, 1.0) for _, mo, lay in pair]) - bare
        waits.append(max(0.0, _affine_fit(bare, grow, np.array([t for t, _, _ in pair]))))
    points = []
    for pair, h in zip(runs, waits):
        st = hybrid.stage_times(pair[1][1], pair[1][2], machine)
        points.append(((st.t_f + st.t_b) / 2, h))
    out = []                                  # after_s strictly increasing (Level's check)
    for after, wait in sorted(points):
        if not out or after > out[-1][0]:
            out.append((float(after), float(wait)))
    return out, float(weight)
