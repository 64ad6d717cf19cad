"""Load balancing for heterogeneous data parallelism: batch shares proportional to replica speed.

Moreno-Álvarez, Paoletti, Rico-Gallego, Haut (J. Supercomputing 2022), building on their static
balancing (J. Supercomputing 2020): replica i of P, running at s_i samples/s, gets

    b_i = B · s_i / Σ_j s_j        (integers, Σ_i b_i = B)

of the global batch B, so that the compute time of a step, max_i b_i / s_i, is equalised. This
module only decides the b_i: from speeds given in the config (static) or from speeds measured
online and re-decided every K steps. The gradient weighting g_W = Σ_i (b_i/B)·g_i is done by
the training loop, which scales each rank's loss gradient by b_i/B before the sum allreduce.

:class:`Slowdown` is an *emulation* of a slower replica on a homogeneous machine (tests, demos,
teaching); it is not a model of any device. Example, a straggler appearing mid-run::

    mpiexec -n 4 python -m mpi4py tests/mpi/hetero_balancer.py
"""
from __future__ import annotations

import math
import time
from collections import deque

import numpy

POLICIES = ("equal", "proportional")
_REL_TOL = 1e-12   # floor(q·(1+tol)): exact ratios such as 6·0.3/0.6 stay 3 in floating point


def _check_speeds(speeds, p: int | None = None) -> numpy.ndarray:
    s = numpy.asarray(speeds, dtype=numpy.float64).reshape(-1)
    if s.size == 0:
        raise ValueError("speeds: need at least one replica, got none")
    if p is not None and s.size != p:
        raise ValueError(f"speeds: got {s.size} values {s.tolist()} for {p} replicas")
    if not numpy.all(numpy.isfinite(s) & (s > 0)):
        raise ValueError(f"speeds must be finite and > 0, got {s.tolist()}")
    return s


def _check_batch(batch, p: int, min_share: int = 1) -> int:
    if int(batch) != batch or min_share < 1 or int(min_share) != min_share:
        raise ValueError(f"batch ({batch}) and min_share ({min_share}) must be integers, min_share >= 1")
    if batch < p * min_share:
        what = f"number of replicas ({p})" if min_share == 1 else f"replicas x min_share ({p}*{min_share})"
        raise ValueError(f"batch ({batch}) < {what}")
    return int(batch)


def equal_shares(p: int, batch: int) -> numpy.ndarray:
    """Shares of ``batch`` over ``p`` replicas, as equal as possible.

    Returns an int64 array of length ``p`` summing to ``batch``; the remainder ``batch % p``
    goes one sample each to the lowest ranks: ``equal_shares(4, 10) -> [3, 3, 2, 2]``.
    """
    if int(p) != p or p < 1:
        raise ValueError(f"number of replicas must be a positive integer, got {p!r}")
    batch = _check_batch(batch, int(p))
    b = numpy.full(int(p), batch // p, dtype=numpy.int64)
    b[: batch % p] += 1
    return b


def proportional_shares(speeds, batch: int, min_share: int = 1) -> numpy.ndarray:
    """Shares of ``batch`` proportional to ``speeds``, as integers (static balancing).

    Each replica first gets floor(B·s_i/Σs); the rounding remainder (< P samples) goes to the
    fastest replica (lowest rank among ties), as in the static balancing of Moreno-Álvarez et
    al. A replica whose floor is below ``min_share`` is raised to it and the rest of the batch
    is shared among the others the same way, so every share is >= ``min_share``.

    Parameters: ``speeds`` (P,) finite positive numbers (samples/s, any unit); ``batch`` the
    global batch B >= P·min_share. Returns an int64 array (P,) with sum exactly B.
    Example: ``proportional_shares([1, 3], 8) -> [2, 6]``; ``([1, 1, 1, 1], 10) -> [4, 2, 2, 2]``.
    """
    s = _check_speeds(speeds)
    p = s.size
    batch = _check_batch(batch, p, min_share)
    free = numpy.ones(p, dtype=bool)              # replicas not pinned at min_share
    while True:
        rest = batch - min_share * int(numpy.count_nonzero(~free))
        q = rest * s[free] / s[free].sum()
        f = numpy.floor(q * (1 + _REL_TOL)).astype(numpy.int64)
        low = f < min_share
        if not low.any():
            break
        free[numpy.flatnonzero(free)[low]] = False  # never the fastest: its q >= rest/|free| >= min_share
    b = numpy.full(p, min_share, dtype=numpy.int64)
    b[free] = f
    fastest = int(numpy.argmax(s))                # first maximum: lowest rank among ties
    b[fastest] += batch - int(b.sum())
    return b


class SpeedMeter:
    """Samples per second of one rank's own compute over the last ``window`` steps."""

    def __init__(self, window: int):
        if int(window) != window or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        self.window = int(window)
        self._steps = deque(maxlen=self.window)

    def record(self, samples: float, seconds: float) -> None:
        """Add one step: ``samples`` processed in ``seconds`` of compute (waiting excluded)."""
        if not (samples >= 0 and math.isfinite(samples)):
            raise ValueError(f"samples must be finite and >= 0, got {samples!r}")
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        self._steps.append((float(samples), float(seconds)))

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def ready(self) -> bool:
        """True once ``window`` steps have been recorded."""
        return len(self._steps) == self.window

    def speed(self) -> float:
        """Σ samples / Σ seconds over the window (``inf`` if no time was measured)."""
        if not self._steps:
            raise ValueError("SpeedMeter.speed(): no step recorded yet")
        n = sum(x for x, _ in self._steps)
        t = sum(y for _, y in self._steps)
        return n / t if t > 0 else math.inf

    def reset(self) -> None:
        self._steps.clear()


class Balancer:
    """Per-rank batch shares for data parallelism over replicas of unequal speed.

    Parameters: ``comm`` a :class:`~hpcnn.parallel.comm.Communicator` over the data-parallel
    replicas; ``batch`` the global batch B; ``policy`` ``"equal"`` (always equal shares) or
    ``"proportional"`` (shares from speeds, :func:`proportional_shares`); ``speeds`` one number
    per rank for static proportional balancing, else ``None`` to measure online;
    ``rebalance_every`` K; ``smoothing`` in [0, 1), the weight of the old speed estimate in the
    exponential moving average (0 = use the latest window only); ``min_share`` the least share
    of any rank; ``window`` steps per speed measurement (default K).

    Online (proportional, no ``speeds``): every rank calls :meth:`step` after every step with
    the same ``step`` number; after steps K-1, 2K-1, ... the ranks' windowed speeds are
    allgathered and smoothed (the first measurement replaces the initial guess), and the shares
    recomputed. Only allgathered values enter the decision, so ``shares`` and ``speeds`` are
    bitwise identical on every rank. ``equal`` and static policies never communicate.

    Attributes: ``shares`` int64 (P,), in force for the next step; ``speeds`` float64 (P,) or
    ``None`` before the first measurement; ``history`` list of ``(step, shares, speeds)``, each
    entry the shares in force from ``step`` on (``speeds`` all NaN if none known yet).
    """

    def __init__(self, comm, batch: int, policy: str = "proportional", *, speeds=None,
                 rebalance_every: int = 10, smoothing: float = 0.5, min_share: int = 1,
                 window: int | None = None):
        p = comm.size
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {POLICIES}")
        if int(rebalance_every) != rebalance_every or rebalance_every < 1:
            raise ValueError(f"rebalance_every={rebalance_every!r}: must be a positive integer")
        if not 0 <= smoothing < 1:
            raise ValueError(f"smoothing={smoothing!r}: must be in [0, 1)")
        if speeds is not None and policy == "equal":
            raise ValueError(f"speeds {list(speeds)} given with policy 'equal': use 'proportional'")
        self.comm, self.rank, self.size = comm, comm.rank, p
        self.batch = _check_batch(batch, p, min_share)
        self.policy, self.every = policy, int(rebalance_every)
        self.smoothing, self.min_share = float(smoothing), int(min_share)
        self.measured = policy == "proportional" and speeds is None
        self.meter = SpeedMeter(window or self.every)
        if speeds is not None:
            self.speeds = _check_speeds(speeds, p)
            self.shares = proportional_shares(self.speeds, self.batch, self.min_share)
        else:
            self.speeds = None
            self.shares = equal_shares(p, self.batch)
        self.history = [(0, self.shares.copy(), self._speeds_or_nan())]

    def _speeds_or_nan(self) -> numpy.ndarray:
        return self.speeds.copy() if self.speeds is not None else numpy.full(self.size, numpy.nan)

    @property
    def local_share(self) -> int:
        """This rank's number of samples in the next step."""
        return int(self.shares[self.rank])

    @property
    def offsets(self) -> numpy.ndarray:
        """(P,) index of each rank's first sample in the global batch (exclusive prefix sum)."""
        return numpy.concatenate(([0], numpy.cumsum(self.shares)[:-1])).astype(numpy.int64)

    def step(self, step: int, local_samples: int, local_compute_seconds: float) -> bool:
        """Record this rank's step; every K steps, measure, smooth and rebalance (collective).

        ``local_compute_seconds`` is this rank's own compute time for ``local_samples``
        (including any emulated slowdown, excluding time spent waiting for other ranks), so a
        straggler that appears mid-run is seen at the next rebalance. Must be called on every
        rank with the same ``step``. Returns True when the shares were recomputed.
        """
        if not self.measured:
            return False
        self.meter.record(local_samples, local_compute_seconds)
        if (step + 1) % self.every:
            return False
        measured = self.comm.allgather_scalars([self.meter.speed()])[:, 0]     # (P,)
        if not numpy.all(numpy.isfinite(measured) & (measured > 0)):
            return False              # a rank measured no time or no samples: keep the shares
        if self.speeds is None:
            self.speeds = measured
        else:
            self.speeds = self.smoothing * self.speeds + (1 - self.smoothing) * measured
        self.shares = proportional_shares(self.speeds, self.batch, self.min_share)
        self.history.append((step + 1, self.shares.copy(), self.speeds.copy()))
        return True

    def __repr__(self) -> str:
        return (f"Balancer({self.policy}, batch {self.batch}, shares {self.shares.tolist()}, "
                f"rank {self.rank}/{self.size})")


class Slowdown:
    """EMULATION of a replica ``factor`` times slower: pad each compute phase with extra time.

    After a compute phase of t seconds, :meth:`pad` adds (factor − 1)·t: ``mode="sleep"``
    sleeps (an independent slower device; the shared core is free meanwhile), ``mode="spin"``
    busy-waits (burns the core like real compute would). ``factor=1`` is a no-op. For tests and
    demos of heterogeneous data parallelism on a homogeneous machine only.
    """

    emulated = True
    MODES = ("sleep", "spin")

    def __init__(self, factor: float = 1.0, mode: str = "sleep"):
        if not (math.isfinite(factor) and factor >= 1):
            raise ValueError(f"slowdown factor must be finite and >= 1, got {factor!r}")
        if mode not in self.MODES:
            raise ValueError(f"slowdown mode={mode!r}: expected one of {self.MODES}")
        self.factor, self.mode = float(factor), mode

    def pad(self, seconds: float) -> float:
        """Wait (factor − 1)·``seconds``; return the extra seconds actually spent (0.0 if none)."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"compute seconds must be finite and >= 0, got {seconds!r}")
        extra = (self.factor - 1.0) * seconds
        if extra <= 0:
            return 0.0
        t0 = time.perf_counter()
        if self.mode == "sleep":
            time.sleep(extra)
        else:
            while time.perf_counter() - t0 < extra:
                pass
        return time.perf_counter() - t0

    def __repr__(self) -> str:
        return f"Slowdown({self.factor:g}, {self.mode!r}, emulated)"


def slowdowns_from_config(spec: str, world_size: int) -> list[float]:
    """Parse ``"rank:factor,..."`` (e.g. ``"1:2.0"``, ``"1:2,3:4"``; ``""`` = none) into one
    emulated slowdown factor per rank (1.0 where not given). A malformed item, a rank outside
    [0, world_size), a rank given twice or a factor not finite and >= 1 is a ValueError that
    starts with ``slowdown='...'`` (the option as the user wrote it)."""
    factors = [1.0] * world_size
    seen = set()
    opt = f"slowdown={spec!r}"
    for item in (x.strip() for x in spec.split(",")) if spec.strip() else ():
        parts = item.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            rank, factor = int(parts[0]), float(parts[1])
        except ValueError:
            raise ValueError(f"{opt}: item {item!r} is not rank:factor "
                             f"(e.g. '1:2.0' or '1:2,3:4')") from None
        if not 0 <= rank < world_size:
            raise ValueError(f"{opt}: rank {rank} out of range for {world_size} ranks "
                             f"(data-parallel ranks 0..{world_size - 1})")
        if rank in seen:
            raise ValueError(f"{opt}: rank {rank} given twice")
        if not (math.isfinite(factor) and factor >= 1):
            raise ValueError(f"{opt}: factor {factor} for rank {rank} must be finite and >= 1")
        seen.add(rank)
        factors[rank] = factor
    return factors


def parse_speeds(spec: str, p: int) -> list[float]:
    """Parse ``"1,3"`` into ``[1.0, 3.0]``: one finite positive speed per replica (``p`` of
    them); otherwise a ValueError that starts with ``speeds='...'``."""
    opt = f"speeds={spec!r}"
    try:
        speeds = [float(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"{opt}: expected comma-separated numbers such as '1,3'") from None
    if len(speeds) != p:
        raise ValueError(f"{opt}: got {len(speeds)} values for {p} replicas (one per --dp rank)")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"{opt}: speeds must be finite and > 0, got {speeds}")
    return speeds
