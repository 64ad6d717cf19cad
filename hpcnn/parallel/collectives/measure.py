"""What ``hpcnn calibrate --write machines/NAME.toml`` measures on the ranks at hand.

- **Network level**: the ranks pair up (0-1, 2-3, ...) and every pair ping-pongs at once, so each
  size is timed while every device communicates (the BSP h-relation a symmetric level stands
  for); a size's one-way time is the median over repeats of the slowest pair. The 8-byte time is
  the latency L; each larger size s gives a bandwidth piece ending at s with
  bytes_per_s = s / (t(s) - L) (:func:`fit_level`). All ranks form one level "node" whose fan-out
  is the number of ranks: with the ranks at hand nothing finer or coarser can be told apart.
- **Device**: the matmul rate per dtype and a large copy's memory bandwidth, timed on rank 0 alone
  and then on all ranks at once. The machine file records the all-at-once rates (what each rank
  gets in a step when ranks share cores); the alone rates go in its header comments.
- **Per block kind** (:func:`block_costs`): hpcnn's own blocks, forward and backward, at a tiny
  size (their fixed cost: ``overhead``) and at two reference sizes per kind, a wide and a narrow
  one (:data:`EFFICIENCY_SHAPES`, chosen apart from any experiment's sizes): each round times the
  matmul, then both, and solves time - overhead = FLOPs / (rate x efficiency) + cache bytes x
  elementwise for the two unknowns (the FLOPs and cache bytes from their ``spec()``); the
  figures are the medians over rounds. These are the machine's figures for the framework's
  element-wise passes and per-call cost, not a profile of the model being planned: re-planning
  another width or batch reruns nothing.
- **Optimizer update** (:func:`update_costs`): hpcnn's own optimizer step, seconds per parameter
  at a few parameter counts (:data:`UPDATE_SIZES`, each split into :data:`UPDATE_ARRAYS` arrays
  as a layer's weights are), as pieces ((max_params, seconds_per_param), ..., (inf, ...)). A
  step's rate depends on the size: small parameter sets stay in cache, and each array adds a
  fixed Python and dispatch cost, so one memory-bandwidth figure priced models of 1 M
  parameters 2.5-3x too slow here. Again a figure of the machine, not of the model planned.

Every rank calls every function here (they contain collectives); medians keep one slow repeat
on a shared machine from deciding the figure. """
from __future__ import annotations

import os
import platform
import time

import numpy as np

from hpcnn.plan.machine import Device, Level, Machine

SIZES = (8, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26)     # ping-pong bytes: 8 B .. 64 MiB
DTYPES = ("float32", "float64")
MATMUL_N = 768                  # 2 n^3 = 0.9 GFLOP: ~10 ms fp32 on one core
COPY_BYTES = 64 << 20           # 64 MiB: well past the caches
# Reference blocks of the efficiency figures, a wide and a narrow one per kind: GPT blocks of
# width 256, 4 heads on 8 sequences of 64 tokens and of width 64, 2 heads on 32 sequences; a
# Linear and its ReLU, 512 -> 512 on 256 rows and 64 -> 64 on 2048 rows. The overhead figures
# time the same kinds at a tiny size: width 8, 2 heads, one sequence of 4; 8 -> 8 on 1 row.
EFFICIENCY_SHAPES = {"transformer": ((256, 4, (8, 64, 256)), (64, 2, (32, 64, 64))),
                     "linear": ((512, 512, (256, 512)), (64, 64, (2048, 64)))}
OVERHEAD_SHAPES = {"transformer": (8, 2, (1, 4, 8)), "linear": (8, 8, (1, 8))}
# Parameter counts of the optimizer-update figures (16 Ki .. 8 Mi: in L2, in L3, past it) and the
# arrays each count is split into (a layer's weights and biases are a few arrays).
UPDATE_SIZES = (1 << 14, 1 << 17, 1 << 20, 1 << 23)
UPDATE_ARRAYS = 4
UPDATE_ROUNDS = 3               # rounds over the sizes the update figures' steps are timed in


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _repeats(nbytes: int) -> int:
    """More repeats for small messages (microseconds each), a few for 64 MiB."""
    return 200 if nbytes <= 1 << 10 else 50 if nbytes <= 1 << 16 else 10 if nbytes <= 1 << 20 else 5


def pingpong(comm, sizes=SIZES) -> list:
    """One-way seconds per size: all pairs (2i, 2i+1) at once, the slowest pair's median; an odd
    last rank waits. Needs at least two ranks."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    peer = rank ^ 1 if (rank ^ 1) < size else None
    out = []
    for n in sizes:
        buf = np.zeros(n, dtype=np.uint8)
        reps = _repeats(n)
        times = []
        comm.Barrier()
        for _ in range(reps + 1):                    # the first round trip warms the path
            t0 = time.perf_counter()
            if peer is not None and rank < peer:
                comm.Send(buf, dest=peer, tag=7)
                comm.Recv(buf, source=peer, tag=7)
            elif peer is not None:
                comm.Recv(buf, source=peer, tag=7)
                comm.Send(buf, dest=peer, tag=7)
            times.append((time.perf_counter() - t0) / 2)
        mine = float(np.median(times[1:])) if peer is not None else 0.0
        out.append(comm.allreduce(mine, op=MPI.MAX))
    return out


def fit_level(sizes, seconds, fanout: int, name: str = "node") -> Level:
    """A level from one-way times ``seconds`` at message ``sizes`` (the smallest first): L = the
    smallest size's time; a piece per larger size s ending at s (the largest at inf) with
    bytes_per_s = s / (t(s) - L), t(s) - L kept >= t(s) / 10 so noise near the latency cannot
    give an absurd rate; pieces' max_bytes increase as the sizes do."""
    if len(sizes) < 2 or len(sizes) != len(seconds) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"fit_level: sizes {list(sizes)} must be >= 2 increasing sizes, one "
                         f"time each (got {len(seconds)})")
    latency = float(seconds[0])
    pieces = [[float(s), s / max(t - latency, t / 10)] for s, t in zip(sizes[1:], seconds[1:])]
    pieces[-1][0] = float("inf")
    return Level(name=name, fanout=fanout, latency_s=latency, bandwidth=tuple(map(tuple, pieces)))


def matmul_rate(dtype: str, n: int = MATMUL_N, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` in this process (median of ``repeats``)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    c = np.empty((n, n), dtype=dtype)
    np.matmul(a, b, out=c)                                   # warm-up
    return 2.0 * n ** 3 / _median_seconds(lambda: np.matmul(a, b, out=c), repeats)


def _blocks_step(kind: str, size: tuple, dtype: str):
    """(step, FLOPs, cache bytes): one forward + backward of ``kind``'s blocks at ``size`` (one
    :data:`EFFICIENCY_SHAPES` entry) as a function of no argument, and their spec() figures."""
    from hpcnn.nn.layers import Linear, ReLU
    from hpcnn.nn.transformer import TransformerBlock
    a, b, shape = size
    blocks = ([TransformerBlock(a, b, dtype=dtype)] if kind == "transformer" else
              [Linear(a, b, dtype=dtype), ReLU(dtype=dtype)])
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    flops = cache = 0.0
    for blk in blocks:
        s = blk.spec(shape)
        flops += s.flops_fwd + s.flops_bwd
        cache += s.bytes_cache
        shape = s.out_shape

    def step():
        y, caches = x, []
        for blk in blocks:
            y, c = blk.forward(y)
            caches.append(c)
        dy = np.ones_like(y)
        for blk, c in zip(reversed(blocks), reversed(caches)):
            dy = blk.backward(dy, c)
    step()                                                   # warm-up
    return step, flops, cache


def block_costs(kind: str, dtype: str, repeats: int = 15) -> tuple:
    """(efficiency, overhead seconds, elementwise seconds per cache byte) of ``kind``'s blocks in
    this process. The overhead is the median forward + backward of the tiny blocks
    (:data:`OVERHEAD_SHAPES`). Each of ``repeats`` rounds then times the n x n matmul (its rate F)
    and the wide and narrow reference blocks, and solves t - overhead = FLOPs / (F e) + bytes c for
    1/e and c; the figures are the medians over rounds (a round whose solution has e > 1 takes
    e = 1 and c from the narrow block, one with c < 0 takes c = 0 and e from the wide block),
    so a change of load
    during the calibration moves both sides of a round's equations alike."""
    tiny, _, _ = _blocks_step(kind, OVERHEAD_SHAPES[kind], dtype)
    overhead = _median_seconds(tiny, 10 * repeats)
    refs = [_blocks_step(kind, size, dtype) for size in EFFICIENCY_SHAPES[kind]]
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((MATMUL_N, MATMUL_N)).astype(dtype) for _ in range(2))
    c = np.empty_like(a)
    inv_eff, per_byte = [], []
    for _ in range(repeats):
        rate = 2.0 * MATMUL_N ** 3 / _median_seconds(lambda: np.matmul(a, b, out=c), 1)
        rows = [(f, q, max(_median_seconds(step, 1) - overhead, 1e-9)) for step, f, q in refs]
        (f1, q1, t1), (f2, q2, t2) = rows
        u, w = np.linalg.solve([[f1 / rate, q1], [f2 / rate, q2]], [t1, t2])
        if u < 1:                              # faster than the matmul: e = 1, c from the narrow
            u, w = 1.0, (t2 - f2 / rate) / q2
        if w < 0:                              # no element-wise share: e from the wide alone
            u, w = max(1.0, t1 * rate / f1), 0.0
        inv_eff.append(u)
        per_byte.append(w)
    return 1.0 / float(np.median(inv_eff)), overhead, float(np.median(per_byte))


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


def update_costs(optimizer: str, dtype: str = "float32", sizes=UPDATE_SIZES,
                 repeats: int = 21) -> tuple:
    """Seconds per parameter of one step of hpcnn's ``optimizer`` ("adamw", "sgd") in this
    process, as pieces ((max_params, seconds_per_param), ..., (inf, seconds_per_param)) for
    :attr:`hpcnn.plan.machine.Device.update`: one piece per size N of ``sizes`` (increasing),
    t(N) / N where t(N) is the median of ``repeats`` steps over N ``dtype`` parameters
    (:func:`_update_step`); then a last piece to infinity with the largest size's figure. The
    steps are timed in :data:`UPDATE_ROUNDS` rounds over the sizes, so that a burst of load on a
    shared machine does not fall on all the steps of one size; within a round a size's steps
    follow one untimed step, as they follow each other in training (the arrays of a small
    size are back in cache: the rate measured is the cached one where the arrays fit)."""
    sizes = list(sizes)
    if (not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < UPDATE_ARRAYS
                         for n in sizes) or sizes != sorted(set(sizes))):
        raise ValueError(f"update_costs: sizes = {sizes}: expected increasing integers >= "
                         f"{UPDATE_ARRAYS} (parameters)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"update_costs: repeats = {repeats!r}: expected an integer >= 1")
    rng = np.random.default_rng(0)
    steps = [_update_step(optimizer, n, dtype, rng) for n in sizes]
    times = [[] for _ in sizes]
    for r in range(UPDATE_ROUNDS):
        count = repeats // UPDATE_ROUNDS + (r < repeats % UPDATE_ROUNDS)
        for step, out in zip(steps, times):
            step()                                           # the arrays back in cache
            out += [_median_seconds(step, 1) for _ in range(count)]
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


def device_rates(rounds: int = 15) -> dict:
    """Matmul FLOP/s per dtype, copy bytes/s and the float32 block figures of this process:
    {"float32": .., "copy": .., "efficiency.transformer": .., "overhead.transformer": ..,
    "elementwise.transformer": ..}."""
    rates = {dt: matmul_rate(dt) for dt in DTYPES}
    rates["copy"] = copy_bandwidth()
    for kind in EFFICIENCY_SHAPES:
        (rates[f"efficiency.{kind}"], rates[f"overhead.{kind}"],
         rates[f"elementwise.{kind}"]) = block_costs(kind, "float32", rounds)
    return rates


def _quiet_barrier(comm) -> None:
    """A barrier that sleeps while it waits: MPICH's blocking Barrier spins, and a spinning rank
    would take the core from rank 0 while it is timed alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def measure(comm, rounds: int = 15) -> dict:
    """Everything ``calibrate --write`` records, the same dict on every rank: "alone" and
    "together" device rates (the latter the slowest rank's), "sizes" and one-way "seconds"
    (None on one rank), "ranks_here" (ranks sharing this node's memory), "cpu"."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    alone = device_rates(rounds) if rank == 0 else None
    _quiet_barrier(comm)
    mine = device_rates(rounds)                              # every rank at once
    together = {k: comm.allreduce(v, op=MPI.MAX if k.startswith(("overhead.", "elementwise."))
                                  else MPI.MIN)
                for k, v in mine.items()}                    # the slowest rank's figures
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    ranks_here = comm.allreduce(local.Get_size(), op=MPI.MAX)
    local.Free()
    seconds = pingpong(comm) if size > 1 else None
    return {"alone": comm.bcast(alone, root=0), "together": together, "sizes": list(SIZES),
            "seconds": seconds, "ranks_here": ranks_here, "cpu": comm.bcast(cpu_name(), root=0)}


def _kinds(rates: dict, table: str) -> dict:
    """{kind: figure} of the ``table`` ("efficiency", "overhead") entries of device_rates()."""
    return {k.split(".", 1)[1]: float(f"{v:.4g}") for k, v in rates.items()
            if k.startswith(table + ".")}


def machine_text(meas: dict, name: str, size: int) -> str:
    """The machine file for what :func:`measure` returned on ``size`` ranks: header comments with
    the raw figures, then :meth:`Machine.to_toml` of one level "node" of fan-out ``size`` (none
    on one rank) over the all-at-once device."""
    tog, alone = meas["together"], meas["alone"]
    device = Device(name=meas["cpu"], flops={dt: tog[dt] for dt in DTYPES},
                    memory_bandwidth=tog["copy"],
                    memory_bytes=memory_bytes(meas["ranks_here"]),
                    efficiency=_kinds(tog, "efficiency"), overhead=_kinds(tog, "overhead"),
                    elementwise=_kinds(tog, "elementwise"))
    levels = (fit_level(meas["sizes"], meas["seconds"], size),) if size > 1 else ()
    source = (f"hpcnn calibrate --write on {size} rank(s), {platform.node()}, "
              f"{time.strftime('%Y-%m-%d %H:%M')}")
    head = [f"# Measured by `hpcnn calibrate --write` on {size} rank(s) "
            f"({meas['ranks_here']} sharing this node's memory).",
            "# Device: the rates each rank got while all ranks computed at once (slowest rank).",
            "# Alone (rank 0 by itself): " + ", ".join(
                f"matmul {dt} {alone[dt] / 1e9:.1f} GFLOP/s" for dt in DTYPES)
            + f", copy {alone['copy'] / 1e9:.1f} GB/s; all at once: " + ", ".join(
                f"{dt} {tog[dt] / 1e9:.1f}" for dt in DTYPES)
            + f", copy {tog['copy'] / 1e9:.1f}.",
            "# Blocks (float32, sizes in hpcnn/parallel/collectives/measure.py): efficiency "
            f"alone {_kinds(alone, 'efficiency')}, all at once {_kinds(tog, 'efficiency')}; "
            f"overhead alone {_kinds(alone, 'overhead')}, all at once {_kinds(tog, 'overhead')}; "
            f"elementwise alone {_kinds(alone, 'elementwise')}, all at once "
            f"{_kinds(tog, 'elementwise')}."]
    if meas["seconds"]:
        head.append("# Ping-pong, all pairs at once, one-way median of the slowest pair: "
                    + ", ".join(f"{s} B {t * 1e6:.1f} us" for s, t in
                                zip(meas["sizes"], meas["seconds"])) + ".")
    else:
        head.append("# One rank: no network level was measured.")
    return "\n".join(head) + "\n\n" + Machine(name=name, levels=levels, device=device,
                                              source=source).to_toml()
