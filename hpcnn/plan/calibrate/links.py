"""The network level of a machine file: ping-pong and allreduce times, and their fits.

- :func:`pingpong`: the ranks pair up (0-1, 2-3, ...) and every pair ping-pongs at once, so each
  size is timed while every device communicates (the BSP h-relation a symmetric level stands
  for); a size's one-way time is the median over repeats of the slowest pair.
- :func:`allreduce_times`: an in-place MPI allreduce per size over all ranks.
- Each call is timed cold (:func:`_call_seconds`): after a copy of
  :data:`~.timing.COPY_BYTES` on every rank and a barrier, as in training a message or a
  collective follows a pass that evicted its buffers and the library's shared-memory cells from
  the caches; back to back where the node holds more ranks than cores (there a copy and a
  barrier before each call would time the scheduler handing the cores over, not the caches).
- :func:`fit_level`: the 8-byte time is the latency L; each larger size s gives a bandwidth piece
  ending at s with bytes_per_s = s / (t(s) - L). All ranks form one level "node" whose fan-out is
  the number of ranks: with the ranks at hand nothing finer or coarser can be told apart.
- :func:`fit_reduce`: the allreduce times fitted as a ring's steps into the level's
  ``reduce_bandwidth`` (the library's sums and copies make it several times slower than the ring
  of ping-pong messages).
- :func:`never_slower`: a smaller message is never priced slower than a larger one.

What these figures were on the machines tried: docs/results/calibration.md.
"""
from __future__ import annotations

import time
from functools import partial

import numpy as np

from hpcnn.plan.calibrate.timing import COLD_REPEATS, counted, evictor, slowest
from hpcnn.plan.machine import Level

SIZES = (8, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26)     # ping-pong bytes: 8 B .. 64 MiB


def _repeats(nbytes: int) -> int:
    """Back-to-back calls per size: many for small messages (microseconds each), few for 64 MiB."""
    return 200 if nbytes <= 1 << 10 else 50 if nbytes <= 1 << 16 else 10 if nbytes <= 1 << 20 else 5


def _call_seconds(comm, call, nbytes: int, evict=None, cold_repeats: int = COLD_REPEATS) -> list:
    """Seconds of each timed ``call()`` (a collective step every rank makes; ``comm`` a
    Communicator), after one untimed warm-up call: :func:`_repeats` calls back to back, or with
    ``evict`` (:func:`~.timing.evictor`) ``cold_repeats`` calls each after ``evict()`` and a
    barrier (cold, as in training)."""
    comm.barrier()
    call()                                                   # warms the path
    times = []
    for _ in range(cold_repeats if evict else _repeats(nbytes)):
        if evict:
            evict()
            comm.barrier()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def pingpong(comm, sizes=SIZES, cold: bool = True, repeats: int = COLD_REPEATS) -> list:
    """One-way seconds per size: all pairs (2i, 2i+1) at once, the slowest pair's median of half
    a round trip (:func:`_call_seconds`: ``repeats`` cold calls with ``cold``, else back to
    back); an odd last rank waits. Needs at least two ranks."""
    comm = counted(comm)
    rank, size = comm.rank, comm.size
    peer = rank ^ 1 if (rank ^ 1) < size else None
    evict = evictor() if cold else None
    out = []
    for n in sizes:
        buf = np.zeros(n, dtype=np.uint8)
        round_trip = (partial(comm.bare_round_trip, buf, peer, rank < peer, tag=7)
                      if peer is not None else lambda: None)
        times = _call_seconds(comm, round_trip, n, evict, repeats)
        mine = float(np.median(times)) / 2 if peer is not None else 0.0
        out.append(slowest(comm, mine))
    return out


def never_slower(seconds) -> list:
    """Times per increasing message size with each kept at most every larger size's: a smaller
    message is never slower than a larger one (it could be sent padded), so a time above a
    larger size's is a stall while that size was timed, not a cost of its bytes (where ranks
    share cores, a stalled 8-byte time taken as the latency priced every message far too
    high)."""
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
    each call follows a copy of :data:`~.timing.COPY_BYTES` on every rank and a barrier (the
    copy evicts the buffer and the library's shared-memory cells from the caches as a block's
    forward or backward does), else the calls run back to back (:func:`_call_seconds`); the
    figure is the median of the slowest rank."""
    comm = counted(comm)
    evict = evictor() if cold else None
    out = []
    for n in sizes:
        buf = np.zeros(max(n // 4, 1), dtype=np.float32)
        times = _call_seconds(comm, partial(comm.bare_allreduce, buf), n, evict, repeats)
        out.append(slowest(comm, float(np.median(times))))
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
