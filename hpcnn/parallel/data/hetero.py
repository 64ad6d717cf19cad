"""Load balancing for heterogeneous data parallelism: batch shares that equalise step times.

Moreno-Álvarez, Paoletti, Rico-Gallego, Haut (J. Supercomputing 2022), building on their static
balancing (J. Supercomputing 2020): replica i of P, running at s_i samples/s, gets

    b_i = B · s_i / Σ_j s_j        (integers, Σ_i b_i = B)

of the global batch B, so that the compute time of a step, max_i b_i / s_i, is equalised. That
holds when a replica's compute time is proportional to its share. A real step also has a part
that does not shrink with the share (Python and launch overheads, the optimizer's bookkeeping,
an emulated slowdown's padding of it), so online this module models replica i's compute time as

    t_i(b) = a_i + c_i · b          (a_i fixed seconds, c_i seconds per sample),

fits a_i and c_i to each replica's measurements (:class:`StepTimeModel`), and chooses the
integer shares that minimise the slowest replica's predicted time, max_i t_i(b_i)
(:func:`balanced_shares`): equal predicted times where that is possible, ``min_share`` for a
replica whose fixed part alone is slower than the others' whole step. Balancing by measured
samples/s (the previous estimator) tends to the same split, but slowly: b/t(b) falls with the
share when t has a fixed part, so each rebalance moves a share only part of the way, and every
window's noise moves it again. Static speeds (``--speeds``) still use
:func:`proportional_shares`. The gradient weighting g_W = Σ_i (b_i/B)·g_i is done by the
training loop, which scales each rank's loss gradient by b_i/B before the sum allreduce.

:class:`Slowdown` is an *emulation* of a slower replica on a homogeneous machine (tests, demos,
teaching); it is not a model of any device. Example, a straggler appearing mid-run::

    mpiexec -n 4 python -m mpi4py tests/mpi/hetero_balancer.py
"""
from __future__ import annotations

import math
import statistics
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


def balanced_shares(fixed, per_sample, batch: int, min_share: int = 1) -> numpy.ndarray:
    """Integer shares minimising the slowest replica's predicted time max_i (a_i + c_i·b_i).

    Water-filling: the common time T with Σ_i max(min_share, (T − a_i)/c_i) = B is found
    exactly (replicas whose a_i + c_i·min_share exceeds T are pinned at ``min_share``, the
    others share the rest so that their predicted times are all T); each replica then gets the
    floor of its real-valued share, and the < P samples left go one at a time to the replica
    whose time after taking one more is least (lowest rank among ties). Greedy filling from
    below is optimal for this min-max problem, so the result is the integer optimum.
    Computed in Python floats with exactly rounded sums (:func:`math.fsum`), so that equal
    inputs give bitwise equal shares on every rank, whatever its machine.

    Parameters: ``fixed`` (P,) a_i >= 0 seconds; ``per_sample`` (P,) c_i > 0 seconds per
    sample; ``batch`` B >= P·min_share. Returns an int64 array (P,) with sum exactly B.
    Example: ``balanced_shares([0, 0], [1, 3], 8) -> [6, 2]`` (proportional when a = 0);
    ``balanced_shares([0, 2], [1, 1], 10) -> [6, 4]`` (both take 6 s).
    """
    a = [float(x) for x in numpy.asarray(fixed, dtype=numpy.float64).reshape(-1)]
    c = [float(x) for x in numpy.asarray(per_sample, dtype=numpy.float64).reshape(-1)]
    p = len(a)
    if p == 0 or len(c) != p:
        raise ValueError(f"fixed ({p} values) and per_sample ({len(c)} values): need one of each per replica")
    if not all(math.isfinite(x) and x >= 0 for x in a) or not all(math.isfinite(x) and x > 0 for x in c):
        raise ValueError(f"fixed must be finite and >= 0, per_sample finite and > 0; got {a}, {c}")
    batch = _check_batch(batch, p, min_share)
    free = list(range(p))
    while True:                                   # water level over the replicas not pinned
        rest = batch - min_share * (p - len(free))
        level = (rest + math.fsum(a[i] / c[i] for i in free)) / math.fsum(1 / c[i] for i in free)
        low = [i for i in free if a[i] + c[i] * min_share > level]
        if not low or len(low) == len(free):      # the last case only through rounding
            break
        free = [i for i in free if i not in low]
    b = [min_share] * p
    for i in free:
        b[i] = max(min_share, math.floor((level - a[i]) / c[i]))
    while sum(b) > batch:                         # rounding pushed the sum over: slowest gives one
        i = max((i for i in range(p) if b[i] > min_share), key=lambda i: (a[i] + c[i] * b[i], -i))
        b[i] -= 1
    while sum(b) < batch:                         # the remainder, one sample at a time
        i = min(range(p), key=lambda i: (a[i] + c[i] * (b[i] + 1), i))
        b[i] += 1
    return numpy.array(b, dtype=numpy.int64)


class StepTimeModel:
    """One replica's compute seconds as a function of its share: t(b) = fixed + per_sample·b.

    Fitted from the replica's last ``memory`` measurements, each (share, median compute
    seconds of one rebalancing window, standard error of that median), in this order:

    1. a least-squares line, when the kept shares span at least max(2, 20 % of the largest)
       samples and the slope is determined: per_sample > 0 by at least ``MIN_SLOPE_SIGMAS``
       standard errors (propagated from the medians' errors; a loaded machine's noise can
       otherwise make the fixed part, or the per-sample part, look like all of it). A
       negative fixed part is refitted as a line through the origin;
    2. otherwise only a scale: the shape (fixed : per_sample) of the last model is kept and
       multiplied to fit all kept measurements. Before any line the shape is (0 : 1), i.e.
       seconds proportional to the share: the samples/s estimate of static balancing. This is
       what keeps the model (and the shares) still once the shares stop moving, when every
       kept measurement has the same share and a slope cannot be identified.

    A measurement that differs from the model's prediction by more than ``change`` (relative)
    and by more than 3 of its standard errors, between the kept shares (not extrapolated: a
    line from two close shares may be far off outside them), starts a new regime: the older
    measurements are dropped, the shape is kept (a straggler appearing, the load changing).
    Attributes: ``fixed``, ``per_sample`` (None before the first measurement); ``line`` True
    when the current shape comes from a fitted line; ``kept`` the measurements.
    """

    MIN_SPREAD, MIN_RELATIVE_SPREAD, MIN_SLOPE_SIGMAS = 2, 0.2, 2.0

    def __init__(self, memory: int = 16, change: float = 0.25):
        if int(memory) != memory or memory < 1:
            raise ValueError(f"memory={memory!r}: must be a positive integer")
        if not change > 0:
            raise ValueError(f"change={change!r}: must be > 0")
        self.change = float(change)
        self.kept = deque(maxlen=int(memory))     # (share, seconds, error), oldest first
        self.fixed = self.per_sample = None
        self.line = False

    def predict(self, share: float) -> float:
        """Predicted compute seconds at ``share`` samples."""
        if self.fixed is None:
            raise ValueError("StepTimeModel.predict(): no measurement yet")
        return self.fixed + self.per_sample * share

    def observe(self, share: float, seconds: float, error: float = 0.0) -> None:
        """Add one measurement and refit: ``share`` samples took ``seconds`` (both > 0), known
        to within ``error`` seconds (standard error; 0 if unknown)."""
        if not (share > 0 and seconds > 0 and math.isfinite(share) and math.isfinite(seconds)):
            raise ValueError(f"share and seconds must be finite and > 0, got {share!r}, {seconds!r}")
        if not (error >= 0 and math.isfinite(error)):
            raise ValueError(f"error must be finite and >= 0, got {error!r}")
        share, seconds, error = float(share), float(seconds), float(error)
        shares = [b for b, _, _ in self.kept]
        if shares and min(shares) <= share <= max(shares):
            miss = abs(seconds - self.predict(share))
            if miss > self.change * self.predict(share) and miss > 3 * error:
                self.kept.clear()                 # a new regime: the old measurements are stale
                self.line = False
        self.kept.append((share, seconds, error))
        if not self._fit_line():
            self._fit_scale()

    def _fit_line(self) -> bool:
        bs = [b for b, _, _ in self.kept]
        if max(bs) - min(bs) < max(self.MIN_SPREAD, self.MIN_RELATIVE_SPREAD * max(bs)):
            return False
        n = len(bs)
        mb, mt = math.fsum(bs) / n, math.fsum(t for _, t, _ in self.kept) / n
        sbb = math.fsum((b - mb) ** 2 for b in bs)
        slope = math.fsum((b - mb) * (t - mt) for b, t, _ in self.kept) / sbb
        slope_error = math.sqrt(math.fsum(((b - mb) * e) ** 2 for b, _, e in self.kept)) / sbb
        if slope <= self.MIN_SLOPE_SIGMAS * slope_error:   # not physical, or not determined
            return False
        fixed = mt - slope * mb
        if fixed < 0:                             # through the origin instead
            fixed = 0.0
            slope = math.fsum(b * t for b, t, _ in self.kept) / math.fsum(b * b for b in bs)
        self.fixed, self.per_sample, self.line = fixed, slope, True
        return True

    def _fit_scale(self) -> None:
        shape = (0.0, 1.0) if self.fixed is None else (self.fixed, self.per_sample)
        pred = [shape[0] + shape[1] * b for b, _, _ in self.kept]
        scale = math.fsum(p * t for p, (_, t, _) in zip(pred, self.kept)) / math.fsum(p * p for p in pred)
        self.fixed, self.per_sample = scale * shape[0], scale * shape[1]


class StepMeter:
    """One rank's compute steps since the last rebalance: (samples, seconds) of each."""

    def __init__(self):
        self._steps = []

    def record(self, samples: float, seconds: float) -> None:
        """Add one step: ``samples`` processed in ``seconds`` of compute (waiting excluded)."""
        if not (samples >= 0 and math.isfinite(samples)):
            raise ValueError(f"samples must be finite and >= 0, got {samples!r}")
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        self._steps.append((float(samples), float(seconds)))

    def __len__(self) -> int:
        return len(self._steps)

    def summary(self) -> tuple[float, float, float]:
        """(mean samples, median seconds, standard error of that median) of the recorded
        steps. The median ignores a step that a preemption or a first-step warm-up made much
        slower than the others; its error is estimated robustly too, from the median absolute
        deviation: 1.2533 · 1.4826 · MAD / √n (both factors exact for normal noise; 0 for
        one step, where nothing is known)."""
        if not self._steps:
            raise ValueError("StepMeter.summary(): no step recorded yet")
        n = len(self._steps)
        med = statistics.median(y for _, y in self._steps)
        mad = statistics.median(abs(y - med) for _, y in self._steps)
        return math.fsum(x for x, _ in self._steps) / n, med, 1.2533 * 1.4826 * mad / math.sqrt(n)

    def reset(self) -> None:
        self._steps.clear()


class Balancer:
    """Per-rank batch shares for data parallelism over replicas of unequal speed.

    Parameters: ``comm`` a :class:`~hpcnn.parallel.collectives.Communicator` over the
    data-parallel replicas; ``batch`` the global batch B; ``policy`` ``"equal"`` (always equal shares) or
    ``"proportional"`` (shares by speed); ``speeds`` one number per rank for static
    proportional balancing (:func:`proportional_shares`), else ``None`` to measure online;
    ``rebalance_every`` K; ``min_share`` the least share of any rank; ``memory`` and
    ``change``: see :class:`StepTimeModel`.

    Online (proportional, no ``speeds``): every rank calls :meth:`step` after every step with
    the same ``step`` number. After steps K-1, 2K-1, ... each rank's share, median compute
    seconds over the last K steps (all taken with the same shares) and that median's standard
    error (:meth:`StepMeter.summary`) are allgathered; every rank then updates the same P
    models t_i(b) = a_i + c_i·b from these values only and takes the shares from :func:`balanced_shares`, so ``shares`` and ``speeds`` are bitwise identical on
    every rank. The first rebalance has one share per replica and balances by samples/s; the
    second, with two shares per replica, fits the lines; from then on the shares stay at the
    minimiser of the slowest predicted time until the measured times move away from the model.
    ``equal`` and static policies never communicate.

    Attributes: ``shares`` int64 (P,), in force for the next step; ``speeds`` float64 (P,),
    each replica's predicted samples/s at its share, b_i / t_i(b_i) (static: the given ones),
    or ``None`` before the first measurement; ``models`` the P :class:`StepTimeModel`;
    ``history`` list of ``(step, shares, speeds)``, each entry the shares in force from
    ``step`` on (``speeds`` all NaN if none known yet).
    """

    def __init__(self, comm, batch: int, policy: str = "proportional", *, speeds=None,
                 rebalance_every: int = 10, min_share: int = 1, memory: int = 16,
                 change: float = 0.25):
        p = comm.size
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {POLICIES}")
        if int(rebalance_every) != rebalance_every or rebalance_every < 1:
            raise ValueError(f"rebalance_every={rebalance_every!r}: must be a positive integer")
        if speeds is not None and policy == "equal":
            raise ValueError(f"speeds {list(speeds)} given with policy 'equal': use 'proportional'")
        self.comm, self.rank, self.size = comm, comm.rank, p
        self.batch = _check_batch(batch, p, min_share)
        self.policy, self.every, self.min_share = policy, int(rebalance_every), int(min_share)
        self.measured = policy == "proportional" and speeds is None
        self.meter = StepMeter()
        self.models = [StepTimeModel(memory, change) for _ in range(p)]
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

    def predicted_seconds(self, shares=None) -> numpy.ndarray:
        """(P,) each replica's predicted compute seconds at ``shares`` (default: the current)."""
        shares = self.shares if shares is None else shares
        return numpy.array([m.predict(float(b)) for m, b in zip(self.models, shares)])

    def step(self, step: int, local_samples: int, local_compute_seconds: float) -> bool:
        """Record this rank's step; every K steps, measure, refit and rebalance (collective).

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
        measured = self.comm.allgather_scalars(self.meter.summary())      # (P, 3)
        self.meter.reset()
        if not (numpy.all(numpy.isfinite(measured)) and numpy.all(measured[:, :2] > 0)):
            return False              # a rank measured no time or no samples: keep the shares
        for model, (share, seconds, error) in zip(self.models, measured.tolist()):
            model.observe(share, seconds, error)
        self.shares = balanced_shares([m.fixed for m in self.models],
                                      [m.per_sample for m in self.models], self.batch, self.min_share)
        self.speeds = self.shares / self.predicted_seconds()
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
