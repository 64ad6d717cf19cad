"""Allreduce algorithms: segmented ring, recursive doubling, intra-node shared memory and
single-copy reads, auto.

Called by :meth:`.comm.Communicator.allreduce` (which times and counts them)::

    comm.allreduce(buf, algorithm="shm")       # mpi | ring | rd | shm | cma | auto; in place
    calibrate(comm, sizes)                     # sets comm.allreduce_table (a run: through
                                               # .calibration, which saves it)
    req = comm.iallreduce(buf, algorithm="ring")   # mpi | ring | shm | auto
    ...; req.test(); ...                       # between blocks of compute: advances the ring
    req.wait()

``ring`` (:mod:`.ring`): reduce-scatter then all-gather on p chunks, each cut into segments of
at most ``comm.allreduce_segment_bytes`` (:data:`SEGMENT_BYTES`), a window of :data:`WINDOW` in
flight (Patarasuk & Yuan 2009; Thakur et al. 2005, sec. 4), cost 2(p-1) nseg alpha + 2(p-1)/p
n beta; :class:`RingRequest` segments by :data:`ISEGMENT_BYTES`, a ``test()`` completing about
one. ``rd``: recursive doubling, log2 p (alpha + n beta), non-powers of two folded in pairs first. ``shm`` (:mod:`.shm`) and ``cma``
(:mod:`.cma`): all ranks on one node, through a shared window or reading the peers' memory.
``mpi``: the library's Allreduce. ``auto``: per message size, the nearest size's choice in
``comm.allreduce_table`` (:func:`calibrate`), else :data:`DEFAULT_SHM_TABLE` (one node) or
:data:`DEFAULT_TABLE`, and shm for arrays from :func:`shared_zeros`; its first call is collective.
Measured figures: docs/results/collectives.md.

Results agree with ``mpi`` to rounding, and every rank ends with bitwise the same array. Traffic
goes over a private duplicate of the communicator, made on first use (:func:`free` releases it
and the shared window), one tag per call; like any collective, calls must be made, and requests
waited for, in the same order on every rank.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.collectives import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.arange(5.0); c.allreduce(a, algorithm='ring'); print(a)"
"""
from __future__ import annotations

import time
from bisect import bisect_left
from math import isqrt

import numpy

from hpcnn import backend
from hpcnn.parallel.collectives import shm
from hpcnn.parallel.collectives.mpi_base import Request, _cuda_aware, _mpi, host_buffers
from hpcnn.parallel.collectives.ring import (ISEGMENT_BYTES, SEGMENT_BYTES, WINDOW, RingRequest,
                                             flat_view, rd, split)

__all__ = ["ALGORITHMS", "NONBLOCKING", "allreduce", "iallreduce", "iallreduce_ring", "choose",
           "choose_nonblocking", "default_table", "compile_table", "calibrate", "free",
           "available_algorithms", "table_sizes", "table_from_times", "spread", "summarize",
           "wins",
           "shared_zeros", "single_node", "RingRequest", "SEGMENT_BYTES", "ISEGMENT_BYTES",
           "WINDOW"]

ALGORITHMS = ("mpi", "ring", "rd", "shm", "cma", "hier", "auto")
NONBLOCKING = ("mpi", "ring", "shm", "hier", "auto")
MARGIN = 0.25               # calibrate: another path replaces mpi at a size only if its upper
QUANTILES = (0.25, 0.75)    # quartile is 25 % below mpi's lower quartile. On a shared 2-vCPU
                            # host a path's ratio to mpi at one size moved by 1.5-3x between
                            # calibrations a minute apart (16 MiB shm: 0.57x, then 1.5x); the
                            # wins that survive such drifts are the large ones
# The tables without calibration: mpi wherever another path does not clearly win. Ranks on
# several nodes: the ring from 64 MiB (above 32 MiB by the nearest size in log2). Measured on
# one node (benchmarks/allreduce.py, MPICH wheel, 2 ranks): the ring 0.7-1.0x the library's
# Allreduce at 16 MiB, 1.4-1.9x from 64 MiB; mpi is fastest up to 4 MiB (Python costs ~20 us a
# ring step).
DEFAULT_TABLE = {"sizes": [1 << 10, 1 << 24, 1 << 26], "choice": ["mpi", "mpi", "ring"]}
# All ranks on one node (same benchmark, private buffers): shm 0.8-1.1x the library's Allreduce
# from 256 KiB to 4 MiB, 0.5-1.4x at 16 MiB (loaded host: it flips), 1.4-2.1x from 64 MiB. So mpi
# up to 32 MiB, shm above. Buffers from shared_zeros (no copy in) take shm from ZERO_COPY_BYTES
# whatever the table says: 1.1-1.2x at 1 MiB, 1.3-1.8x at 4 MiB, 1.5-2x at 16 MiB, 2.3-3.6x
# above.
DEFAULT_SHM_TABLE = {"sizes": [1 << 24, 1 << 26], "choice": ["mpi", "shm"]}
# Ranks on several nodes of as many ranks each (:mod:`.hier`): the two-level allreduce where the
# ring would be, as its inter-node bytes are 1/q of a flat ring's (q ranks a node).
DEFAULT_HIER_TABLE = {"sizes": [1 << 10, 1 << 24, 1 << 26], "choice": ["mpi", "mpi", "hier"]}
IALLREDUCE_RING_BYTES = 2 << 20   # iallreduce "auto": the ring from 2 MiB (library's below) ...
IALLREDUCE_SHM_BYTES = 2 << 20    # ... or, all ranks on one node, shm from 2 MiB
SWEEP = [1 << k for k in range(10, 27, 2)]  # calibrate's default sizes: 1 KiB .. 64 MiB
MIN_REPEATS = 7             # calibrate with a time budget: at least this many timed rounds
                            # (their quartiles decide)

_flat, _split, _rd = flat_view, split, rd     # older names


def free(comm) -> None:
    """Free the private communicator, the shared window and scratch buffers made for ``comm``
    (collective); they are made again on next use."""
    comm.collectives.free()


def single_node(comm) -> bool:
    """True if every rank of ``comm`` shares one node's memory (and ``HPCNN_SHM`` is not 0)."""
    return comm.size > 1 and shm.node_of(comm) is not None


def default_table(comm) -> dict:
    """:data:`DEFAULT_SHM_TABLE` on one node, :data:`DEFAULT_HIER_TABLE` on several nodes of
    as many ranks each, else :data:`DEFAULT_TABLE` (collective once)."""
    if single_node(comm):
        return DEFAULT_SHM_TABLE
    return DEFAULT_HIER_TABLE if _levels(comm) else DEFAULT_TABLE


def _levels(comm):
    from hpcnn.parallel.collectives.hier import levels_of
    return levels_of(comm) if comm.size > 1 else None


def compile_table(table) -> tuple:
    """``(bounds, choices, mpi_below)`` for ``table``: size n picks ``choices[i]``,
    i = bisect_left(bounds, n) (n*n <= a*b: nearer to a than to b in log2, or as near);
    ``mpi_below``: every n below it picks ``mpi``."""
    pairs = sorted(dict(reversed(list(zip(table["sizes"], table["choice"])))).items())
    sizes, choices = [max(1, int(s)) for s, _ in pairs], [c for _, c in pairs]
    for c in choices:
        if c not in ALGORITHMS[:-1]:
            raise ValueError(f"allreduce table: unknown algorithm {c!r}")
    bounds = [isqrt(a * b) for a, b in zip(sizes, sizes[1:])]
    k = next((i for i, c in enumerate(choices) if c != "mpi"), len(choices))
    mpi_below = 0 if k == 0 else (bounds[k - 1] + 1 if k < len(choices) else 1 << 62)
    return bounds, choices, mpi_below


def _has_shared(comm) -> bool:
    ws = comm.collectives.workspace
    return bool(ws and ws.node and ws.node.shared)


def _lookup(comm):
    co = comm.collectives
    lk = co.lookup
    if lk is None:
        lk = co.lookup = compile_table(co.table or default_table(comm))
        # with shared arrays about, the lean path stops where zero copy may start (the C path
        # goes on for buffers outside the shared windows)
        shared = _has_shared(comm)
        ranges = [(sh.base, sh.base + sh.nbytes) for sh in co.workspace.node.shared] \
            if shared else []
        co.set_auto_mpi_below(min(lk[2], shm.ZERO_COPY_BYTES) if shared else lk[2], lk[2], ranges)
    return lk


def choose(comm, nbytes: int) -> str:
    """The algorithm ``auto`` runs for ``nbytes`` on ``comm`` (see the module docstring;
    collective on the first call without a table: finds out whether the ranks share a node)."""
    bounds, choices, _ = _lookup(comm)
    return choices[bisect_left(bounds, nbytes)]


def choose_nonblocking(comm, nbytes: int) -> str:
    """What ``iallreduce(algorithm="auto")`` runs: shm from :data:`IALLREDUCE_SHM_BYTES` on one
    node, else the ring from :data:`IALLREDUCE_RING_BYTES`, mpi below."""
    one = single_node(comm)
    below = IALLREDUCE_SHM_BYTES if one else IALLREDUCE_RING_BYTES
    comm.collectives.iauto_mpi_below = min(below, shm.ZERO_COPY_BYTES) if _has_shared(comm) \
        else below
    if one and nbytes >= IALLREDUCE_SHM_BYTES:
        return "shm"
    if nbytes < IALLREDUCE_RING_BYTES:
        return "mpi"
    return "ring" if one or not _levels(comm) else "hier"


def shared_zeros(comm, shape, dtype=numpy.float32):
    """A zero-filled array of ``shape`` and ``dtype`` that shm reduces in place, without copying
    it in (see :mod:`.shm`): in a shared window when all ranks of ``comm`` are on
    one node, else (or on CuPy) a plain ``zeros``. Collective (same shape and dtype on every
    rank); valid until :func:`free`. ``auto`` picks shm for it from ZERO_COPY_BYTES."""
    if backend.xp is numpy and single_node(comm):
        comm.collectives.forget_auto()               # auto's lean paths: recomputed
        return shm.zeros(shm.node_of(comm), shape, dtype)
    return backend.xp.zeros(shape, dtype)


def _in_shared(comm, flat) -> bool:
    ws = comm.collectives.workspace
    return bool(ws and ws.node and isinstance(flat, numpy.ndarray) and ws.node.find(flat))


def _shm_node(comm):
    node = shm.node_of(comm)
    if node is None:
        raise ValueError(f"allreduce 'shm' needs every rank on one node: {comm.size} ranks span "
                         "several (or HPCNN_SHM=0)")
    return node


def _on_host(flat, fn) -> None:
    """``fn(h)`` on a host array: ``flat`` itself on NumPy; on CuPy a host copy, written back
    (shm and cma load and store with NumPy, whether or not the MPI is CUDA-aware)."""
    if isinstance(flat, numpy.ndarray):
        fn(flat)
        return
    backend.sync()  # pragma: no cover - CuPy: through host memory
    h = backend.to_host(flat)  # pragma: no cover
    fn(h)  # pragma: no cover
    flat[...] = backend.to_device(h)  # pragma: no cover


def allreduce(comm, buf, algorithm: str = "auto"):
    """Sum ``buf`` (C-contiguous, any shape) over ``comm`` (a Communicator) in place; returns it.
    Not timed nor counted (:meth:`Communicator.allreduce` does both)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    flat = flat_view(buf)
    if comm.size == 1 or flat.size == 0:
        return buf
    if algorithm == "auto":
        algorithm = choose(comm, buf.nbytes)
        if algorithm != "shm" and buf.nbytes >= shm.ZERO_COPY_BYTES and _in_shared(comm, flat):
            algorithm = "shm"                   # zero copy beats the others
    MPI = _mpi()
    if algorithm == "mpi" and isinstance(buf, numpy.ndarray):   # the small-message fast path
        comm.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf
    if algorithm == "cma":
        from hpcnn.parallel.collectives import cma
        _on_host(flat, lambda h: cma.allreduce(comm, h))
        return buf
    if algorithm == "shm":
        node, piece = _shm_node(comm), getattr(comm, "shm_piece_bytes", shm.PIECE_BYTES)
        _on_host(flat, lambda h: shm.allreduce(node, h, piece))
        return buf
    if algorithm == "hier":
        from hpcnn.parallel.collectives import hier
        levels = _levels(comm)
        if levels is not None:
            _on_host(flat, lambda h: hier.allreduce(comm, levels, h))
            return buf
        algorithm = "mpi"                       # one node, or nodes of different sizes
    with host_buffers(flat, writeback=(0,)) as (h,):
        if algorithm == "mpi":
            comm.comm.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM)
        elif algorithm == "rd":
            rd(comm, h)
        else:
            RingRequest(comm, h, blocking=True).wait()
    return buf


def iallreduce(comm, buf, algorithm: str = "ring", on_done=None) -> Request:
    """Start a non-blocking in-place sum: ``"ring"`` (:class:`RingRequest`), ``"shm"``
    (:class:`.shm.ShmRequest`, one node), ``"mpi"`` (the library's Iallreduce) or
    ``"auto"`` (:func:`choose_nonblocking`)."""
    if algorithm not in NONBLOCKING:
        raise ValueError(f"unknown iallreduce algorithm {algorithm!r}; expected one of "
                         f"{NONBLOCKING}")
    if comm.size == 1:
        return comm.iallreduce(buf, on_done=on_done)
    if algorithm == "auto":
        algorithm = choose_nonblocking(comm, buf.nbytes)
        if algorithm != "shm" and buf.nbytes >= shm.ZERO_COPY_BYTES \
                and _in_shared(comm, flat_view(buf)):
            algorithm = "shm"
    levels = _levels(comm) if algorithm == "hier" else None
    if algorithm == "mpi" or (algorithm == "hier" and levels is None):
        return comm.iallreduce(buf, on_done=on_done)
    backend.sync()
    if backend.xp is not numpy and not (_cuda_aware() and algorithm == "ring"):  # pragma: no cover
        t0 = time.perf_counter()                # CuPy staging: blocking
        allreduce(comm, buf, algorithm)
        r = Request([], comm.stats, "iallreduce", 0, t0, on_done)
        r._finish(time.perf_counter() - t0)
        return r
    if algorithm == "shm":
        return shm.ShmRequest(comm, _shm_node(comm), flat_view(buf),
                              getattr(comm, "shm_piece_bytes", shm.PIECE_BYTES), on_done)
    if algorithm == "hier":
        from hpcnn.parallel.collectives.hier import HierRequest
        return HierRequest(comm, levels, buf, on_done)
    return RingRequest(comm, buf, on_done)


def iallreduce_ring(comm, buf, on_done=None) -> RingRequest:
    """Start a segmented ring allreduce of ``buf`` in place; progress it with ``test()``."""
    return iallreduce(comm, buf, "ring", on_done)


def available_algorithms(comm) -> list:
    """What :func:`calibrate` times on ``comm``: mpi, ring, rd, and shm (and cma where the kernel
    lets ranks read each other) when all ranks share a node, hier over several nodes of as many
    ranks each (collective on the first call)."""
    from hpcnn.parallel.collectives import cma
    one = single_node(comm)
    return ["mpi", "ring", "rd"] + (["shm"] if one else []) \
        + (["cma"] if one and cma.available(comm) else []) \
        + (["hier"] if not one and _levels(comm) else [])


def table_sizes(comm, buffers) -> list:
    """The distinct byte sizes of ``buffers`` (each to be reduced by a blocking ``auto``) whose
    algorithm comes from ``comm.allreduce_table``: all but the empty ones and those in a shared
    window from ``shm.ZERO_COPY_BYTES``, which take shm whatever the table says. What a run
    needs calibrated."""
    if comm.size == 1:
        return []
    return sorted({int(b.nbytes) for b in buffers if b.size and not (
        b.nbytes >= shm.ZERO_COPY_BYTES and _in_shared(comm, flat_view(b)))})


def spread(samples) -> tuple:
    """``(low, median, high)`` of timing samples: the quartiles :data:`QUANTILES` and the
    median (linear interpolation; one sample: that sample three times)."""
    s = numpy.asarray(samples, dtype=numpy.float64)
    low, mid, high = numpy.quantile(s, (QUANTILES[0], 0.5, QUANTILES[1]))
    return float(low), float(mid), float(high)


def summarize(sizes, samples) -> dict:
    """``{"sizes", "times", "low", "high"}`` from ``samples[algorithm][i]`` (the seconds of each
    round at ``sizes[i]``): per algorithm, the medians and the quartiles of :func:`spread`."""
    out = {"sizes": [int(n) for n in sizes], "times": {}, "low": {}, "high": {}}
    for a, rows in samples.items():
        lmh = [spread(x) for x in rows]
        for k, j in (("low", 0), ("times", 1), ("high", 2)):
            out[k][a] = [v[j] for v in lmh]
    return out


def wins(low_mpi: float, high: float) -> bool:
    """True if a path whose upper quartile is ``high`` clearly beats the library's, whose lower
    quartile is ``low_mpi``: by :data:`MARGIN`, ``(1 + MARGIN) high <= low_mpi``."""
    return (1 + MARGIN) * high <= low_mpi


def table_from_times(comm, sizes, times, low=None, high=None) -> dict:
    """The table ``auto`` reads, from ``times[algorithm][i]`` (median seconds, the same on every
    rank) at ``sizes[i]`` bytes and their quartiles ``low`` and ``high`` (same layout; None:
    the medians stand for them). At each size ``mpi`` unless another path :func:`wins` (its
    upper quartile beats mpi's lower one by :data:`MARGIN`; overlapping spreads are undecided,
    and undecided is mpi); among the paths that win, the fastest median, or the default table's
    choice (:func:`default_table`) if it wins and is within :data:`MARGIN` of it. Without
    ``mpi`` among the timings: the fastest median. Returns ``{"sizes", "choice", "times",
    "low", "high", "p"}``."""
    algorithms = list(times)
    low, high = low or times, high or times
    bounds, prior, _ = compile_table(default_table(comm))
    best = []
    for i, nbytes in enumerate(sizes):
        med = {a: times[a][i] for a in algorithms}
        if "mpi" in med:
            ok = [a for a in algorithms if a == "mpi" or wins(low["mpi"][i], high[a][i])]
        else:
            ok = algorithms
        a = min(ok, key=lambda a: (med[a], a != "mpi"))
        d = prior[bisect_left(bounds, nbytes)]     # the default among the winners, if near
        if d in ok and d != "mpi" and a != "mpi" and med[d] <= (1 + MARGIN) * med[a]:
            a = d
        best.append(a)
    return {"sizes": [int(n) for n in sizes], "choice": best, "p": comm.size,
            **{k: {a: [float(x) for x in col[a]] for a in algorithms}
               for k, col in (("times", times), ("low", low), ("high", high))}}


def _max_repeats(nbytes: int) -> int:
    """Timed rounds at ``nbytes`` without a budget: ~1-2 s a size on 2 ranks, at least 9 (the
    quartiles need a few)."""
    return max(9, min(200, (1 << 25) // max(nbytes, 1)))


def _time_size(comm, nbytes, algorithms, dtype, repeats, budget) -> numpy.ndarray:
    """The slowest rank's seconds of each timed round at ``nbytes``, ``(rounds, algorithms)``,
    the same on every rank (see :func:`calibrate`)."""
    MPI = _mpi()
    buf = backend.xp.zeros(max(1, nbytes // numpy.dtype(dtype).itemsize), dtype)
    reps = repeats or (None if budget else _max_repeats(nbytes))
    ts = []
    rep = 0
    while reps is None or rep <= reps:
        row = numpy.zeros(len(algorithms))
        for j in numpy.random.default_rng(rep).permutation(len(algorithms)):
            comm.comm.Barrier()             # in a random order, the same on every rank
            t0 = time.perf_counter()
            allreduce(comm, buf, algorithms[j])
            row[j] = time.perf_counter() - t0
        if rep:                             # the first round warms up
            ts.append(row)
        if reps is None and rep == 1:       # after the first timed round: how many fit the
            one = numpy.array([row.sum()])  # budget on the slowest rank
            comm.comm.Allreduce(MPI.IN_PLACE, one, op=MPI.MAX)
            fit = int(budget / max(one[0], 1e-9))
            reps = min(_max_repeats(nbytes), max(MIN_REPEATS, fit))
        rep += 1
    t = numpy.array(ts)
    comm.comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)    # each round: its slowest rank
    return t


def calibrate(comm, sizes=None, repeats=None, algorithms=None, dtype=numpy.float32,
              budget=None) -> dict:
    """Time each algorithm at each size (bytes), set ``comm.allreduce_table`` and return it.

    ``sizes``: default 1 KiB to 64 MiB by factors of 4 (:data:`SWEEP`). ``algorithms``: default
    :func:`available_algorithms`. Repeats are interleaved across algorithms, in a random order
    each (the same on every rank), to share drifts, after one warm-up round. ``repeats``: timed
    rounds per size; default as many as fit ``budget`` seconds a size, judged from the slowest
    rank's first timed round (at least :data:`MIN_REPEATS`), or without a budget ~1-2 s a size
    on 2 ranks (fewer rounds for big sizes, at least 9). Each round counts as its slowest
    rank's time (MAX over ranks), so all ranks hold the same samples; their medians and
    quartiles (:func:`summarize`) decide by :func:`table_from_times`: another path replaces
    ``mpi`` only where it wins clearly, spread included. Returns ``{"sizes", "choice", "times",
    "low", "high" (each {algorithm: seconds a size}), "p"}``.
    """
    sizes = [int(n) for n in (sizes or SWEEP)]
    algorithms = list(algorithms or available_algorithms(comm))
    t = [_time_size(comm, n, algorithms, dtype, repeats, budget) for n in sizes]
    got = summarize(sizes, {a: [ti[:, j] for ti in t] for j, a in enumerate(algorithms)})
    table = table_from_times(comm, sizes, got["times"], got["low"], got["high"])
    comm.allreduce_table = table
    return table
