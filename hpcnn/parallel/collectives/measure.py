"""What ``hpcnn calibrate --write machines/NAME.toml`` measures on the ranks at hand.

- **Network level**: the ranks pair up (0-1, 2-3, ...) and every pair ping-pongs at once, so each
  size is timed while every device communicates (the BSP h-relation a symmetric level stands
  for); a size's one-way time is the median over repeats of the slowest pair. Every round trip
  (and every allreduce below) follows a copy of :data:`COPY_BYTES` on each rank and a barrier
  (:func:`_call_seconds`), unless the node holds more ranks than cores (below):
  in training a message or a collective comes after a pass that evicted its buffers and the
  library's shared-memory cells from the caches, and timed back to back the same calls ran
  1.2-1.6x faster from 64 KiB to 16 MiB here (4-10x below 1 KiB, where the latency lives).
  Priced with the back-to-back figures, the tensor-parallel GPT layouts (four allreduces per
  block, each after a sub-block's compute) measured 1.21x their price on 2 ranks against
  1.06-1.15x for the others (Kendall tau 0.74; 0.89 calibrated cold). When the node holds more
  ranks than cores, the calls are timed back to back: there a copy and a barrier before each
  call measure the scheduler handing the cores over (1.2 ms one way at 8 B, 3.8 ms for a 1 KiB
  allreduce on 4 ranks over 2 cores), not the caches, and priced so the tensor-parallel GPT
  layouts on 4 ranks measured 0.65-0.87x their price and the MLP layouts 0.40-1.17x. The
  8-byte time is the latency L; each larger size s gives a bandwidth piece ending at s with
  bytes_per_s = s / (t(s) - L) (:func:`fit_level`). All ranks form one level "node" whose fan-out
  is the number of ranks: with the ranks at hand nothing finer or coarser can be told apart.
- **Allreduce**: an in-place MPI allreduce per size over all ranks (:func:`allreduce_times`),
  fitted as a ring's steps into the level's ``reduce_bandwidth`` (:func:`fit_reduce`): the
  library's sums and copies make it several times slower than the ring of ping-pong messages.
- **Device**: the matmul rate per dtype, a large copy's memory bandwidth and the block figures
  below, timed on rank 0 alone; then the sustained matmul and copy rates over a wall-clock
  window, alone and on all ranks at once, alternated over rounds, medians
  (:func:`sustained_medians`). The machine file records
  what a rank gets while all compute (:func:`shared_figures`): the figures alone slowed by the
  ratio of the sustained rates, ~1 with a core per rank, ~2 with two ranks per core; when the
  ranks share cores, each block kind's by the ratio of its own reference blocks run over a
  window alone and all at once; with a core per rank, the transformer's element-wise seconds
  by that of a one-block GPT's steps through the step engine.
- **Handoff** (:func:`handoff_points`), only when the node holds more ranks than cores: small
  GPTs of three sizes as 1F1B pipelines over all ranks through the step engine, each with p and
  4p micro-batches, the wait per blocking exchange and the weight of the fill and drain that
  price them all: the level's ``handoff`` points (what a rank waits for a peer to be given a
  core after that much compute) and ``bubble_weight``.
- **Collectives after compute** (:func:`after_compute_points`), only when the node holds more
  ranks than cores: every rank loops over a few matmuls then one collective as the layout
  executor calls it (an in-place allreduce over groups of 2 and of all ranks, an all-to-all over
  all ranks), and the same loop without the call; the difference per call is the collective's
  seconds after that much compute, the wait for the last rank of the group to get a core
  included: the level's ``after_compute`` curves. Priced from the back-to-back figures and the
  pipeline handoff, the 1000 MLP layouts of a 4-rank validation ranked at Kendall tau 0.77;
  re-priced with these curves and the optimizer all at once (below), 0.83. Then two reference
  MLPs under five layouts (and four cut in pairs where ranks pair up) and two data-parallel GPTs
  through the step engine give the ``compute_scale`` by which training's device seconds exceed
  the device figures (the machine file's device is slowed by it), the ``collective_scale`` by
  which the executor's collectives exceed the curves and ``group_scales`` (:func:`layout_scale`);
  the handoff is fitted after them, on the slowed device.
- **Per block kind** (:func:`block_costs`): hpcnn's own blocks, forward and backward, at a tiny
  size (their fixed cost: ``overhead``) and at two reference sizes per kind, a wide and a narrow
  one (:data:`EFFICIENCY_SHAPES`, chosen apart from any experiment's sizes): each round times the
  matmul, then both, and solves time - overhead = FLOPs / (rate x efficiency) + cache bytes x
  elementwise for the two unknowns (the FLOPs and cache bytes from their ``spec()``); the
  linear kind has a third, rectangular reference whose ReLU output is 8x its input, and a third
  unknown, ``activation``, the seconds per byte of that output. The figures are the medians
  over rounds. These are the machine's figures for the framework's
  element-wise passes and per-call cost, not a profile of the model being planned: re-planning
  another width or batch reruns nothing.
- **Per tokens per call** (:func:`tokens_costs`): a ladder of one transformer block on 1 to 8
  sequences a micro-batch (:data:`TOKENS_LADDER`) through the step engine, each rung's time per
  token beyond the fixed cost over the top rung's: the machine's ``tokens`` slowdown of small
  calls. Where ranks share cores, the bottom and top rungs are also timed in sustained windows
  alone and all at once, and the ladder is damped by the ratio of their sharing factors
  (:func:`shared_figures`, :func:`_shared_tokens`).
- **Held activations** (:func:`held_costs`): a GPT through the step engine on one rank, GPipe
  (every micro-batch's activations held at once) against 1F1B (one at a time), the difference
  per byte of the activations held beyond one micro-batch's: ``elementwise["held"]``, what
  fresh memory costs a pipeline that holds many micro-batches.
- **Optimizer update** (:func:`update_costs`): hpcnn's own optimizer step, seconds per parameter
  at a few parameter counts (:data:`UPDATE_SIZES`, each split into :data:`UPDATE_ARRAYS` arrays
  as a layer's weights are), as pieces ((max_params, seconds_per_param), ..., (inf, ...)). A
  step's rate depends on the size: small parameter sets stay in cache, and each array adds a
  fixed Python and dispatch cost, so one memory-bandwidth figure priced models of 1 M
  parameters 2.5-3x too slow here. Again a figure of the machine, not of the model planned.
  Where the node holds more ranks than cores, every rank times its own steps at once (the
  slowest rank's, :func:`update_costs` with ``comm``), as training runs them: there the
  caches and the memory are shared, and rank 0's figures alone, slowed like the matmul,
  priced a 4-rank MLP's AdamW step at 7.2 ns a parameter where it took 3.1 (300 K parameters
  a rank) and at 5.4 where it took 7.7 (1.1 M); all at once, 6.4-7.1 where it took 3.7-3.9
  (0.3-0.6 M) and 7.8 where it took 7.7 (1.1 M) while only 128 Ki and 1 Mi parameters were
  timed between 16 Ki and 8 Mi: the interpolation in log(count) between them missed where the
  ranks' optimizer state leaves the cache, hence the counts timed between them now.

Every rank calls every function here (they contain collectives); medians keep one slow repeat
on a shared machine from deciding the figure. """
from __future__ import annotations

import os
import platform
import time
from dataclasses import replace

import numpy as np

from hpcnn.plan.machine import Device, Level, Machine

SIZES = (8, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26)     # ping-pong bytes: 8 B .. 64 MiB
DTYPES = ("float32", "float64")
MATMUL_N = 768                  # 2 n^3 = 0.9 GFLOP: ~10 ms fp32 on one core
COPY_BYTES = 64 << 20           # 64 MiB: well past the caches
COLD_REPEATS = 15               # ping-pongs and allreduces per size, each after a COPY_BYTES copy
SUSTAIN_S = 0.5                 # wall-clock window of a sustained rate (many scheduler slices)
SUSTAIN_ROUNDS = 5              # windows alone and all at once, alternated (sustained_medians)
# The default --rounds. measure() scales COLD_REPEATS and SUSTAIN_ROUNDS by rounds / FULL_ROUNDS
# (a test's 3 times fewer cold calls and windows, 30 twice as many) and SUSTAIN_S by it up to 1
# (shorter windows below 15; a window is already many scheduler slices).
FULL_ROUNDS = 15
# Reference blocks of the efficiency figures, a wide and a narrow one per kind: GPT blocks of
# width 256, 4 heads on 8 sequences of 64 tokens and of width 64, 2 heads on 32 sequences; a
# Linear and its ReLU, 512 -> 512 on 256 rows and 64 -> 64 on 2048 rows. The overhead figures
# time the same kinds at a tiny size: width 8, 2 heads, one sequence of 4; 8 -> 8 on 1 row.
EFFICIENCY_SHAPES = {"transformer": ((256, 4, (8, 64, 256)), (64, 2, (32, 64, 64))),
                     "linear": ((512, 512, (256, 512)), (64, 64, (2048, 64)),
                                (128, 1024, (512, 128)))}
OVERHEAD_SHAPES = {"transformer": (8, 2, (1, 4, 8)), "linear": (8, 8, (1, 8))}
# The tokens ladder of the slowdown by tokens per call (Device.tokens): a GPT of one block of
# width 192, 6 heads, context 64 (apart from the experiments' width 128) through the step
# engine, micro-batches of 1 .. 8 sequences, 64 to 512 tokens; the transformer kind only.
TOKENS_LADDER = {"transformer": (192, 6, 64, (1, 2, 4, 8))}
# The rows ladder of the linear kind's slowdown by rows per call (Device.tokens["linear"]): a
# Linear and its ReLU, 512 -> 512, on 32 .. 256 rows (the wide efficiency reference's 256 the
# top rung).
LINEAR_ROWS = (512, 512, (32, 64, 128, 256))
# The stage pass figure: a GPT of one block of the transformer overhead's size (vocabulary 16)
# through the step engine, a one-rank 1F1B list of this many micro-batches of one sequence.
STAGE_MICRO = 8
# The held-activations figure (held_costs): a GPT of 2 blocks of width 128, 4 heads, context 64
# (vocabulary 16) on 16 sequences in 16 micro-batches through the step engine, GPipe (20 MB of
# activations held) against 1F1B (1.3 MB): (n_layers, width, heads, context, sequences).
HELD_SHAPE = (2, 128, 4, 64, 16)
# The handoff's pipelines (handoff_points): (width, heads, context, sequences per micro-batch)
# of a GPT of one block per rank, passes from ~0.2 ms (the stage figure's block) to ~4 ms at
# all-busy rates on 4 ranks over 2 cores here, each run with p and HANDOFF_MICRO x p
# micro-batches.
HANDOFF_SHAPES = ((8, 2, 4, 1), (64, 4, 64, 2), (128, 4, 64, 4))
HANDOFF_MICRO = 4
HANDOFF_ROUNDS = 3              # rounds over the pipelines, each's step the median over them
# Parameter counts of the optimizer-update figures (16 Ki .. 8 Mi: in L2, in L3, past it; five
# between 128 Ki and 1 Mi, where 4 ranks' AdamW state on 2 cores leaves the cache here: from 4.4
# ns a parameter at 256 Ki to 7.4 at 768 Ki) and the arrays each count is split into (a layer's
# weights and biases are a few arrays).
UPDATE_SIZES = (1 << 14, 1 << 17, 1 << 18, 1 << 19, 3 << 18, 1 << 20, 1 << 23)
UPDATE_ARRAYS = 4
UPDATE_ROUNDS = 3               # rounds over the sizes the update figures' steps are timed in
UPDATE_OPTIMIZERS = ("adamw", "sgd")
# Collectives after compute (after_compute_points): bytes per call, float32 matmuls of
# AFTER_MATMUL^3 before each call (~0.5, 2 and 8 ms on 4 ranks over 2 cores here), calls per
# timed loop, rounds (loops with and without the call alternate in each).
AFTER_SIZES = (8, 1 << 12, 1 << 16, 1 << 20, 1 << 22)
AFTER_MATMUL = 256
AFTER_MATMULS = (1, 4, 16)
AFTER_CALLS = 8
AFTER_ROUNDS = 3
# The layout executor's reference MLPs (layout_scale): digits features, hidden widths, classes
# and batch (apart from the validation's 64-1024-1024-10 on 256 rows), the per-Linear plans
# ("col": each Linear's output cut over all ranks, "row": its input, "dp": its batch, "rep":
# whole on every rank), the steps of each run and the rounds over them.
LAYOUT_MLP = (64, (512, 512), 10, 128)
LAYOUT_MLPS = (LAYOUT_MLP, (64, (768, 768), 10, 192))    # the plans run on each
LAYOUT_PLANS = (("col", "col", "col"), ("row", "row", "row"), ("dp", "dp", "dp"),
                ("col", "row", "rep"), ("rep", "rep", "rep"))
# Plans whose collectives run over pairs of ranks where they pair up (p > 2, even; "k2": the
# input in 2 parts and the output in p / 2, "k2r": the input in 2 parts, replicated p / 2
# times, "b2": the batch in 2 and the output in p / 2): layout_scale fits their own scale.
LAYOUT_PAIR_PLANS = (("col", "k2", "k2r"), ("k2", "k2", "row"), ("b2", "col", "row"),
                     ("col", "k2", "rep"))
# GPTs data-parallel over all ranks beside them: blocks, width, heads, context, sequences per rank.
LAYOUT_GPTS = ((2, 64, 4, 32, 8), (2, 192, 6, 32, 4))
LAYOUT_STEPS = 16
LAYOUT_ROUNDS = 2


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _repeats(nbytes: int) -> int:
    """Back-to-back calls per size: many for small messages (microseconds each), few for 64 MiB."""
    return 200 if nbytes <= 1 << 10 else 50 if nbytes <= 1 << 16 else 10 if nbytes <= 1 << 20 else 5


def _evictor():
    """A function of no argument that copies :data:`COPY_BYTES` (its buffers made once): the
    memory traffic of a forward or backward pass, which evicts what the next timed call uses."""
    src = np.ones(COPY_BYTES // 8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def _call_seconds(comm, call, nbytes: int, evict=None, cold_repeats: int = COLD_REPEATS) -> list:
    """Seconds of each timed ``call()`` (a collective step every rank makes), after one untimed
    warm-up call: :func:`_repeats` calls back to back, or with ``evict`` (:func:`_evictor`)
    ``cold_repeats`` calls each after ``evict()`` and a barrier (cold, as in training)."""
    comm.Barrier()
    call()                                                   # warms the path
    times = []
    for _ in range(cold_repeats if evict else _repeats(nbytes)):
        if evict:
            evict()
            comm.Barrier()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def pingpong(comm, sizes=SIZES, cold: bool = True, repeats: int = COLD_REPEATS) -> list:
    """One-way seconds per size: all pairs (2i, 2i+1) at once, the slowest pair's median of half
    a round trip (:func:`_call_seconds`: ``repeats`` cold calls with ``cold``, else back to
    back); an odd last rank waits. Needs at least two ranks."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    peer = rank ^ 1 if (rank ^ 1) < size else None
    evict = _evictor() if cold else None
    out = []
    for n in sizes:
        buf = np.zeros(n, dtype=np.uint8)

        def round_trip():
            if peer is not None and rank < peer:
                comm.Send(buf, dest=peer, tag=7)
                comm.Recv(buf, source=peer, tag=7)
            elif peer is not None:
                comm.Recv(buf, source=peer, tag=7)
                comm.Send(buf, dest=peer, tag=7)
        times = _call_seconds(comm, round_trip, n, evict, repeats)
        mine = float(np.median(times)) / 2 if peer is not None else 0.0
        out.append(comm.allreduce(mine, op=MPI.MAX))
    return out


def never_slower(seconds) -> list:
    """Times per increasing message size with each kept at most every larger size's: a smaller
    message is never slower than a larger one (it could be sent padded), so a time above a
    larger size's is a stall while that size was timed, not a cost of its bytes. Where ranks
    share cores one calibration here timed 8 B ping-pongs at 1.4 ms against 33 us at 1 KiB;
    taken as the latency, it priced every message 40x too high."""
    out = [float(t) for t in seconds]
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def fit_level(sizes, seconds, fanout: int, name: str = "node") -> Level:
    """A level from one-way times ``seconds`` at message ``sizes`` (the smallest first), each
    kept at most the larger sizes' (:func:`never_slower`): L = the smallest size's time; a piece
    per larger size s ending at s (the largest at inf) with bytes_per_s = s / (t(s) - L),
    t(s) - L kept >= t(s) / 10 so noise near the latency cannot give an absurd rate; pieces'
    max_bytes increase as the sizes do."""
    if len(sizes) < 2 or len(sizes) != len(seconds) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"fit_level: sizes {list(sizes)} must be >= 2 increasing sizes, one "
                         f"time each (got {len(seconds)})")
    seconds = never_slower(seconds)
    latency = float(seconds[0])
    pieces = [[float(s), s / max(t - latency, t / 10)] for s, t in zip(sizes[1:], seconds[1:])]
    pieces[-1][0] = float("inf")
    return Level(name=name, fanout=fanout, latency_s=latency, bandwidth=tuple(map(tuple, pieces)))


def allreduce_times(comm, sizes=SIZES[1:], cold: bool = True, repeats: int = COLD_REPEATS) -> list:
    """Seconds of an in-place MPI allreduce (float32 sum, what Communicator.allreduce's default
    runs) of each size over all ranks, as training meets it: after computing. With ``cold``
    each call follows a copy of :data:`COPY_BYTES` on every rank and a barrier (the copy evicts
    the buffer and the library's shared-memory cells from the caches as a block's forward or
    backward does), else the calls run back to back (:func:`_call_seconds`); the figure is the
    median of the slowest rank. Back to back the same calls ran 1.2-1.6x faster from 64 KiB to
    16 MiB here (4x at 1 KiB); a 1 MiB allreduce between two transformer blocks' forwards took
    0.26-0.48 ms against 0.17 ms back to back."""
    from mpi4py import MPI
    evict = _evictor() if cold else None
    out = []
    for n in sizes:
        buf = np.zeros(max(n // 4, 1), dtype=np.float32)
        times = _call_seconds(comm, lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), n,
                              evict, repeats)
        out.append(comm.allreduce(float(np.median(times)), op=MPI.MAX))
    return out


def fit_reduce(sizes, seconds, n: int, latency: float) -> tuple:
    """The ``reduce_bandwidth`` pieces of a level from allreduce ``seconds`` per buffer size on
    ``n`` ranks (each kept at most the larger sizes', :func:`never_slower`): a ring's step
    exchanges size/n bytes, so step = t / (2(n-1)) and a piece ends at size/n with rate
    (size/n) / (step - L), step - L kept >= step / 10 (as :func:`fit_level`); the last piece
    reaches infinity."""
    if n < 2 or len(sizes) < 1 or len(sizes) != len(seconds):
        raise ValueError(f"fit_reduce: {n} ranks, sizes {list(sizes)}, {len(seconds)} times: "
                         "expected >= 2 ranks and one time per size")
    seconds = never_slower(seconds)
    pieces = []
    for size, t in zip(sizes, seconds):
        step, part = t / (2 * (n - 1)), size / n
        pieces.append([part, part / max(step - latency, step / 10)])
    pieces[-1][0] = float("inf")
    return tuple(map(tuple, pieces))


def matmul_rate(dtype: str, n: int = MATMUL_N, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` in this process (median of ``repeats``)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    c = np.empty((n, n), dtype=dtype)
    np.matmul(a, b, out=c)                                   # warm-up
    return 2.0 * n ** 3 / _median_seconds(lambda: np.matmul(a, b, out=c), repeats)


def _blocks_pass(kind: str, size: tuple, dtype: str):
    """(run, FLOPs forward, FLOPs backward, cache bytes, the ReLU's cache bytes (its output; 0
    for a transformer block, whose cache is all in the third)) of ``kind``'s blocks at ``size`` (one
    :data:`EFFICIENCY_SHAPES` entry): ``run()`` does one forward and one backward and returns
    their seconds (forward, backward); ``run(True)`` splits the backward as zero-bubble pipelines
    do (the input half, then the deferred weight halves, :mod:`hpcnn.nn.core`) and returns
    (forward, input half, weight half); the figures are the blocks' spec()."""
    from hpcnn.nn.layers import Linear, ReLU
    from hpcnn.nn.transformer import TransformerBlock
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


def _median_pass(run, repeats: int) -> tuple:
    """Median forward and backward seconds of ``repeats`` calls of a :func:`_blocks_pass` run."""
    times = np.array([run() for _ in range(repeats)])
    return float(np.median(times[:, 0])), float(np.median(times[:, 1]))


def block_costs(kind: str, dtype: str, repeats: int = FULL_ROUNDS) -> tuple:
    """(efficiency, overhead seconds, elementwise seconds per cache byte, activation seconds per
    byte of the ReLU's output (None for a kind without one), forward share, (input, weight)
    split, the rounds' matmul rates F) of ``kind``'s blocks in this process.

    The overhead is the median forward + backward of the tiny blocks (:data:`OVERHEAD_SHAPES`).
    Each of ``repeats`` rounds then times the n x n matmul (its rate F) and the reference blocks
    and solves t - overhead = FLOPs / (F e) + bytes c (+ ReLU output bytes a) for 1/e and c
    (and a: the linear kind's third, rectangular reference, an output 8x its input, tells the
    two kinds of bytes apart); the figures are the medians over rounds. A round whose solution
    is not physical falls back to one c for all bytes from the first two references (a = c);
    there, one with e > 1 takes e = 1 and c from the narrow block, one with c < 0 takes c = 0
    and e from the wide block. A change of load during the calibration moves both sides of a
    round's equations alike.

    The forward share is the part of a block's time beyond its matmul FLOPs (fixed cost and
    element-wise passes) spent in its forward: sum over the tiny and reference blocks of
    (t_fwd - FLOPs_fwd / (F e)) over that sum plus the backward's alike, each term at least 0,
    with each round's F and e (a loaded round, whose backward ran at most its FLOPs' time, had
    put a share of 2.8 over the forward's and the whole pass's own differences).
    The FLOPs split 1 : 2 between forward and backward, the rest does not: layer norms, softmax
    and GELU cost about as much forward as backward (on this kind of machine a transformer
    block's forward is ~42 % of its time, not a third).

    The split is what a zero-bubble pipeline's two backward halves each take as a fraction of the
    whole backward, medians over rounds and reference blocks: the halves add up to more than the
    whole (each runs its own passes over dy and the caches; ~1.13 on this kind of machine)."""
    tiny = _blocks_pass(kind, OVERHEAD_SHAPES[kind], dtype)[0]
    o_fwd, o_bwd = _median_pass(tiny, 10 * repeats)
    overhead = o_fwd + o_bwd
    refs = [_blocks_pass(kind, size, dtype) for size in EFFICIENCY_SHAPES[kind]]
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((MATMUL_N, MATMUL_N)).astype(dtype) for _ in range(2))
    c = np.empty_like(a)
    inv_eff, per_byte, per_act, share, halves, rates = [], [], [], [], [], []
    for _ in range(repeats):
        rate = 2.0 * MATMUL_N ** 3 / _median_seconds(lambda: np.matmul(a, b, out=c), 1)
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


ENGINE_VOCAB = 16               # the vocabulary of the step-engine GPTs the calibration runs


def _engine_step(layers: int, dim: int, heads: int, seq: int, sequences: int, dtype: str):
    """``step(schedule, micro)`` -> the result of one step of the one-rank step engine
    (:func:`hpcnn.engine.pipelined.train_step`) over a GPT of ``layers`` blocks (vocabulary
    :data:`ENGINE_VOCAB`) on ``sequences`` random sequences of ``seq`` tokens in ``micro``
    micro-batches: what :func:`stage_costs`, :func:`tokens_costs` and :func:`held_costs` time."""
    from hpcnn.nn.models import gpt
    from hpcnn.parallel.collectives import Communicator
    from hpcnn.engine.pipelined import train_step
    chain = gpt(ENGINE_VOCAB, seq, layers, dim, heads, dtype=dtype)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, ENGINE_VOCAB, (sequences, seq)) for _ in range(2))
    comm = Communicator.single("calibrate")
    return lambda schedule, micro: train_step(schedule, chain, comm, x, y, micro)


def _pass_medians(events) -> tuple:
    """(median F, median B) seconds of a step engine run's timeline ``events``."""
    return tuple(float(np.median([t1 - t0 for _, kind, _, t0, t1 in events if kind == want]))
                 for want in ("F", "B"))


def tokens_costs(kind: str, dtype: str, fixed: float, repeats: int = FULL_ROUNDS) -> tuple:
    """The tokens pieces ((tokens, slowdown), ..., (inf, 1)) of ``kind``'s blocks in this
    process (:class:`hpcnn.plan.machine.Device` ``tokens``), given the fixed seconds of one
    micro-batch's forward + backward through a one-block stage, ``fixed`` (the block's
    overhead, :func:`block_costs`, plus the stage pass's, :func:`stage_costs`).

    The ladder runs through the step engine, as training runs a pipeline's passes: for each of
    the kind's :data:`TOKENS_LADDER` rungs, a one-rank 1F1B list of :data:`STAGE_MICRO`
    micro-batches of that many sequences through a GPT of one such block (vocabulary 16,
    :func:`hpcnn.engine.pipelined.train_step`); a rung's figure is its passes' median F + B
    beyond ``fixed`` per token, its slowdown that over the top rung's; the medians over
    ``repeats`` rounds. Here 1.39-1.44 at 64 tokens, 1.12-1.19 at 128, 0.96-1.03 at 256. The
    same block timed bare (``block_costs``' form) gave 1.67-1.85 at 64 tokens: priced with that,
    a 2-rank validation's pipelines of 32 one-sequence micro-batches ran 0.76-0.90x their price;
    re-priced with a slowdown to the power 0.7 (1.45 at 64 tokens, as through the engine), its
    Kendall tau went 0.79 -> 0.87 and MAPE 11.3 -> 7.5 %."""
    if kind != "transformer":
        raise ValueError(f"tokens_costs: kind {kind!r}: the ladder runs transformer blocks only")
    width, heads, seq, counts = TOKENS_LADDER[kind]
    rungs = [(n, _engine_step(1, width, heads, seq, STAGE_MICRO * n, dtype)) for n in counts]
    for _, step in rungs:
        step("1f1b", STAGE_MICRO)                                           # warm-up

    def per_token() -> list:
        return [max(sum(_pass_medians(step("1f1b", STAGE_MICRO)["events"])) - fixed, 1e-9)
                / (n * seq) for n, step in rungs]
    return _ladder([n * seq for n in counts], per_token, repeats)


def _ladder(sizes, per_unit, repeats: int) -> tuple:
    """Slowdown pieces ((size, slowdown), ..., (inf, 1)) of a ladder of rungs of ``sizes``
    (increasing): ``per_unit()`` times one round, the seconds per unit of each rung; a rung's
    slowdown is its seconds per unit over the top rung's, the median over ``repeats`` rounds
    (:func:`tokens_costs`, :func:`rows_costs`)."""
    ratios = []
    for _ in range(repeats):
        per = per_unit()
        ratios.append([v / per[-1] for v in per])
    slowdown = np.median(np.array(ratios), axis=0)
    return tuple((size, float(f)) for size, f in zip(sizes, slowdown)) + ((np.inf, 1.0),)


def rows_costs(dtype: str, fixed: float, repeats: int = FULL_ROUNDS) -> tuple:
    """The linear kind's tokens pieces ((rows, slowdown), ..., (inf, 1)) in this process
    (:class:`hpcnn.plan.machine.Device` ``tokens``; a Linear's tokens are its rows), given the
    fixed seconds of one forward + backward of a Linear and its ReLU, ``fixed`` (the kind's
    overhead, :func:`block_costs`).

    Each of ``repeats`` rounds times, for each rung of :data:`LINEAR_ROWS`, a Linear and its
    ReLU on that many rows (the median forward + backward of five); a rung's figure is its
    seconds beyond ``fixed`` per row, its slowdown that over the top rung's; the medians over
    rounds. The efficiency is fitted on references of 256-2048 rows, and a matmul's rate falls
    with its rows whatever its weight's shape: here one of 64 rows ran at 0.70-0.76x the rate
    of one of 256 for weights of 512 x 512 to 1024 x 1024 (0.85-0.88x at 128). Without it the
    MLP plans whose middle Linear is cut on its batch (64 or 128 rows a rank) ran 1.15-1.38x
    their price in 4-rank validations (1.10-1.26x at 2 ranks, 128 rows) against 1.03-1.11x for
    the others; re-priced with these factors, the MLP's Kendall tau rose in all seven 2- and
    4-rank validations tried (0.832 -> 0.851, 0.832 -> 0.867, 0.862 -> 0.913 at 4 ranks) and
    its MAPE fell in each."""
    width_in, width_out, counts = LINEAR_ROWS
    rungs = [(n, _blocks_pass("linear", (width_in, width_out, (n, width_in)), dtype)[0])
             for n in counts]
    return _ladder([float(n) for n in counts],
                   lambda: [max(sum(_median_pass(run, 5)) - fixed, 1e-9) / n for n, run in rungs],
                   repeats)


def stage_costs(dtype: str, repeats: int = FULL_ROUNDS) -> tuple | None:
    """(seconds per forward + backward of a pipeline stage pass beyond its transformer blocks,
    the forward's share of them) in this process, or None where they measure nothing.

    The step engine (:func:`hpcnn.engine.pipelined.train_step`, the executor every ``hpcnn
    train`` step runs) runs a one-rank 1F1B list of :data:`STAGE_MICRO` micro-batches of a tiny
    GPT (token and position embedding, one transformer block of the overhead's size
    :data:`OVERHEAD_SHAPES`, final LayerNorm, LM head, loss): each pass's F and B instruction
    as its timeline times it, less the tiny block's own forward and backward timed alone; the
    medians over ``repeats`` rounds. What is left is what every micro-batch's pass costs besides
    its blocks: the instruction's handling, the embedding, the tail's small calls, the loss. A
    figure of the framework on this machine, like the blocks' overhead, not of a model planned:
    the GPT planned has none of these sizes."""
    dim, heads, (rows, seq, _) = OVERHEAD_SHAPES["transformer"]
    step = _engine_step(1, dim, heads, seq, STAGE_MICRO * rows, dtype)
    block = _blocks_pass("transformer", OVERHEAD_SHAPES["transformer"], dtype)[0]
    step("1f1b", STAGE_MICRO)                                               # warm-up
    fwd, bwd = [], []
    for _ in range(repeats):
        f, b = _pass_medians(step("1f1b", STAGE_MICRO)["events"])
        bf, bb = _median_pass(block, 5)
        fwd.append(max(f - bf, 0.0))
        bwd.append(max(b - bb, 0.0))
    f, b = float(np.median(fwd)), float(np.median(bwd))
    return (f + b, f / (f + b)) if f > 0 and b > 0 else None


def held_costs(dtype: str, repeats: int = FULL_ROUNDS) -> float:
    """Seconds per byte of the activations a pipeline stage holds beyond one micro-batch's
    (:func:`hpcnn.plan.hybrid.held_seconds`), in this process: each of ``repeats`` rounds runs
    one step of a one-rank GPipe list and one of a 1F1B list of the step engine
    (:func:`hpcnn.engine.pipelined.train_step`) over the same :data:`HELD_SHAPE` GPT, one
    micro-batch a sequence, and takes the difference of their times over the difference of
    their held bytes as the price counts them (:func:`hpcnn.plan.hybrid._held_bytes`); the
    median over rounds, at least 0. Both lists run the same passes: what differs is that
    GPipe's forwards take fresh memory for every micro-batch's caches, and its backwards read
    them long after. 0.22-0.33 ns a byte here for 8-32 micro-batches of 16-64 sequences."""
    from hpcnn.plan import hybrid
    layers, dim, heads, seq, rows = HELD_SHAPE
    step = _engine_step(layers, dim, heads, seq, rows, dtype)
    model = hybrid.Transformer(layers, dim, heads, seq, ENGINE_VOCAB, rows, dtype)
    held = {s: hybrid._held_bytes(model, hybrid.Layout(1, 1, 1, rows, s), 0, layers)
            for s in ("gpipe", "1f1b")}
    for schedule in held:                                                # warm-up
        step(schedule, rows)
    per_byte = []
    for _ in range(repeats):
        t = {}
        for schedule in held:
            t0 = time.perf_counter()
            step(schedule, rows)
            t[schedule] = time.perf_counter() - t0
        per_byte.append((t["gpipe"] - t["1f1b"]) / (held["gpipe"] - held["1f1b"]))
    return max(0.0, float(np.median(per_byte)))


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
    (:func:`never_slower`) and at least 0.

    Back to back or after a barrier, a collective does not meet what it meets in training when
    the ranks share cores: the ranks of a group reach it one by one, each as the scheduler lets
    it finish its compute, and a rank that waits spins on a core another still needs. On 4
    ranks over 2 cores here a 1 MiB allreduce over all took 0.80-1.05 ms after 0.5-8 ms of
    compute against 0.55 ms back to back, an all-to-all of 1 MiB 0.45-0.75 ms. Figures of the
    machine's scheduler and MPI, not of a model planned."""
    p = comm.Get_size()
    groups = {p: comm}
    if p > 2 and p % 2 == 0:
        groups[2] = comm.Split(color=comm.Get_rank() // 2, key=comm.Get_rank())
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
            groups[2].Free()
    curves = {}
    for kind, n in kinds:
        for k in matmuls:
            rows = [got[kind, n, k, s] for s in sizes]
            c = float(np.median([c for per_size in rows for c, _ in per_size]))
            secs = [max(0.0, float(np.median([t for _, t in per_size]))) for per_size in rows]
            curves.setdefault(f"{kind}.{n}", []).extend(
                (c, float(s), t) for s, t in zip(sizes, never_slower(secs)))
    return comm.bcast(curves, root=0)


def _collective_calls(comm, groups: dict, sizes):
    """(kind, n, size) -> a function of no argument making that call of
    :func:`after_compute_points` on its own buffers (made once): an in-place float32 allreduce
    over ``groups[n]``, or an all-to-all over ``groups[n]`` of an equal part from every rank."""
    from mpi4py import MPI
    p = comm.Get_size()
    words = {s: max(s // 4, p) for s in sizes}
    bufs = {s: np.zeros(words[s], np.float32) for s in sizes}
    recv = {s: np.zeros(words[s], np.float32) for s in sizes}

    def call(kind, n, s):
        if kind == "allreduce":
            return lambda: groups[n].Allreduce(MPI.IN_PLACE, bufs[s], op=MPI.SUM)
        counts = [words[s] // n] * n
        return lambda: groups[n].Alltoallv([bufs[s], counts], [recv[s], counts])
    return call


def _matmul_loop(comm, a, out, k: int, calls: int, fn=None) -> float:
    """Seconds per iteration (slowest rank) of ``calls`` iterations of k matmuls a @ a into
    ``out``, each followed by ``fn()`` where given, between barriers."""
    from mpi4py import MPI
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        for _ in range(k):
            np.matmul(a, a, out=out)
        if fn is not None:
            fn()
    return comm.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX)


def handoff_points(comm, machine, weight: float, steps: int = 16, shapes=None,
                   rounds: int = HANDOFF_ROUNDS) -> tuple:
    """Where ranks share cores: (the level's ``handoff`` points [(after_s, seconds), ...], its
    ``bubble_weight``), measured on pipelines through ``hpcnn train``'s step engine.

    Per shape of :data:`HANDOFF_SHAPES` (``shapes``; width, heads, context, sequences per
    micro-batch), :func:`hpcnn.engine.step.train_step` (on the context :func:`hpcnn.train.train`
    sets up) trains a GPT of one block per rank on the bundled sonnet text as a 1F1B pipeline
    over all of ``comm``'s ranks, AdamW, twice: with p micro-batches (fill and drain are most of
    the step) and with :data:`HANDOFF_MICRO` x p (the steady state is), all of them in turn in
    each of ``rounds`` rounds. Each step is the slowest rank's, a run's the median over
    ``steps`` after the first fifth, a pipeline's the median over rounds (when the weight was
    fitted too, one round each, four fits in a row here gave w 0.25-0.41, and the calibrations
    of the 4-rank validations 0.16-0.76). :func:`hpcnn.plan.hybrid.price` of
    the same layouts on ``machine`` (the figures measured before) with a bubble weight w and a
    constant handoff h is affine in h: with w = ``weight`` (what :func:`measure` passes:
    cores / ranks of the node, below), one h per shape (>= 0) prices its two steps best (least
    squares of their relative errors). A point is (the shape's stage pass, the mean of forward
    and backward at its 4p micro-batches, its h).

    The weight is cores / ranks, not fitted: in the fill and drain the ranks that compute get
    up to a core each, their rate alone, where the all-at-once rates give each cores / ranks of
    one. Fitted with the waits, it ranged 0.08-0.76 between calibrations (the error is flat
    along w against h), and re-priced at 0.5 (their waits as fitted) four 4-rank validations'
    71 GPT layouts ranked at Kendall tau 0.776 -> 0.787, 0.801 -> 0.818, 0.771 -> 0.812 and
    0.835 -> 0.841, the MAPE lower in each (14.2 -> 9.4 % in the third); tau moved by at most
    0.015 over w in 0.4-0.6.

    When a node holds more ranks than cores, a rank that blocks on a peer (a receive, a
    collective) waits until the scheduler gives that peer a core, and the longer its pass, the
    longer the wait (on 4 ranks over 2 cores here 50-220 us after 0.9 ms passes, 40-90 us after
    0.2 ms ones); during a pipeline's fill and drain the ranks that compute ran faster than the
    all-at-once rates (fitted, w 0.26-0.57). With one pipeline both effects cancel (without
    either, a 4-stage pipeline of 1.1 ms passes ran 1.00-1.09x its price at 8 micro-batches,
    1.22-1.24x at 32); two separate them.
    Back-to-back timings (:func:`pingpong`, every rank in step) see neither. Figures of the
    machine's scheduler and the framework, like the stage pass, not of a model planned: the
    shapes are fixed here."""
    p = comm.Get_size()
    pipes = [(shape, micro) for shape in (HANDOFF_SHAPES if shapes is None else shapes)
             for micro in (p, HANDOFF_MICRO * p)]
    timed = [[_pipeline_step(comm, shape, micro, steps) for shape, micro in pipes]
             for _ in range(rounds)]                       # the pipelines in turn, each round
    runs = [(float(np.median([t[i][0] for t in timed])),) + timed[0][i][1:]
            for i in range(len(pipes))]
    return _fit_handoff([runs[i:i + 2] for i in range(0, len(runs), 2)], machine, weight)


def layout_scale(comm, machine, plans=LAYOUT_PLANS, steps: int = LAYOUT_STEPS,
                 rounds: int = LAYOUT_ROUNDS, pair_plans=LAYOUT_PAIR_PLANS,
                 gpts=LAYOUT_GPTS) -> tuple:
    """Where ranks share cores: (``compute_scale``, ``collective_scale``, ``group_scales``), by
    how much training through the step engine took longer than ``machine`` (the figures
    measured before) prices it: its device's seconds and the layout executor's collectives
    against the ``after_compute`` curves, the same on every rank.

    Each reference MLP of :data:`LAYOUT_MLPS` is trained ``steps`` steps by the step engine on
    the digits data under each of ``plans`` (per Linear "col", "row", "dp" or "rep" over all of
    ``comm``'s ranks) and, where the machine has curves over pairs of ranks and the ranks
    pair up (more than two, even), ``pair_plans`` (:data:`LAYOUT_PAIR_PLANS`), and each GPT of
    ``gpts`` (:data:`LAYOUT_GPTS`) data-parallel over all ranks, ``rounds`` rounds in turn; each
    step is the slowest rank's, a run's the median after the first fifth, a reference's the
    median over rounds. Its price (:func:`hpcnn.plan.cost.strategy_cost`,
    :func:`hpcnn.plan.hybrid.price`) is affine in the three scales: the device's seconds times
    c (:meth:`~hpcnn.plan.machine.Device.slowed`), its collectives priced from the curves times
    k, those over pairs times k2 where pair plans ran; the scales of least squares of the
    relative errors over the references (:func:`_fit_scale`).

    The curves time a collective after a loop of matmuls, every rank alike; in training the
    ranks reach the layout executor's collectives after its Linears, ReLUs and copies: on 4
    ranks over 2 cores here, one calibration's curves priced the collectives of the
    validation's 1000 MLP plans at 0.41x (median) the seconds the ranks spent inside them,
    and re-priced with the curves times 1.5 their Kendall tau rose from 0.80 to 0.82 and their
    MAPE fell from 12.7 % to 8.4 %. With one scale fitted on plans whose collectives span all
    ranks, the plans cut in pairs ran 0.79-0.90x their price in a 1000-plan validation (the
    fastest of them, col-b1k2j2-b1k2j1, 0.90x, 12 % faster than the planner's choice); fitted
    apart on the four pair plans, k2 was 0.905 where k was 1.32 (one probe, 3 rounds).
    The device's figures where ranks share cores are rank 0's alone times the ratio of windows
    alone and all at once (:func:`shared_figures`), and between calibrations hours apart their
    level drifted by ~20 % more than training did: one 4-rank validation's layouts ran
    1.02-1.47x their price (MAPE 13.4 % GPT, 21.8 % MLP) and its MLP's compute-only reference
    ("rep" everywhere) ran 1.5x its price the next morning; re-priced with the device's seconds
    x1.2, MAPE 7.3 % and 9.7 %. Fitted in a later validation's three calibrations (c 0.99, 1.22,
    1.13; c and k trade against each other between calibrations, their sum less so), its
    layouts' MAPE was 6.9 % (GPT) and 11.8 % (MLP), priced without c 14.5 % and 19.7 %; in the
    next, 7.6 % and 16.9 %: the 512-wide reference's plans had run 1.03x their price (median),
    a 768-wide MLP's 1.095x, the validation's 1024-wide 1.21x. With both references
    (:data:`LAYOUT_MLPS`), the run after measured MAPE 7.9 % and 12.2 %. A
    figure of the step engine on this machine, like the handoff of the pipelines: the
    reference sizes are fixed here, and re-planning another model reruns nothing."""
    pairs = (comm.Get_size() > 2 and comm.Get_size() % 2 == 0
             and any(k.endswith(".2") for k in machine.levels[0].after_compute))
    refs = _references(comm, tuple(plans) + (tuple(pair_plans) if pairs else ()), gpts, steps)
    runs = {name: [] for name in refs}
    for _ in range(rounds):
        for name, (run, _) in refs.items():
            runs[name].append(run())
    return comm.bcast(_fit_scale([(float(np.median(runs[name])), price)
                                  for name, (_, price) in refs.items()],
                                 machine, (2,) if pairs else ()), root=0)


def _references(comm, plans, gpts, steps: int) -> dict:
    """{name: (run: () -> measured step, price: machine -> seconds)} of :func:`layout_scale`'s
    references over ``comm``'s ranks: each MLP of :data:`LAYOUT_MLPS` under each of ``plans``
    and each GPT of ``gpts`` data-parallel, ``steps`` steps each run."""
    from hpcnn.schedule.placement import Cut
    from hpcnn.plan import cost, hybrid
    p = comm.Get_size()
    make = {"col": Cut(1, 1, p), "row": Cut(1, p, 1), "dp": Cut(p, 1, 1), "rep": Cut(1, 1, 1)}
    if p % 2 == 0:
        make.update(k2=Cut(1, 2, p // 2), k2r=Cut(1, 2, 1), b2=Cut(2, 1, p // 2))
    refs = {}
    for mlp in LAYOUT_MLPS:
        n_in, hidden, n_out, batch = mlp
        graph = cost.mlp_graph([n_in, *hidden, n_out], batch)
        for plan in plans:
            cuts = [make[c] for c in plan]
            refs[f"{hidden[0]}:" + "-".join(plan)] = (
                lambda cuts=cuts, mlp=mlp: _layout_step(comm, cuts, steps, mlp),
                lambda m, cuts=cuts, g=graph: cost.strategy_cost(g, cuts, m).seconds)
    layout = hybrid.Layout(p, 1, 1, 1)
    for layers, *shape in gpts:
        cfg = _gpt_config(layers, shape, layout, steps)
        refs[f"gpt{layers}x{shape[0]}"] = (
            lambda cfg=cfg: _engine_steps(comm, cfg, steps),
            lambda m, model=_gpt_model(cfg): hybrid.price(model, layout, m).step_s)
    return refs


def _layout_step(comm, cuts, steps: int, mlp=LAYOUT_MLP) -> float:
    """The median step (slowest rank, after the first fifth) of ``mlp`` (inputs, hidden widths,
    classes, batch; default :data:`LAYOUT_MLP`) laid out by
    ``cuts`` over ``comm``'s ranks, ``steps`` steps of ``hpcnn train``'s step engine (each rank
    reads its own copy of the plan file)."""
    import tempfile

    from hpcnn.config import TrainConfig
    from hpcnn.schedule.placement import write_plan
    n_in, hidden, _, batch = mlp
    fd, path = tempfile.mkstemp(suffix=".json", prefix="hpcnn-layout-")
    os.close(fd)
    try:
        write_plan(path, cuts, comm.Get_size())
        cfg = TrainConfig(model="mlp", dataset="digits", hidden=hidden, batch_size=batch,
                          tp=comm.Get_size(), plan=path, dtype="float32", allreduce="mpi",
                          progress=False, eval_interval=0, steps=steps).resolved()
        return _engine_steps(comm, cfg, steps)
    finally:
        os.unlink(path)


def _fit_scale(runs, machine, groups=()) -> tuple:
    """(``compute_scale``, ``collective_scale``, ``group_scales``) pricing ``runs`` ((measured
    step, price: machine -> seconds), :func:`layout_scale`) best on ``machine``: the least
    squares of the relative errors, the price affine in the device's slowdown c, in the scale of
    the curves of each group size in ``groups`` and in the scale of the others. The curves are
    read at the compute seconds before the collective, which c lengthens: two passes, the
    second at the first's c. A scale no run's price depends on is 1, each other kept >= 0.1
    (after the fit: not a bounded least squares)."""
    meas = np.array([t for t, _ in runs])
    n = 1 + len(groups)

    def priced(c: float, scales) -> np.ndarray:
        m = replace(machine, device=machine.device.slowed(c), levels=tuple(
            replace(lv, collective_scale=scales[0], group_scales=tuple(zip(groups, scales[1:])))
            for lv in machine.levels))
        return np.array([price(m) for _, price in runs])

    c, scales, tiny = 1.0, np.ones(n), 1e-9                  # a scale -> 0: no such collectives
    for _ in range(2):
        bare = priced(c, [tiny] * n)
        grow = np.column_stack([priced(c, [1.0 if j == i else tiny for j in range(n)]) - bare
                                for i in range(n)])
        used = np.any(grow != 0, axis=0)
        a = np.column_stack([bare, grow[:, used]]) / meas[:, None]
        x = np.linalg.lstsq(a, np.ones(len(meas)), rcond=None)[0]
        c = max(c * float(x[0]), 0.1)
        scales[used] = np.maximum(x[1:], 0.1)
    scales = [float(f"{k:.4g}") if u else 1.0 for k, u in zip(scales, used)]
    return float(f"{c:.4g}"), scales[0], tuple((g, k) for g, k, u in zip(groups, scales[1:],
                                                                        used[1:]) if u)


def _affine_fit(base, grow, meas) -> float:
    """The x of least squares of the relative errors (base + x grow - meas) / meas, arrays of
    prices affine in x and their measured steps (:func:`_fit_handoff`)."""
    return float(np.sum(grow * (meas - base) / meas**2) / np.sum(grow**2 / meas**2))


def _engine_steps(comm, cfg, steps: int) -> float:
    """The median over the steps after the first fifth of the slowest rank's step of ``cfg``
    (resolved) trained ``steps`` steps by :func:`hpcnn.engine.step.train_step` on the context
    :func:`hpcnn.train.train` sets up over ``comm``."""
    from mpi4py import MPI

    from hpcnn.engine.step import train_step
    from hpcnn.train import _setup
    cfg, ctx, task, opt, _ = _setup(cfg, comm, None)
    times = []
    try:
        t0 = time.perf_counter()
        for step in range(steps):
            row = train_step(ctx, task, opt, step, t0)[0]
            times.append(comm.allreduce(row["step_time"], op=MPI.MAX))
    finally:
        ctx.free()
    return float(np.median(times[steps // 5:]))


def _pipeline_step(comm, shape: tuple, micro: int, steps: int) -> tuple:
    """(median step, hybrid.Transformer, hybrid.Layout) of a GPT of one block of ``shape``
    (width, heads, context, sequences per micro-batch) per rank of ``comm``, a 1F1B pipeline of
    ``micro`` micro-batches trained ``steps`` steps by the step engine (:func:`handoff_points`)."""
    from hpcnn.plan import hybrid
    p = comm.Get_size()
    layout = hybrid.Layout(1, 1, p, micro, "1f1b", "none")
    cfg = _gpt_config(p, shape, layout, steps)
    return _engine_steps(comm, cfg, steps), _gpt_model(cfg), layout


def _gpt_config(layers: int, shape, layout, steps: int):
    """The resolved :class:`hpcnn.config.TrainConfig` of a GPT of ``layers`` blocks of
    ``shape`` (width, heads, context, sequences per micro-batch per replica) laid out by
    ``layout`` (:class:`hpcnn.plan.hybrid.Layout`, no tensor cut) on the bundled sonnet data,
    float32, trained ``steps`` steps."""
    from hpcnn.config import TrainConfig
    dim, heads, seq, rows = shape
    return TrainConfig(model="gpt", dataset="sonnet", n_layers=layers, dim=dim, n_heads=heads,
                       block_size=seq, batch_size=layout.dp * layout.microbatches * rows,
                       dp=layout.dp, tp=layout.tp, pp=layout.pp,
                       microbatches=layout.microbatches, schedule=layout.schedule,
                       dtype="float32", allreduce="mpi", progress=False, eval_interval=0,
                       steps=steps).resolved()


def _gpt_model(cfg):
    """The :class:`hpcnn.plan.hybrid.Transformer` the planner prices for ``cfg``
    (:func:`_gpt_config`)."""
    from hpcnn import datasets as data
    from hpcnn.plan import hybrid
    return hybrid.Transformer(cfg.n_layers, cfg.dim, cfg.n_heads, cfg.block_size,
                              data.for_config(cfg).vocab, cfg.batch_size, "float32")


def _fit_handoff(runs, machine, weight: float) -> tuple:
    """(points, weight) pricing ``runs`` (per shape, the :func:`_pipeline_step` of its two
    pipelines) best on ``machine`` with the bubble weight ``weight``: one flat handoff per
    shape (:func:`handoff_points`)."""
    from hpcnn.plan import hybrid

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


def _update_step(optimizer: str, n: int, dtype: str, rng):
    """One step of hpcnn's ``optimizer`` as ``hpcnn train`` builds it with its default options
    (:func:`hpcnn.nn.optim.make_optimizer`, the momentum and weight decay of
    :class:`hpcnn.config.TrainConfig`) over ``n`` parameters in :data:`UPDATE_ARRAYS` arrays with
    their gradients set, as a function of no argument, after a warm-up step (the first step
    allocates the optimizer's state)."""
    from hpcnn.config import TrainConfig
    from hpcnn.nn.core import Parameter
    from hpcnn.nn.optim import make_optimizer
    params = []
    for i in range(UPDATE_ARRAYS):                          # n split as evenly as it goes
        count = n // UPDATE_ARRAYS + (i < n % UPDATE_ARRAYS)
        p = Parameter(rng.standard_normal(count).astype(dtype), f"w{i}")
        p.grad = rng.standard_normal(count).astype(dtype)
        params.append(p)
    defaults = TrainConfig()
    opt = make_optimizer(optimizer, params, momentum=defaults.momentum,
                         weight_decay=defaults.weight_decay)
    opt.step(1e-3)                                           # warm-up
    return lambda: opt.step(1e-3)


def update_repeats(rounds: int) -> int:
    """Timed optimizer steps per size for a calibration of ``rounds`` block rounds: 7/5 of them
    (21 at the default 15), at least one per :data:`UPDATE_ROUNDS` round; each follows a 64 MiB
    copy, so at a test's 3 rounds the 21 had been most of a one-rank calibration."""
    return max(UPDATE_ROUNDS, 7 * rounds // 5)


def update_costs(optimizer: str, dtype: str = "float32", sizes=UPDATE_SIZES,
                 repeats: int = 21, comm=None) -> tuple:
    """Seconds per parameter of one step of hpcnn's ``optimizer`` ("adamw", "sgd") in this
    process, as pieces ((max_params, seconds_per_param), ..., (inf, seconds_per_param)) for
    :attr:`hpcnn.plan.machine.Device.update`: one piece per size N of ``sizes`` (increasing),
    t(N) / N where t(N) is the median of ``repeats`` steps over N ``dtype`` parameters
    (:func:`_update_step`); then a last piece to infinity with the largest size's figure. The
    steps are timed in :data:`UPDATE_ROUNDS` rounds over the sizes, so that a burst of load on a
    shared machine does not fall on all the steps of one size. Each timed step follows a copy
    of :data:`COPY_BYTES`: in training the forward and backward run between two updates and
    evict the optimizer's arrays from the caches (timed back to back, warm, AdamW on a 1 M-param
    MLP took 1.8 ns a parameter; in its training runs 2.65; after such a copy 2.1-2.7).
    With ``comm`` (every rank calls), every rank steps its own parameters at once, each step
    after the copy and a barrier, and a step's time is the slowest rank's."""
    sizes = list(sizes)
    if (not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < UPDATE_ARRAYS
                         for n in sizes) or sizes != sorted(set(sizes))):
        raise ValueError(f"update_costs: sizes = {sizes}: expected increasing integers >= "
                         f"{UPDATE_ARRAYS} (parameters)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"update_costs: repeats = {repeats!r}: expected an integer >= 1")
    rng = np.random.default_rng(0)
    steps = [_update_step(optimizer, n, dtype, rng) for n in sizes]
    evict = _evictor()
    times = [[] for _ in sizes]
    for r in range(UPDATE_ROUNDS):
        count = repeats // UPDATE_ROUNDS + (r < repeats % UPDATE_ROUNDS)
        for step, out in zip(steps, times):
            for _ in range(count):
                evict()                                      # the forward and backward's traffic
                if comm is None:
                    out.append(_median_seconds(step, 1))
                else:
                    from mpi4py import MPI
                    comm.Barrier()
                    out.append(comm.allreduce(_median_seconds(step, 1), op=MPI.MAX))
    pieces = tuple((float(n), float(np.median(t)) / n) for n, t in zip(sizes, times))
    return pieces + ((float("inf"), pieces[-1][1]),)


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes/s of a large copy counted as STREAM does: read + written bytes over the time."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)                                      # touch the pages first
    return 2.0 * src.nbytes / _median_seconds(lambda: np.copyto(dst, src), repeats)


def memory_bytes(ranks_here: int = 1) -> float:
    """Physical memory of this node shared by the ``ranks_here`` ranks on it."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks_here


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def device_rates(rounds: int = FULL_ROUNDS) -> dict:
    """Matmul FLOP/s per dtype, copy bytes/s and the float32 block figures of this process:
    {"float32": .., "copy": .., "efficiency.transformer": .., "overhead.transformer": ..,
    "elementwise.transformer": .., "activation.linear": .., "forward.transformer": ..,
    "split.transformer": (in, w), "overhead.stage": .., "forward.stage": .. (the stage pass,
    :func:`stage_costs`), "elementwise.held": .. (:func:`held_costs`),
    "tokens.transformer": ((tokens, slowdown), ...), "tokens.linear": ((rows, slowdown), ...),
    "update.adamw": ((max_params, seconds_per_param), ...)}.

    The float32 matmul rate is the median of the rates :func:`block_costs` timed in its rounds
    (30 at the default 15 rounds, spread over the block timings), the rate every efficiency is
    a fraction of; float64's is its own median of five calls moved in the same proportion as
    float32's. Taken as five calls at one moment, rank 0's float32 rate alone had ranged
    139-179 GFLOP/s within one 4-rank validation's three calibrations (128-186 over four
    validations) and, with the transformer's efficiency at its cap of 1, set the GPT's compute
    price alone."""
    rates = {dt: matmul_rate(dt) for dt in DTYPES}
    rates["copy"] = copy_bandwidth()
    rounds_f32 = []
    for kind in EFFICIENCY_SHAPES:
        (rates[f"efficiency.{kind}"], rates[f"overhead.{kind}"], rates[f"elementwise.{kind}"],
         act, rates[f"forward.{kind}"], rates[f"split.{kind}"], got) = block_costs(
            kind, "float32", rounds)
        rounds_f32 += got
        if act is not None:
            rates[f"activation.{kind}"] = act
    # the matmul rate the efficiencies were solved against (above)
    level = float(np.median(rounds_f32)) / rates["float32"]
    for dt in DTYPES:
        rates[dt] *= level
    stage = stage_costs("float32", rounds)
    if stage is not None:
        rates["overhead.stage"], rates["forward.stage"] = stage
    for kind in TOKENS_LADDER:                  # through the step engine: the stage pass too
        rates[f"tokens.{kind}"] = tokens_costs(
            kind, "float32", rates[f"overhead.{kind}"] + (stage[0] if stage else 0.0), rounds)
    rates["tokens.linear"] = rows_costs("float32", rates["overhead.linear"], rounds)
    rates["elementwise.held"] = held_costs("float32", rounds)
    for optimizer in UPDATE_OPTIMIZERS:
        rates[f"update.{optimizer}"] = update_costs(optimizer, repeats=update_repeats(rounds))
    return rates


def sustained_rates(seconds: float = SUSTAIN_S, blocks: bool = False,
                    engine: bool = False) -> dict:
    """{"float32", "float64": matmul FLOP/s, "copy": bytes/s}, with ``blocks`` "block.KIND":
    forward + backward passes per second of the kind's wide and narrow reference blocks
    (:data:`EFFICIENCY_SHAPES`), with ``engine`` or ``blocks`` "engine.KIND": steps per second
    of the kind's top :data:`TOKENS_LADDER` rung through the one-rank step engine (a one-block
    GPT, 1F1B over :data:`STAGE_MICRO` micro-batches), with ``blocks`` also "engine_low.KIND",
    its bottom rung's (:func:`_shared_tokens`), as the work done over a wall-clock window of
    ``seconds`` each: when ranks outnumber cores the scheduler shares a core in slices of
    milliseconds, which the median of single calls misses and a window's mean counts."""
    out = {}
    rng = np.random.default_rng(0)
    for dt in DTYPES:
        a, b = (rng.standard_normal((MATMUL_N, MATMUL_N)).astype(dt) for _ in range(2))
        c = np.empty_like(a)
        out[dt] = 2.0 * MATMUL_N ** 3 / _window_seconds(lambda: np.matmul(a, b, out=c), seconds)
    src = np.ones(COPY_BYTES // 8)
    dst = np.empty_like(src)
    out["copy"] = 2.0 * src.nbytes / _window_seconds(lambda: np.copyto(dst, src), seconds)
    for kind, shapes in EFFICIENCY_SHAPES.items() if blocks else ():   # wide and narrow refs
        runs = [_blocks_pass(kind, shape, "float32")[0] for shape in shapes[:2]]
        out[f"block.{kind}"] = 1.0 / _window_seconds(lambda: [run() for run in runs], seconds)
    for kind, (width, heads, seq, counts) in TOKENS_LADDER.items() if engine or blocks else ():
        rungs = (("engine", counts[-1]),) + ((("engine_low", counts[0]),) if blocks else ())
        for name, sequences in rungs:                           # the top rung, the bottom's
            step = _engine_step(1, width, heads, seq, STAGE_MICRO * sequences, "float32")
            out[f"{name}.{kind}"] = 1.0 / _window_seconds(lambda: step("1f1b", STAGE_MICRO),
                                                          seconds)
    return out


def sustained_medians(comm, window: float, blocks: bool, rounds: int,
                      engine: bool = False) -> tuple:
    """(alone, together) sustained rates (:func:`sustained_rates` over ``window`` seconds, with
    the reference blocks when ``blocks``, the step engine's GPT when ``engine``): rank 0's by
    itself and the slowest rank's while every rank runs at once, alternated ``rounds`` times,
    each figure the median over its rounds, the same on every rank (:func:`shared_figures`
    takes their ratios).

    On 4 ranks over 2 cores here one pair of 0.5 s windows put the float32 rate all at once at
    61-71 GFLOP/s within a minute, and four calibrations' per-kind factors ranged 2.02-2.35
    (linear) and 2.13-3.06 (transformer); every figure priced on the shared cores divides by
    these. Alternated rounds and medians, as the benchmarks measure, so that a burst of load on
    one window does not set the calibration's level."""
    from mpi4py import MPI
    alone, together = [], []
    for _ in range(rounds):
        if comm.Get_rank() == 0:
            alone.append(sustained_rates(window, blocks, engine))
        _quiet_barrier(comm)                               # the others sleep meanwhile
        mine = sustained_rates(window, blocks, engine)     # every rank at once
        together.append({k: comm.allreduce(v, op=MPI.MIN) for k, v in mine.items()})
    alone = comm.bcast(alone, root=0)
    return tuple({k: float(np.median([r[k] for r in runs])) for k in runs[0]}
                 for runs in (alone, together))


def _window_seconds(fn, seconds: float) -> float:
    """Mean seconds of ``fn`` over as many calls as fit in ``seconds`` of wall time (one warm-up
    call first, at least three timed)."""
    fn()
    count, t0 = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - t0 < seconds:
        fn()
        count += 1
    return (time.perf_counter() - t0) / count


def _quiet_barrier(comm) -> None:
    """A barrier that sleeps while it waits: MPICH's blocking Barrier spins, and a spinning rank
    would take the core from rank 0 while it is timed alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def shared_figures(alone: dict, alone_sustained: dict, together_sustained: dict) -> dict:
    """The device figures of a rank while every rank computes, from rank 0's figures alone and the
    sustained rates alone and all at once (:func:`sustained_rates`, slowest rank).

    Each sustained figure's ratio alone / all at once is the factor by which that work slows
    when all ranks compute: about 1 with a core per rank, ~2 with two ranks per core. Matmul
    rates (per dtype) and the copy bandwidth divide by their own factor.

    With a core per rank the ranks share only the memory: a block kind's fixed seconds slow
    as the float32 matmul, its element-wise and ReLU-output seconds as the copy (memory
    traffic: with both cores of this machine busy the copy slowed 1.2-1.3x where the matmul
    slowed 1.0-1.05x; a plan validation's GPT layouts on 2 ranks ran 1.11x their price with the
    matmul's factor, 1.06x with the copy's; re-priced on one later 2-rank validation, the
    copy's gave MAPE 4.4 % where the blocks' own factor below gave 10.4 %), except where
    :func:`measure` passes the step engine's GPT (``engine.KIND``, a core per rank): that
    kind's element-wise and ReLU-output seconds slow as its steps. The copy of 64 MiB streams
    from memory, which the host shares: on one day here it slowed 1.40-1.65x all at once
    (1.74-1.79x in probes) while copies of 1-16 MiB, the reference blocks and the engine's GPT
    slowed 1.00-1.10x, and a 2-rank validation's GPT layouts ran 0.85x their price (MAPE 17 %;
    with the element-wise at no slowdown, 4.0 %); the days before, the copy had slowed 1.01-1.25x.
    When ranks share cores (:func:`measure` passes the reference blocks' sustained rates,
    ``block.KIND``, only then), a kind's fixed, element-wise and ReLU-output seconds multiply
    by the factor of the kind's own reference blocks and its efficiency by the matmul's factor
    over the kind's, capped at 1, so that a block priced alone at t is priced t times its kind's
    factor: the copy of :data:`COPY_BYTES` streams from memory while its rank's core is
    time-shared, and on 4 ranks over 2 cores it slowed 2.0-3.5x between calibrations where the
    blocks slowed 2.1-2.3x, like the matmul (priced with the copy's 3.4x, the GPT layouts of
    8-16 sequences per micro-batch measured 0.71-0.85x their price; re-priced on two 4-rank
    validations, Kendall tau 0.72 -> 0.77 and 0.64 -> 0.66 with the blocks' factor). The optimizer's
    seconds per parameter multiply by the float32 factor (CPU time, shared as the matmul's is);
    forward shares, backward splits and tokens factors are ratios of times slowed alike and stay.
    A factor below 1 (all at once faster than alone: 0.97 in one calibration here, the two
    windows' noise) counts as 1.
    Timed all at once directly, the block figures would be medians of calls of 0.1-10 ms, which
    run uninterrupted or not by the luck of the scheduler's slices: measured so, on 4 ranks over
    2 cores the linear kind's efficiency swung from 0.60 to 0.84 between three calibrations."""
    slow = {k: max(1.0, alone_sustained[k] / together_sustained[k]) for k in together_sustained}
    out = {}
    for key, value in alone.items():
        table, kind = key.split(".", 1) if "." in key else ("", "")
        own = slow.get(f"block.{kind}")
        if table == "overhead":
            out[key] = value * (own or slow["float32"])
        elif table in ("elementwise", "activation"):
            out[key] = value * (own or slow.get(f"engine.{kind}") or slow["copy"])
        elif table == "efficiency":
            out[key] = min(1.0, value * slow["float32"] / own) if own else value
        elif table == "update":
            out[key] = tuple((top, per * slow["float32"]) for top, per in value)
        elif table == "tokens" and f"engine_low.{kind}" in slow:
            out[key] = _shared_tokens(value, slow[f"engine_low.{kind}"] / slow[f"engine.{kind}"])
        elif table in ("forward", "split", "tokens"):
            out[key] = value
        else:                                   # a dtype's matmul rate or "copy"
            out[key] = value / slow[key]
    out["slowdown"] = slow["float32"]
    out.update({f"slowdown.{k[6:]}": v for k, v in slow.items() if k.startswith("block.")})
    out.update({k: v for k, v in slow.items() if k.startswith(("engine.", "engine_low."))})
    return out


def _shared_tokens(pieces, ratio: float) -> tuple:
    """A tokens ladder's pieces ((tokens, slowdown), ..., (inf, 1)) while all ranks compute,
    given ``ratio``: its bottom rung's sharing factor (alone / all at once) over its top
    rung's. The bottom rung's slowdown multiplies by ``ratio``, the top's by 1, those between
    by ``ratio`` to the power of their place between them in log(tokens) (a choice: two rungs
    are timed all at once), none below 1 where alone it was not.

    On 4 ranks over 2 cores here the bottom rung (one sequence, 64 tokens) slowed 2.15x all at
    once where the top (8 sequences) slowed 2.31x: small calls share a core better (their
    per-call Python and the others' matmuls interleave), the ladder's 1.43 at 64 tokens
    becomes 1.33 (probe; 1.37 in the calibrations of ``p4_k``)."""
    finite = [t for t, _ in pieces if np.isfinite(t)]
    lo, hi = np.log(finite[0]), np.log(finite[-1])

    def factor(tokens):                       # one rung: it is both bottom and top, ratio^0
        if not np.isfinite(tokens) or hi == lo:
            return 1.0
        return ratio ** min(1.0, max(0.0, (hi - np.log(tokens)) / (hi - lo)))
    return tuple((t, float(max(min(s, 1.0), s * factor(t)))) for t, s in pieces)


def measure(comm, rounds: int = FULL_ROUNDS) -> dict:
    """Everything ``calibrate --write`` records, the same dict on every rank: "alone" (rank 0 by
    itself) and "together" (:func:`shared_figures`: what a rank gets while all compute) device
    figures, "sizes" and one-way "seconds", "reduce_sizes" and allreduce "reduce_seconds" (both
    None on one rank), "cold" (whether those were timed cold: not when this node holds more
    ranks than cores, see the module docstring), "ranks_here" (ranks sharing this node's
    memory), "cpu"; where the ranks share cores, "update" (:func:`update_costs` all at once),
    "after_compute" (:func:`after_compute_points`), "compute_scale", "collective_scale" and
    "group_scales" (:func:`layout_scale`) and "handoff" (:func:`handoff_points`, on the device
    slowed by "compute_scale"), else None."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    ranks_here = comm.allreduce(local.Get_size(), op=MPI.MAX)
    local.Free()
    cold = comm.allreduce(ranks_here <= cores_here(), op=MPI.LAND)
    repeats = _in_proportion(COLD_REPEATS, rounds)           # as many at the default 15 rounds
    window = SUSTAIN_S * min(1.0, rounds / FULL_ROUNDS)
    alone = device_rates(rounds) if rank == 0 else None
    _quiet_barrier(comm)                      # the others sleep while rank 0 times alone
    alone = comm.bcast(alone, root=0)
    together = shared_figures(alone, *sustained_medians(          # engine: a core per rank
        comm, window, not cold, _in_proportion(SUSTAIN_ROUNDS, rounds), cold and size > 1))
    seconds = pingpong(comm, cold=cold, repeats=repeats) if size > 1 else None
    reduce = allreduce_times(comm, cold=cold, repeats=repeats) if size > 1 else None
    meas = {"alone": alone, "together": together, "sizes": list(SIZES),
            "seconds": seconds, "reduce_sizes": list(SIZES[1:]), "reduce_seconds": reduce,
            "cold": cold, "ranks_here": ranks_here, "cpu": comm.bcast(cpu_name(), root=0),
            "handoff": None, "update": None, "after_compute": None, "compute_scale": None,
            "collective_scale": None, "group_scales": None}
    if size > 1 and not cold:             # ranks share cores: what a blocking exchange waits
        meas["update"] = {opt: update_costs(opt, repeats=update_repeats(rounds), comm=comm)
                          for opt in UPDATE_OPTIMIZERS}
        meas["after_compute"] = after_compute_points(comm)
        meas["compute_scale"], meas["collective_scale"], meas["group_scales"] = layout_scale(
            comm, machine_of(meas, "calibrating", size))
        meas["handoff"] = comm.bcast(handoff_points(       # on the device slowed as fitted
            comm, machine_of(meas, "calibrating", size), min(1.0, cores_here() / ranks_here),
            rounds=_in_proportion(HANDOFF_ROUNDS, rounds)), root=0)
    return meas


def _in_proportion(count: int, rounds: int) -> int:
    """``count`` (what a calibration of :data:`FULL_ROUNDS` rounds times) for one of ``rounds``
    rounds, in proportion, at least 1."""
    return max(1, count * rounds // FULL_ROUNDS)


def cores_here() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                  # macOS, Windows
        return os.cpu_count() or 1


def _kinds(rates: dict, table: str) -> dict:
    """{kind: figure} of the ``table`` ("efficiency", "overhead", ...) entries of device_rates()
    (a figure or a tuple of them), to four significant digits (a piece's size kept whole)."""
    def digits(v):
        if isinstance(v, tuple):
            return tuple(digits(x) for x in v)
        return v if v >= 1024 else float(f"{v:.4g}")
    return {k.split(".", 1)[1]: digits(v) for k, v in rates.items() if k.startswith(table + ".")}


def machine_of(meas: dict, name: str, size: int) -> Machine:
    """The machine of what :func:`measure` returned on ``size`` ranks: one level "node" of
    fan-out ``size`` (none on one rank), its handoff and collectives after compute where
    measured, over the all-at-once device (its optimizer figures timed all at once where
    measured so, else rank 0's alone slowed as :func:`shared_figures` says), slowed by the
    "compute_scale" where measured (:func:`layout_scale`).

    The transformer's tokens slowdown where each rank has a core, and where ranks share cores
    once its ladder's bottom rung was timed all at once (``engine_low``, :func:`_shared_tokens`);
    the linear kind's rows slowdown everywhere (:func:`rows_costs`). Without the transformer's
    ladder where ranks share cores, five 4-rank validations' pipelines of 32 one-sequence
    micro-batches ran 1.12-1.35x their price and those of 4-8 micro-batches 0.89-1.06x (tau
    0.79-0.84); with it, the handoff fitted beside it, 0.92-1.01x and 0.94-1.06x (tau 0.861,
    MAPE 5.2 %, ``p4_k``). An earlier ladder, the block timed bare, put beside the handoff
    figures of that time, had ranked the 71 GPT layouts at tau 0.59 (0.77 without it)."""
    tog = meas["together"]
    device = Device(name=meas["cpu"], flops={dt: tog[dt] for dt in DTYPES},
                    memory_bandwidth=tog["copy"],
                    memory_bytes=memory_bytes(meas["ranks_here"]),
                    efficiency=_kinds(tog, "efficiency"), overhead=_kinds(tog, "overhead"),
                    elementwise=_kinds(tog, "elementwise"), activation=_kinds(tog, "activation"),
                    forward=_kinds(tog, "forward"),
                    split=_kinds(tog, "split"),
                    tokens={k: v for k, v in _kinds(tog, "tokens").items()
                            if meas.get("cold", True) or k == "linear"
                            or f"engine_low.{k}" in tog},
                    update=_kinds({f"update.{k}": v for k, v in meas["update"].items()}, "update")
                    if meas.get("update") else _kinds(tog, "update")
                    ).slowed(meas.get("compute_scale") or 1.0)
    levels = ()
    if size > 1:
        node = fit_level(meas["sizes"], meas["seconds"], size)
        levels = (replace(node, reduce_bandwidth=fit_reduce(
            meas["reduce_sizes"], meas["reduce_seconds"], size, node.latency_s),
            after_compute={k: tuple((float(f"{c:.4g}"), b, float(f"{t:.4g}")) for c, b, t in v)
                           for k, v in (meas.get("after_compute") or {}).items()},
            collective_scale=meas.get("collective_scale") or 1.0,
            group_scales=tuple(meas.get("group_scales") or ()),
            **handoff_fields(meas.get("handoff"))),)
    source = (f"hpcnn calibrate --write on {size} rank(s), {platform.node()}, "
              f"{time.strftime('%Y-%m-%d %H:%M')}")
    return Machine(name=name, levels=levels, device=device, source=source)


def handoff_fields(handoff) -> dict:
    """The level's ``handoff`` and ``bubble_weight`` from what :func:`handoff_points` returned
    (None: none measured)."""
    if not handoff:
        return {}
    points, weight = handoff
    return {"handoff": tuple(map(tuple, points)), "bubble_weight": weight}


def _device_line(tog: dict, alone: dict) -> str:
    """The machine file's comment on how the all-at-once device figures ``tog`` were had from
    rank 0's ``alone`` (:func:`shared_figures`)."""
    kinds = _kinds(tog, "slowdown")           # the blocks' own factors, where ranks share cores
    engine = _kinds(tog, "engine")            # the step engine's GPT (its ladder's top rung)
    low = _kinds(tog, "engine_low")          # ranks share cores: the tokens ladder's bottom rung
    ladder = "".join(f"the {k} tokens ladder's bottom rung x{v:.2f} (top x{engine[k]:.2f}); "
                     for k, v in low.items() if k in engine)
    blocks = ("each block kind's figures by its reference blocks' (ranks share cores): "
              + ", ".join(f"{k} x{v:.2f}" for k, v in kinds.items()) + "; " + ladder if kinds
              else "".join(f"the {k} element-wise seconds by the step engine's GPT x{v:.2f}, "
                           for k, v in engine.items()) + "the other element-wise seconds by ")
    return ("# Device: what each rank gets while all ranks compute at once: rank 0's figures "
            "alone, slowed by the sustained rates' ratio alone / all at once (slowest rank, medians"
            f" of alternated windows), x{tog['slowdown']:.2f}, {blocks}the copy "
            f"x{alone['copy'] / tog['copy']:.2f} (measure.shared_figures).")


def machine_text(meas: dict, name: str, size: int) -> str:
    """The machine file for what :func:`measure` returned on ``size`` ranks: header comments with
    the raw figures, then :meth:`Machine.to_toml` of :func:`machine_of`."""
    tog, alone = meas["together"], meas["alone"]
    head = [f"# Measured by `hpcnn calibrate --write` on {size} rank(s) "
            f"({meas['ranks_here']} sharing this node's memory).", _device_line(tog, alone),
            "# Alone (rank 0 by itself): " + ", ".join(
                f"matmul {dt} {alone[dt] / 1e9:.1f} GFLOP/s" for dt in DTYPES)
            + f", copy {alone['copy'] / 1e9:.1f} GB/s; all at once: " + ", ".join(
                f"{dt} {tog[dt] / 1e9:.1f}" for dt in DTYPES)
            + f", copy {tog['copy'] / 1e9:.1f}.",
            "# Blocks (float32, sizes in hpcnn/parallel/collectives/measure.py): efficiency "
            f"alone {_kinds(alone, 'efficiency')}, all at once {_kinds(tog, 'efficiency')}; "
            f"overhead alone {_kinds(alone, 'overhead')}, all at once {_kinds(tog, 'overhead')}; "
            f"elementwise alone {_kinds(alone, 'elementwise')}, all at once "
            f"{_kinds(tog, 'elementwise')}; activation (a ReLU's output) alone "
            f"{_kinds(alone, 'activation')}, all at once {_kinds(tog, 'activation')}; forward "
            f"share {_kinds(alone, 'forward')}; backward "
            f"halves (input, weight) {_kinds(alone, 'split')}.",
            "# Optimizer step alone, seconds per float32 parameter at [max_params, s]: "
            + "; ".join(f"{k} {list(v)}" for k, v in _kinds(alone, "update").items()) + "."]
    if meas["seconds"]:
        head.append(("# Cold (each call after a copy of 64 MiB and a barrier)" if meas.get("cold")
                     else "# Back to back (more ranks than cores here)")
                    + " ping-pong, all pairs at once, one-way median of the slowest pair: "
                    + ", ".join(f"{s} B {t * 1e6:.1f} us" for s, t in
                                zip(meas["sizes"], meas["seconds"])) + ".")
        head.append("# MPI allreduce (float32 sum, in place) over all ranks, median of the slowest "
                    "rank: " + ", ".join(f"{s} B {t * 1e6:.1f} us" for s, t in
                                         zip(meas["reduce_sizes"], meas["reduce_seconds"]))
                    + ".")
    else:
        head.append("# One rank: no network level was measured.")
    if meas.get("update"):
        head.append("# Optimizer step all ranks at once (ranks share cores; slowest rank), seconds "
                    "per float32 parameter at [max_params, s]: " + "; ".join(
                        f"{k} {[(n, float(f'{t:.4g}')) for n, t in v]}"
                        for k, v in meas["update"].items()) + " (measure.update_costs).")
    if meas.get("after_compute"):
        head.append("# Collectives after compute (ranks share cores): see [levels.after_compute] "
                    "(measure.after_compute_points); in training through the step engine "
                    "(reference MLPs and GPTs), the device's seconds took "
                    f"{meas.get('compute_scale') or 1.0:.3g}x the figures above (compute_scale: "
                    "the [device] figures below are slowed so), the layout executor's "
                    f"collectives {meas.get('collective_scale') or 1.0:.3g}x the curves"
                    + "".join(f", {k:.3g}x those over groups of {n}"
                              for n, k in meas.get("group_scales") or ())
                    + " (collective_scale, group_scales, measure.layout_scale).")
    if meas.get("handoff") is not None:
        points, weight = meas["handoff"]
        head.append(f"# Handoff (ranks share cores): 1F1B pipelines over the {size} ranks, each "
                    f"with {size} and {HANDOFF_MICRO * size} micro-batches, ran as priced with a "
                    "wait per exchange of " + ", ".join(
                        f"{h * 1e6:.1f} us after {c * 1e3:.3g} ms passes" for c, h in points)
                    + f" and their fill and drain at {weight:.2f} of their length "
                    "(measure.handoff_points).")
    return "\n".join(head) + "\n\n" + machine_of(meas, name, size).to_toml()
