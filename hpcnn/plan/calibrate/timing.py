"""The timing primitives every calibration module shares, and the calibration's common sizes.

- :func:`median_seconds` and :func:`window_seconds`: a call's median over repeats, and its mean
  over a wall-clock window (what a rank gets while the scheduler shares its core);
- :func:`evictor`: a copy of :data:`COPY_BYTES` that evicts the caches before a timed call, as a
  forward or backward pass does in training;
- :func:`counted` wraps the MPI communicator the calibration is handed in a
  :class:`~hpcnn.parallel.collectives.Communicator` (every MPI call goes through one);
  :func:`slowest`, :func:`agree` and :func:`quiet_barrier` are the small collectives the
  measurements end with;
- :func:`in_proportion`: a count of a :data:`FULL_ROUNDS` calibration scaled to ``--rounds``.

Every measurement is a median over repeats or rounds, so that one slow repeat on a shared
machine does not decide a figure; every function that takes ``comm`` is called on every rank.
"""
from __future__ import annotations

import time

import numpy as np

from hpcnn.parallel.collectives import Communicator

DTYPES = ("float32", "float64")
MATMUL_N = 768                  # the reference matmul: n x n, 2 n^3 FLOPs
COPY_BYTES = 64 << 20           # 64 MiB: well past the caches
COLD_REPEATS = 15               # ping-pongs and allreduces per size, each after a COPY_BYTES copy
# The default --rounds. measure() scales COLD_REPEATS and SUSTAIN_ROUNDS by rounds / FULL_ROUNDS
# (a test's 3 times fewer cold calls and windows, 30 twice as many) and SUSTAIN_S by it up to 1
# (shorter windows below 15; a window is already many scheduler slices).
FULL_ROUNDS = 15


def median_seconds(fn, repeats: int) -> float:
    """The median seconds of ``repeats`` calls of ``fn()``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def window_seconds(fn, seconds: float) -> float:
    """Mean seconds of ``fn`` over as many calls as fit in ``seconds`` of wall time (one warm-up
    call first, at least three timed)."""
    fn()
    count, t0 = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - t0 < seconds:
        fn()
        count += 1
    return (time.perf_counter() - t0) / count


def evictor():
    """A function of no argument that copies :data:`COPY_BYTES` (its buffers made once): the
    memory traffic of a forward or backward pass, which evicts what the next timed call uses."""
    src = np.ones(COPY_BYTES // 8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def counted(comm) -> Communicator:
    """``comm`` (an MPI communicator, as :func:`hpcnn.train.train` takes it) as a
    Communicator of its own counters; a Communicator is returned as it is."""
    return comm if isinstance(comm, Communicator) else Communicator(comm, name="calibrate")


def slowest(comm: Communicator, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (collective)."""
    return float(comm.allreduce_scalars([seconds], "max")[0])


def agree(comm: Communicator, flag: bool) -> bool:
    """True where ``flag`` is true on every rank (collective)."""
    return bool(comm.allreduce_scalars([float(flag)], "min")[0])


def quiet_barrier(comm: Communicator) -> None:
    """A barrier that sleeps while it waits: MPICH's blocking Barrier spins, and a spinning rank
    would take the core from rank 0 while it is timed alone."""
    req = comm.ibarrier()
    while not req.test():
        time.sleep(1e-3)


def in_proportion(count: int, rounds: int) -> int:
    """``count`` (what a calibration of :data:`FULL_ROUNDS` rounds times) for one of ``rounds``
    rounds, in proportion, at least 1."""
    return max(1, count * rounds // FULL_ROUNDS)
