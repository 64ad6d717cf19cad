"""Heterogeneous data parallelism, load-balancing side: shares, speed meter, balancer, emulation.

Serial tests here; the multi-rank balancer (a straggler appearing mid-run) runs under mpiexec.
"""
import math
import time

import numpy as np
import pytest

from hpcnn.parallel.hetero import (Balancer, Slowdown, SpeedMeter, equal_shares, parse_speeds,
                                   proportional_shares, slowdowns_from_config)
from mpi_util import run_mpi


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


# -- speed meter --------------------------------------------------------------------------------
def test_speed_meter_window():
    m = SpeedMeter(3)
    with pytest.raises(ValueError, match="no step recorded"):
        m.speed()
    m.record(10, 1.0)
    assert not m.ready and m.speed() == 10.0
    m.record(20, 1.0)
    m.record(30, 4.0)
    assert m.ready and m.speed() == 60 / 6.0
    m.record(40, 1.0)                                  # the first step leaves the window
    assert len(m) == 3 and m.speed() == 90 / 6.0
    m.record(5, 0.0)
    assert m.speed() == 75 / 5.0
    for bad in ((-1, 1.0), (1, -1.0), (1, math.nan)):
        with pytest.raises(ValueError, match="finite and >= 0"):
            m.record(*bad)
    with pytest.raises(ValueError, match="window"):
        SpeedMeter(0)
    z = SpeedMeter(1)
    z.record(1, 0.0)
    assert z.speed() == math.inf


# -- balancer (serial, with a stand-in communicator) --------------------------------------------
class FakeComm:
    """P ranks seen from ``rank``: allgather returns the other ranks' preset speeds."""

    def __init__(self, size, rank=0, others=None):
        self.size, self.rank, self.others, self.calls = size, rank, others, 0

    def allgather_scalars(self, values):
        if self.others is None:
            raise AssertionError("this policy must not communicate")
        self.calls += 1
        out = np.array(self.others, dtype=float).reshape(self.size, 1)
        out[self.rank, 0] = values[0]
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


def test_balancer_online_ema():
    c = FakeComm(2, rank=0, others=[0.0, 100.0])
    b = Balancer(c, 100, "proportional", rebalance_every=2, smoothing=0.5)
    np.testing.assert_array_equal(b.shares, [50, 50])
    assert np.isnan(b.history[0][2]).all()
    assert not b.step(0, 50, 0.5)                      # rank 0 at 100 samples/s
    assert b.step(1, 50, 0.5) and c.calls == 1         # first measurement replaces the guess
    np.testing.assert_array_equal(b.speeds, [100, 100])
    c.others = [0.0, 300.0]
    b.step(2, 50, 0.5)
    assert b.step(3, 50, 0.5)                          # EMA: 0.5*100 + 0.5*300 = 200 for rank 1
    np.testing.assert_array_equal(b.speeds, [100, 200])
    np.testing.assert_array_equal(b.shares, [33, 67])
    assert [h[0] for h in b.history] == [0, 2, 4] and b.offsets.tolist() == [0, 33]
    c.others = [0.0, 100.0]
    b.step(4, 33, 0.0)
    assert not b.step(5, 33, 0.0)                      # rank 0 measured no time: shares kept
    np.testing.assert_array_equal(b.shares, [33, 67])


def test_balancer_errors():
    c = FakeComm(3)
    with pytest.raises(ValueError, match="policy='fast'"):
        Balancer(c, 10, "fast")
    with pytest.raises(ValueError, match=r"got 2 values \[1\.0, 2\.0\] for 3 replicas"):
        Balancer(c, 10, "proportional", speeds=[1, 2])
    with pytest.raises(ValueError, match="with policy 'equal'"):
        Balancer(c, 10, "equal", speeds=[1, 2, 3])
    with pytest.raises(ValueError, match="smoothing=1"):
        Balancer(c, 10, smoothing=1)
    with pytest.raises(ValueError, match="rebalance_every=0"):
        Balancer(c, 10, rebalance_every=0)
    with pytest.raises(ValueError, match=r"batch \(5\) < replicas x min_share \(3\*2\)"):
        Balancer(c, 5, min_share=2)


# -- emulated slowdown --------------------------------------------------------------------------
def test_slowdown_sleep_pads_and_frees_the_core():
    s = Slowdown(3.0, "sleep")
    assert s.emulated and "emulated" in repr(s)
    cpu, t = time.thread_time(), time.perf_counter()
    extra = s.pad(0.05)                                # (3 - 1) * 0.05 = 0.1 s
    wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
    assert 0.1 <= extra <= 0.5 and abs(wall - extra) < 0.05, (extra, wall)   # loose: shared CPU
    assert cpu < 0.05, cpu


def test_slowdown_spin_burns_cpu():
    cpu = time.thread_time()
    extra = Slowdown(2.0, "spin").pad(0.05)
    assert 0.05 <= extra <= 0.5, extra
    assert time.thread_time() - cpu > 0.01


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
@pytest.mark.parametrize("n", [2, 4])
def test_balancer_straggler_mpi(n):
    assert f"hetero_balancer OK on {n} ranks" in run_mpi("hetero_balancer", n, timeout=60)


def test_proportional_shares_in_hybrid_layouts_under_mpi(tmp_path):
    from mpi_util import run_mpi
    out = run_mpi("train_hetero_hybrid", 4, str(tmp_path), timeout=300)
    assert "train_hetero_hybrid OK on 4 ranks" in out
