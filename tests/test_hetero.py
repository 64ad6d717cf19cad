"""Heterogeneous data parallelism, load-balancing side: shares, speed meter, balancer, emulation.

Serial tests here; the multi-rank balancer (a straggler appearing mid-run) runs under mpiexec.
"""
import itertools
import math
import time

import numpy as np
import pytest

from hpcnn.parallel.data.hetero import (Balancer, Slowdown, StepMeter, StepTimeModel,
                                        balanced_shares, equal_shares, parse_speeds,
                                        proportional_shares, slowdowns_from_config)
from mpi_util import CaseRuns


# -- shares -------------------------------------------------------------------------------------
def test_proportional_exact_ratios():
    np.testing.assert_array_equal(proportional_shares([1, 3], 8), [2, 6])
    np.testing.assert_array_equal(proportional_shares([100, 100 / 3], 120), [90, 30])
    np.testing.assert_array_equal(proportional_shares([0.1, 0.2, 0.3], 6), [1, 2, 3])  # 6*.3/.6 < 3 in fp
    assert proportional_shares([5.0, 5.0], 7).dtype == np.int64


def test_remainder_goes_to_fastest_lowest_rank_on_ties():
    # floors 2, 2, 5 (q = 2.5, 2.5, 5): remainder 1 to rank 2, the fastest
    np.testing.assert_array_equal(proportional_shares([1, 1, 2], 10), [2, 2, 6])
    # q = 4.4, 4.4, 2.2: floors 4, 4, 2, remainder 1 to rank 0 (tie with rank 1)
    np.testing.assert_array_equal(proportional_shares([2, 2, 1], 11), [5, 4, 2])
    np.testing.assert_array_equal(proportional_shares([1, 1, 1, 1], 10), [4, 2, 2, 2])
    np.testing.assert_array_equal(proportional_shares([1, 3, 3], 9), [1, 5, 3])  # q 1.29, 3.86, 3.86


def test_random_speeds_sum_bound_and_min():
    rng = np.random.default_rng(0)
    for _ in range(500):
        p = int(rng.integers(1, 9))
        s = rng.uniform(0.01, 10, p)
        batch = int(rng.integers(p, 2000))
        b = proportional_shares(s, batch)
        assert b.sum() == batch and b.min() >= 1, (s, batch, b)
        if b.min() > 1:                      # nothing clipped: floor, plus < p on the fastest
            q = batch * s / s.sum()
            assert np.all(np.abs(b - q) < p), (s, batch, b)
            others = np.arange(p) != np.argmax(s)
            assert np.all(b[others] <= q[others] + 1e-9)


def test_every_share_at_least_min():
    np.testing.assert_array_equal(proportional_shares([1000, 1, 1], 3), [1, 1, 1])
    np.testing.assert_array_equal(proportional_shares([1000, 1, 1], 10), [8, 1, 1])
    # clipping two slow ranks lowers the others' q: repeated until all fit
    np.testing.assert_array_equal(proportional_shares([1, 1, 1e-9, 1e-9], 4), [1, 1, 1, 1])
    np.testing.assert_array_equal(proportional_shares([1000, 1, 1], 10, min_share=3), [4, 3, 3])


def test_share_errors_name_values():
    with pytest.raises(ValueError, match=r"batch \(2\) < number of replicas \(3\)"):
        proportional_shares([1, 2, 3], 2)
    with pytest.raises(ValueError, match=r"batch \(5\) < replicas x min_share \(3\*2\)"):
        proportional_shares([1, 2, 3], 5, min_share=2)
    for bad in ([1, 0], [1, -2], [1, math.nan], [1, math.inf]):
        with pytest.raises(ValueError, match=r"finite and > 0, got \[1\.0, (0\.0|-2\.0|nan|inf)\]"):
            proportional_shares(bad, 10)
    with pytest.raises(ValueError, match="at least one replica"):
        proportional_shares([], 10)


def test_equal_shares():
    np.testing.assert_array_equal(equal_shares(4, 10), [3, 3, 2, 2])
    np.testing.assert_array_equal(equal_shares(3, 9), [3, 3, 3])
    assert equal_shares(5, 5).sum() == 5
    with pytest.raises(ValueError, match=r"batch \(3\) < number of replicas \(4\)"):
        equal_shares(4, 3)
    with pytest.raises(ValueError, match="positive integer, got 0"):
        equal_shares(0, 3)


# -- shares that minimise the slowest predicted time -------------------------------------------
def brute_force_minmax(a, c, batch, m):
    """The least max_i (a_i + c_i b_i) over all integer splits (small P and B only)."""
    best = math.inf
    for cut in itertools.product(range(m, batch + 1), repeat=len(a) - 1):
        last = batch - sum(cut)
        if last >= m:
            b = np.array(cut + (last,))
            best = min(best, float(np.max(np.asarray(a) + np.asarray(c) * b)))
    return best


def test_balanced_shares_examples():
    np.testing.assert_array_equal(balanced_shares([0, 0], [1, 3], 8), [6, 2])      # proportional
    np.testing.assert_array_equal(balanced_shares([0, 2], [1, 1], 10), [6, 4])      # 6 s each
    # slowdown 3 of fixed + per-sample: 1 + 0.1 b0 = 3 (1 + 0.1 b1) at b1 = 10, b0 = 50
    np.testing.assert_array_equal(balanced_shares([1, 3], [0.1, 0.3], 60), [50, 10])
    # the fixed part alone is slower than the other's whole step: min_share, not a negative share
    np.testing.assert_array_equal(balanced_shares([0.3, 0.9], [0.004, 0.012], 64), [63, 1])
    np.testing.assert_array_equal(balanced_shares([0.3, 0.9], [0.004, 0.012], 64, min_share=4), [60, 4])
    assert balanced_shares([1, 1, 1], [1, 1, 1], 10).tolist() == [4, 3, 3]          # ties: low ranks
    assert balanced_shares([0.0], [2.0], 5).tolist() == [5]


def test_balanced_shares_is_the_integer_minmax():
    rng = np.random.default_rng(1)
    for _ in range(300):
        p = int(rng.integers(2, 4))
        m = int(rng.integers(1, 3))
        batch = int(rng.integers(p * m, 25))
        a = rng.uniform(0, 2, p) * (rng.random(p) < 0.7)
        c = rng.uniform(0.01, 1, p)
        b = balanced_shares(a, c, batch, m)
        assert b.sum() == batch and b.min() >= m and b.dtype == np.int64, (a, c, batch, b)
        assert np.max(a + c * b) <= brute_force_minmax(a, c, batch, m) * (1 + 1e-12), (a, c, batch, b)


def test_balanced_shares_errors():
    with pytest.raises(ValueError, match=r"batch \(2\) < number of replicas \(3\)"):
        balanced_shares([0, 0, 0], [1, 1, 1], 2)
    with pytest.raises(ValueError, match=r"per_sample finite and > 0; got \[0\.0, 0\.0\], \[1\.0, 0\.0\]"):
        balanced_shares([0, 0], [1, 0], 4)
    with pytest.raises(ValueError, match="fixed must be finite and >= 0"):
        balanced_shares([-1, 0], [1, 1], 4)
    with pytest.raises(ValueError, match=r"fixed \(2 values\) and per_sample \(3 values\)"):
        balanced_shares([0, 0], [1, 1, 1], 4)


# -- the per-replica model t(b) = fixed + per_sample * b ------------------------------------------
def test_step_time_model_fits_a_line_once_the_shares_spread():
    m = StepTimeModel(memory=4)
    m.observe(32, 2 + 0.1 * 32)                     # one share: seconds proportional to it
    assert (m.fixed, m.line) == (0.0, False) and m.per_sample == pytest.approx(5.2 / 32)
    m.observe(30, 2 + 0.1 * 30)                     # 2 apart: under 20 % of 32, only the scale
    assert not m.line and m.fixed == 0.0
    m.observe(16, 2 + 0.1 * 16)                     # now a line: exact on exact data
    assert m.line and m.fixed == pytest.approx(2) and m.per_sample == pytest.approx(0.1)
    assert m.predict(50) == pytest.approx(7)
    for _ in range(4):                              # the spread shares leave the memory: the
        m.observe(16, 2 + 0.1 * 16)                 # line's shape stays, its scale is refitted
    assert m.line and [b for b, _, _ in m.kept] == [16] * 4
    assert m.fixed == pytest.approx(2) and m.per_sample == pytest.approx(0.1)
    m.observe(16, 1.2 * (2 + 0.1 * 16))             # 20 % slower once: a quarter of that in scale
    assert m.fixed == pytest.approx(2.1) and m.per_sample == pytest.approx(0.105)


def test_step_time_model_unphysical_lines():
    m = StepTimeModel()
    m.observe(10, 1.0)
    m.observe(20, 2.1)                              # through the origin: fixed < 0 refitted at 0
    assert m.line and m.fixed == 0.0 and m.per_sample == pytest.approx((10 + 42) / 500)
    m = StepTimeModel()
    m.observe(10, 1.0)
    m.observe(20, 0.95)                             # less time for more work: slope not fitted,
    assert not m.line and m.fixed == 0.0            # the proportional shape is rescaled
    assert m.per_sample == pytest.approx((10 * 1.0 + 20 * 0.95) / 500)
    with pytest.raises(ValueError, match="finite and > 0, got 0, 1"):
        m.observe(0, 1.0)
    with pytest.raises(ValueError, match="no measurement"):
        StepTimeModel().predict(3)
    with pytest.raises(ValueError, match="memory=0"):
        StepTimeModel(memory=0)


def test_step_time_model_new_regime_drops_the_old_measurements():
    m = StepTimeModel(change=0.25)
    for b in (40, 20, 40):
        m.observe(b, 1 + 0.1 * b)
    assert m.line and m.fixed == pytest.approx(1)
    m.observe(60, 3 * (1 + 0.1 * 60))               # outside the measured shares: no verdict
    assert len(m.kept) == 4
    m = StepTimeModel(change=0.25)
    for b in (40, 20, 40):
        m.observe(b, 1 + 0.1 * b)
    m.observe(30, 3 * (1 + 0.1 * 30), 0.5)          # 3x the prediction between them: a straggler
    assert list(m.kept) == [(30.0, 12.0, 0.5)] and not m.line
    assert m.fixed == pytest.approx(3) and m.per_sample == pytest.approx(0.3)   # shape kept
    m.observe(30, 12 * 1.2)                          # 20 %: noise, kept
    assert len(m.kept) == 2
    m.observe(30, 18.0, 2.0)                         # 36 % off, but within 3 errors (6 s)
    assert len(m.kept) == 3
    m.observe(30, 24.0, 1.0)                         # 75 % off and beyond 3 errors: a new regime
    assert len(m.kept) == 1


def test_step_time_model_needs_a_determined_slope():
    m = StepTimeModel()
    m.observe(40, 5.0, 0.2)
    m.observe(20, 4.8, 0.2)        # slope 0.01 +- 0.014: the noise could make it anything
    assert not m.line and m.fixed == 0.0
    m = StepTimeModel()
    m.observe(40, 5.0, 0.02)
    m.observe(20, 4.8, 0.02)       # slope 0.01 +- 0.0014: a fixed part of 4.6 s
    assert m.line and m.fixed == pytest.approx(4.6) and m.per_sample == pytest.approx(0.01)
    with pytest.raises(ValueError, match="error must be finite and >= 0, got -1"):
        m.observe(20, 4.8, -1)


def test_step_meter():
    m = StepMeter()
    with pytest.raises(ValueError, match="no step recorded"):
        m.summary()
    for samples, seconds in ((10, 1.0), (10, 9.0), (10, 2.0)):
        m.record(samples, seconds)
    mean, median, error = m.summary()                        # the median ignores the slow step
    assert (mean, median, len(m)) == (10.0, 2.0, 3)
    assert error == pytest.approx(1.2533 * 1.4826 * 1.0 / math.sqrt(3))   # MAD |1 - 2| = 1
    m.reset()
    m.record(4, 0.5)
    assert m.summary() == (4.0, 0.5, 0.0)
    m.record(6, 0.7)
    assert m.summary()[:2] == (5.0, 0.6)
    rng = np.random.default_rng(0)                           # normal noise: the error is the
    medians, errors = [], []                                  # spread of the medians
    for _ in range(400):
        m.reset()
        for x in rng.normal(1.0, 0.1, 15):
            m.record(1, x)
        medians.append(m.summary()[1])
        errors.append(m.summary()[2])
    assert 0.7 < np.median(errors) / np.std(medians) < 1.3, (np.median(errors), np.std(medians))
    for bad in ((-1, 1.0), (1, -1.0), (1, math.nan)):
        with pytest.raises(ValueError, match="finite and >= 0"):
            m.record(*bad)


# -- balancer (serial, with a stand-in communicator) --------------------------------------------
class FakeComm:
    """P ranks seen from ``rank``: allgather returns the other ranks' preset rows."""

    def __init__(self, size, rank=0, others=None):
        self.size, self.rank, self.others, self.calls = size, rank, others, 0

    def allgather_scalars(self, values):
        if self.others is None:
            raise AssertionError("this policy must not communicate")
        self.calls += 1
        out = np.array(self.others, dtype=float).reshape(self.size, -1)
        out[self.rank] = values
        return out


def test_balancer_equal_and_static_never_communicate():
    b = Balancer(FakeComm(3), 10, "equal")
    for s in range(25):
        assert not b.step(s, b.local_share, 1.0)
    np.testing.assert_array_equal(b.shares, [4, 3, 3])
    b = Balancer(FakeComm(2, rank=1), 8, "proportional", speeds=[1, 3])
    for s in range(25):
        assert not b.step(s, b.local_share, 1.0)
    np.testing.assert_array_equal(b.shares, [2, 6])
    assert b.local_share == 6 and b.offsets.tolist() == [0, 2]
    assert len(b.history) == 1 and b.history[0][2].tolist() == [1.0, 3.0]


def test_balancer_online_fits_fixed_and_per_sample_cost():
    """Rank 1 is 3x slower on t(b) = 0.1 + 0.01 b: exact shares after two rebalances."""
    def t(rank, b):
        return (3 if rank == 1 else 1) * (0.1 + 0.01 * b)

    c = FakeComm(2, rank=0)
    bal = Balancer(c, 100, "proportional", rebalance_every=3)
    np.testing.assert_array_equal(bal.shares, [50, 50])
    assert np.isnan(bal.history[0][2]).all()
    for step in range(6):            # rank 0's first step is 9x slower (warm-up): the median skips it
        c.others = [[0, 0, 0], [bal.shares[1], t(1, bal.shares[1]), 0]]
        bal.step(step, bal.shares[0], t(0, bal.shares[0]) * (9 if step == 0 else 1))
        if step == 2:                # one share each: balanced by samples/s, 50/0.6 : 50/1.8
            assert bal.shares.tolist() == [75, 25] and bal.models[0].fixed == 0.0
    np.testing.assert_array_equal(bal.shares, balanced_shares([0.1, 0.3], [0.01, 0.03], 100))
    assert bal.shares.tolist() == [80, 20] and c.calls == 2
    np.testing.assert_allclose(bal.predicted_seconds(), [0.9, 0.9])
    np.testing.assert_allclose(bal.speeds, [80 / 0.9, 20 / 0.9])
    assert [h[0] for h in bal.history] == [0, 3, 6] and bal.offsets.tolist() == [0, 80]
    c.others = [[0, 0, 0], [20, t(1, 20), 0]]
    bal.step(6, 80, 0.0)
    bal.step(7, 80, 0.0)
    assert not bal.step(8, 80, 0.0)                  # rank 0 measured no time: shares kept
    assert bal.shares.tolist() == [80, 20] and len(bal.history) == 3


def test_balancer_errors():
    c = FakeComm(3)
    with pytest.raises(ValueError, match="policy='fast'"):
        Balancer(c, 10, "fast")
    with pytest.raises(ValueError, match=r"got 2 values \[1\.0, 2\.0\] for 3 replicas"):
        Balancer(c, 10, "proportional", speeds=[1, 2])
    with pytest.raises(ValueError, match="with policy 'equal'"):
        Balancer(c, 10, "equal", speeds=[1, 2, 3])
    with pytest.raises(ValueError, match="change=0"):
        Balancer(c, 10, change=0)
    with pytest.raises(ValueError, match="rebalance_every=0"):
        Balancer(c, 10, rebalance_every=0)
    with pytest.raises(ValueError, match=r"batch \(5\) < replicas x min_share \(3\*2\)"):
        Balancer(c, 5, min_share=2)


# -- convergence on simulated replicas (deterministic: seeded noise, no clock) --------------------
class SimulatedReplicas:
    """P replicas whose compute seconds follow the emulation's model with noise.

    Replica i takes factor_i * (fixed + per_sample * b) * lognormal(3 %) seconds for b samples,
    and 2 % of its steps are 2-5x slower (a preemption): :class:`Slowdown` pads (factor - 1)
    times the whole compute, fixed part included. (The accuracy of the shares is limited by
    this noise: with 5 % per step, a share of 15-30 samples whose replica has a large fixed
    part strays a sample or two beyond 5 % in a few of 20 seeds.) Acts as the balancer's communicator from rank
    0's side: at a rebalance it returns the other ranks' :meth:`StepMeter.summary` of the steps
    they ran since the last one.
    """

    def __init__(self, factors, fixed, per_sample, seed=0, noise=0.03, spikes=0.02):
        self.factors, self.fixed, self.per_sample = np.asarray(factors, float), fixed, per_sample
        self.size, self.rank = len(factors), 0
        self.rng, self.noise, self.spikes = np.random.default_rng(seed), noise, spikes
        self.meters = [StepMeter() for _ in factors]

    def true_seconds(self, shares):
        return self.factors * (self.fixed + self.per_sample * np.asarray(shares, float))

    def equalising_split(self, batch, min_share=1):
        """Real-valued shares with equal true times (min_share where that is impossible)."""
        lo, hi = 0.0, float(self.true_seconds([batch] * self.size).max())
        for _ in range(100):                                  # bisection on the common time
            level = (lo + hi) / 2
            b = np.maximum(min_share, (level / self.factors - self.fixed) / self.per_sample)
            lo, hi = (level, hi) if b.sum() < batch else (lo, level)
        return b

    def run_step(self, shares):
        """Each replica's seconds for one step at ``shares``."""
        t = self.true_seconds(shares) * np.exp(self.noise * self.rng.standard_normal(self.size))
        return t * np.where(self.rng.random(self.size) < self.spikes, self.rng.uniform(2, 5, self.size), 1)

    def allgather_scalars(self, values):
        out = np.array([values] + [m.summary() for m in self.meters[1:]])
        for m in self.meters:
            m.reset()
        return out


def simulate(world, batch, rebalances, every=10, onset=None, factors_after=None):
    """Train ``rebalances`` * ``every`` simulated steps; return the shares after each rebalance."""
    bal = Balancer(world, batch, "proportional", rebalance_every=every)
    trajectory = []
    for step in range(rebalances * every):
        if step == onset:
            world.factors = np.asarray(factors_after, float)
        t = world.run_step(bal.shares)
        for i in range(1, world.size):
            world.meters[i].record(bal.shares[i], t[i])
        if bal.step(step, bal.local_share, t[0]):
            trajectory.append(bal.shares.copy())
    return np.array(trajectory)


def settles_near(trajectory, target, rel=0.05):
    """Index of the first rebalance from which every share stays within ``rel`` of ``target``
    (or within one sample: integer rounding), else None."""
    ok = np.all(np.abs(trajectory - target) <= np.maximum(rel * target, 1.0), axis=1)
    bad = np.flatnonzero(~ok)
    return 0 if bad.size == 0 else (int(bad[-1]) + 1 if bad[-1] + 1 < len(ok) else None)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("factor", [1.5, 2, 3, 4])
def test_online_shares_settle_at_the_time_equalising_split(p, factor):
    """One replica ``factor`` slower, fixed part 20 % of an equal-share step: within 5 % of the
    equalising split after at most 5 rebalances and for the 35 after; times within 10 %."""
    batch, per_sample = 256, 1e-4
    fixed = 0.25 * per_sample * batch / p
    world = SimulatedReplicas([1.0] * (p - 1) + [factor], fixed, per_sample, seed=p * 10 + int(factor * 2))
    target = world.equalising_split(batch)
    assert target.min() > 5, target                  # an interior split: equalising is possible
    trajectory = simulate(world, batch, 40)
    settled = settles_near(trajectory, target)
    assert settled is not None and settled <= 5, (target, trajectory[:8], settled)
    times = np.array([world.true_seconds(b) for b in trajectory[settled:]])   # (rebalances, P)
    spread = (times.max(axis=1) - times.min(axis=1)) / times.max(axis=1)
    assert spread.max() < 0.10, (spread.max(), target, trajectory[settled:])
    # the samples/s of a replica with a fixed part fall with its share: proportional to measured
    # samples/s (the previous estimator) is not where this settles when fixed > 0
    proportional = batch / factor / (p - 1 + 1 / factor)
    assert trajectory[-1][-1] < proportional - 2, (trajectory[-1], proportional)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("factor", [1.5, 2])
def test_online_step_times_equalise_when_the_fixed_part_is_large(p, factor):
    """Fixed part as large as an equal share's per-sample part: the slow replica's share is
    then very sensitive to its measured level (a 1 % error moves it by several samples), so
    the shares jitter about the equalising split; their average over the last 20 rebalances
    is within 5 % of it, and the true times are within 10 % of each other from rebalance 5."""
    batch, per_sample = 256, 1e-4
    world = SimulatedReplicas([1.0] * (p - 1) + [factor], per_sample * batch / p, per_sample,
                              seed=p + int(factor * 2))
    target = world.equalising_split(batch)
    trajectory = simulate(world, batch, 40)
    mean = trajectory[20:].mean(axis=0)
    assert np.all(np.abs(mean - target) <= np.maximum(0.05 * target, 1.0)), (mean, target)
    times = np.array([world.true_seconds(b) for b in trajectory[5:]])
    spread = (times.max(axis=1) - times.min(axis=1)) / times.max(axis=1)
    assert spread.max() < 0.10, (spread.max(), target, trajectory[5:])


def test_online_shares_when_no_split_equalises():
    """The README example's regime: the fixed part dominates, the slow replica's one-sample step
    is slower than the others' whole step. The least max is min_share there, reached and kept."""
    for factor in (2, 3):
        world = SimulatedReplicas([1.0, factor], 0.26e-3, 4.2e-6, seed=factor)   # measured, default MLP
        assert world.true_seconds([63, 1])[1] > world.true_seconds([63, 1])[0]
        trajectory = simulate(world, 64, 30)
        settled = settles_near(trajectory, np.array([63, 1]))
        assert settled is not None and settled <= 4, trajectory[:8]


def test_online_shares_follow_a_straggler_appearing_mid_run():
    world = SimulatedReplicas([1.0, 1.0, 1.0], 2e-3, 1e-4, seed=5)
    trajectory = simulate(world, 240, 40, onset=150, factors_after=[1.0, 3.0, 1.0])
    assert np.abs(trajectory[:14] - 80).max() <= 2, trajectory[:14]      # before: equal, +- noise
    after = world.equalising_split(240)
    assert after[1] < 40, after
    settled = settles_near(trajectory[15:], after)
    assert settled is not None and settled <= 4, (after, trajectory[14:22])


# -- emulated slowdown --------------------------------------------------------------------------
def test_slowdown_sleep_pads_and_frees_the_core():
    s = Slowdown(3.0, "sleep")
    assert s.emulated and "emulated" in repr(s)
    cpu, t = time.thread_time(), time.perf_counter()
    extra = s.pad(0.05)                                # (3 - 1) * 0.05 = 0.1 s
    wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
    assert 0.1 <= extra <= 0.5 and abs(wall - extra) < 0.05, (extra, wall)   # loose: shared CPU
    assert cpu < 0.05, cpu


class FakeClock:
    """Stands for the ``time`` module in :mod:`hpcnn.parallel.data.hetero`: ``perf_counter`` advances
    1 ms a reading (so waiting needs readings, i.e. running), ``sleep`` is recorded."""

    def __init__(self):
        self.now, self.readings, self.slept = 0.0, 0, []

    def perf_counter(self):
        self.readings += 1
        self.now += 1e-3
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_slowdown_spin_burns_cpu(monkeypatch):
    """spin waits by running (reading the clock until the time is up, never sleeping), sleep by
    sleeping once: checked on a fake clock, so no timing threshold that load could break."""
    import hpcnn.parallel.data.hetero as hetero
    clock = FakeClock()
    monkeypatch.setattr(hetero, "time", clock)
    extra = Slowdown(2.0, "spin").pad(0.05)
    assert clock.slept == [] and clock.readings >= 50 and 0.05 <= extra <= 0.052, (clock.readings, extra)
    clock.readings = 0
    extra = Slowdown(3.0, "sleep").pad(0.05)
    assert clock.slept == [pytest.approx(0.1)] and clock.readings == 2
    assert extra == pytest.approx(0.101)          # the sleep and one reading's millisecond
    monkeypatch.undo()
    cpu = time.thread_time()                      # the real clock: the busy loop ran on this thread
    Slowdown(2.0, "spin").pad(0.01)
    assert time.thread_time() > cpu


def test_slowdown_noop_and_errors():
    t = time.perf_counter()
    assert Slowdown(1.0).pad(10.0) == 0.0 and Slowdown(2.0).pad(0.0) == 0.0
    assert time.perf_counter() - t < 0.05            # no sleep (a preemption at most)
    for bad in (0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite and >= 1"):
            Slowdown(bad)
    with pytest.raises(ValueError, match="mode='nap'"):
        Slowdown(2.0, "nap")
    with pytest.raises(ValueError, match="got -1"):
        Slowdown(2.0).pad(-1)


# -- config parsers -----------------------------------------------------------------------------
def test_slowdowns_from_config():
    assert slowdowns_from_config("", 3) == [1.0, 1.0, 1.0]
    assert slowdowns_from_config("1:2.0", 2) == [1.0, 2.0]
    assert slowdowns_from_config(" 1:2 , 3:4 ", 4) == [1.0, 2.0, 1.0, 4.0]
    for spec, msg in (("4:2", "rank 4 out of range for 4 ranks"), ("-1:2", "rank -1 out of range"),
                      ("1:0.5", "factor 0.5 for rank 1 must be finite and >= 1"),
                      ("1:nan", "factor nan"), ("1-2", "item '1-2' is not rank:factor"),
                      ("a:2", "item 'a:2'"), ("1:2:3", "item '1:2:3'"), ("1:2,", "item ''"),
                      ("1:2,1:3", "rank 1 given twice")):
        with pytest.raises(ValueError, match=msg):
            slowdowns_from_config(spec, 4)


def test_parse_speeds():
    assert parse_speeds("1,3", 2) == [1.0, 3.0]
    assert parse_speeds(" 2.5 ", 1) == [2.5]
    with pytest.raises(ValueError, match="got 2 values for 3 replicas"):
        parse_speeds("1,3", 3)
    with pytest.raises(ValueError, match="comma-separated numbers"):
        parse_speeds("1,x", 2)
    with pytest.raises(ValueError, match=r"finite and > 0, got \[1\.0, -1\.0\]"):
        parse_speeds("1,-1", 2)


# -- under MPI ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hetero_runs(tmp_path_factory):
    """make test's scenarios, on 2 ranks: one job (one start-up per rank)."""
    return CaseRuns([(2, "hetero_balancer", ()), (2, "train_hetero_balance", (CaseRuns.FOLDER,))],
                    folder=tmp_path_factory.mktemp("hetero"), timeout=300)


@pytest.fixture(scope="module")
def long_hetero_runs(tmp_path_factory):
    """The 4-rank scenarios (make test-long: the balancer at 2 ranks and the shares in a
    training run stay in make test), one job."""
    return CaseRuns([(4, "hetero_balancer", ()), (4, "train_hetero_hybrid", (CaseRuns.FOLDER,))],
                    folder=tmp_path_factory.mktemp("hetero4"), timeout=300)


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long)])
def test_balancer_straggler_mpi(n, request):
    runs = request.getfixturevalue("long_hetero_runs" if n == 4 else "hetero_runs")
    assert f"hetero_balancer OK on {n} ranks" in runs.stdout(n, "hetero_balancer")


@pytest.mark.long
def test_proportional_shares_in_hybrid_layouts_under_mpi(long_hetero_runs):
    out = long_hetero_runs.stdout(4, "train_hetero_hybrid", CaseRuns.FOLDER)
    assert "train_hetero_hybrid OK on 4 ranks" in out


def test_online_balancing_in_training_under_mpi(hetero_runs):
    out = hetero_runs.stdout(2, "train_hetero_balance", CaseRuns.FOLDER)
    assert "train_hetero_balance OK on 2 ranks" in out
