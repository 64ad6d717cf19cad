"""The schedule record (engine.ops) and the one cost entry (engine.price): hand-computed cases
for every stream (compute, messages, offload channel, allreduce) and the memory account, and
the two simulators of the project as uses of it."""
import numpy as np
import pytest

from hpcnn.schedule.ops import Op, fmt
from hpcnn.schedule.price import CostModel, OpCost, price
from hpcnn.memory import rotor
from hpcnn.schedule import sequences as sequence
from hpcnn.memory.profile import ChainProfile
from hpcnn.memory.simulate import RematCost, SequenceError, simulate
from hpcnn.schedule import pipeline as sch


def chain3():
    """Three stages (the last a loss), one second per forward, two per backward; x = 4 bytes,
    x̄ = 10, the loss's x̄ 2, no transients."""
    z = np.zeros(3, dtype=np.int64)
    return ChainProfile(("a", "b", "loss"), np.ones(3), 2 * np.ones(3), np.array([4, 4, 4, 0]),
                        np.array([0, 10, 10, 2]), np.array([4, 4, 4, 0]), z, z.copy())


def test_op_prints_short_and_long_forms():
    assert str(Op("F", mb=0, stage=1)) == "F(mb=0, stage=1)"
    assert str(Op("SEND_ACT", 3, 1, peer=2)) == "SEND_ACT(mb=3, stage=1, peer=2)"
    assert str(Op("B", 0, 1)) == "B(mb=0, stage=1)"          # a whole-stage B
    assert str(Op("B", block=3)) == "B3"                     # rotor's B of block 3
    assert str(Op("F_ck", block=3)) == "F_ck3"
    assert str(Op("OFF", block=2, item="bar")) == "OFF(x̄2)"
    assert str(Op("PRE", block=1, item="x")) == "PRE(x1)"
    assert str(Op("F_ck", mb=1, stage=1, block=3)) == "F_ck3[mb=1, stage=1]"
    assert fmt([Op("F_all", block=0), Op("B", block=0), Op("AR", block=1), Op("AR_WAIT")]) == \
        "F_all0 B0 AR1 AR_WAIT"
    assert Op("F_ck", block=2) == ("F_ck", 0, 0, 2, None, "")


def test_remat_store_all_by_hand():
    # mem starts at x0 = 4; F_all0 +10, F_all1 +10, F_all2 +2 (x̄3), B2: +δ2 4 -x̄3 2, B1: +δ1 4
    # -δ2 4 -x̄2 10, B0: +δ0 4 -δ1 4 -x̄1 10 -x0 4; a B needs δ[i] = 4 on top while it runs
    r = simulate(sequence.store_all(3), chain3())
    assert (r.time, r.compute, r.peak, r.stall, r.offloaded) == (9.0, 9.0, 32.0, 0.0, 0.0)
    assert r.peaks == [14, 24, 26, 30, 32, 22]


@pytest.mark.parametrize("budget, peak, peaks", [
    # no budget: the PRE takes x̄1's 10 bytes before the compute stream retires its finished
    # offload (it is retired at the next compute op): 28 + 10 = 38 during the PRE
    (None, 38.0, [14, 24, 24, 26, 30, 38, 32, 22]),
    # budget 30: the PRE first waits for (here: retires) the offload that ended at t = 4
    (30.0, 32.0, [14, 24, 24, 26, 30, 28, 32, 22])])
def test_remat_offload_by_hand(budget, peak, peaks):
    # OFF(x̄1) at t = 2 takes 10 / 5 = 2 s on the channel (ends at 4); PRE(x̄1) issued at t = 5
    # (after B2) ends at 7, so B1 waits 2 s: B1 7..9, B0 9..11
    seq = [Op("F_all", block=0), Op("F_all", block=1), Op("OFF", block=1, item="bar"),
           Op("F_all", block=2), Op("B", block=2), Op("PRE", block=1, item="bar"),
           Op("B", block=1), Op("B", block=0)]
    r = simulate(seq, chain3(), bandwidth=5.0, budget=budget)
    assert (r.time, r.compute, r.stall, r.offloaded, r.peak) == (11.0, 9.0, 2.0, 10.0, peak)
    assert r.peaks == peaks


def test_remat_simulate_is_price_with_the_remat_model():
    rng = np.random.default_rng(3)
    n = 6
    z = np.zeros(n, dtype=np.int64)
    wx = rng.integers(1, 6, n + 1)
    wx[n] = 0
    p = ChainProfile(tuple(map(str, range(n))), rng.uniform(0.5, 2, n), rng.uniform(1, 3, n),
                     wx, np.r_[0, wx[1:n] + 3, 2], wx.copy(), z, z.copy())
    budget = 0.6 * simulate(sequence.store_all(n), p).peak
    seq = rotor.solve(p, budget, 100).sequence
    r, q = simulate(seq, p), price(seq, RematCost(p))
    assert (r.time, r.peak, r.compute, r.peaks) == (q.makespan, q.peak[0], q.busy[0], q.peaks[0])
    assert r.peak <= budget and sequence.recomputations(seq) > 0


@pytest.mark.parametrize("name, p, M", [("1f1b", 4, 8), ("1f1b", 3, 2), ("zb_h1", 4, 6),
                                        ("zb_h1", 2, 5)])
def test_pipeline_lists_priced_at_the_formula(name, p, M):
    t_f, t_b, t_w = 1.0, 1.5, 0.5
    lists = sch.SCHEDULES[name](p, M, p)
    split = name == "zb_h1"
    zero = [0.0] * p
    run = price(lists, sch.PipelineCost([t_f] * p, [t_b] * p, [t_w] * p, 0.0, split, zero, zero))
    assert run.makespan == pytest.approx(sch.formula_makespan(name, p, M, t_f, t_b, t_w))
    assert run.busy == [M * (t_f + t_b + t_w)] * p


def test_send_recv_latency():
    # rank 0: F 0..1 (message lands at 1.5), F 1..2 (lands at 2.5); rank 1 waits for each
    lists = [[Op("F", 0, 0), Op("SEND_ACT", 0, 0, peer=1), Op("F", 1, 0),
              Op("SEND_ACT", 1, 0, peer=1)],
             [Op("RECV_ACT", 0, 0, peer=0), Op("F", 0, 1), Op("RECV_ACT", 1, 0, peer=0),
              Op("F", 1, 1)]]
    zero = [0.0, 0.0]
    run = price(lists, sch.PipelineCost([1.0, 1.0], zero, zero, 0.5, False, zero, zero))
    assert run.end == [2.0, 3.5] and run.wait == [0.0, 1.5]
    assert [(s, e) for _, s, e in run.timelines[1]] == [(1.5, 2.5), (2.5, 3.5)]


class BucketCost(CostModel):
    """One data-parallel rank: F_all 1 s, B 2 s, bucket b's allreduce ``ar[b]`` seconds."""

    def __init__(self, ar):
        self.ar = ar

    def cost(self, op, rank):
        if op.kind == "AR":
            return OpCost(self.ar[op.block], size=1e6)
        return OpCost({"F_all": 1.0, "B": 2.0, "AR_WAIT": 0.0}[op.kind])


def test_allreduce_overlaps_the_backward():
    # F_all0 0..1, F_all1 1..2, B1 2..4, AR0 on the comm stream 4..7 while B0 runs 4..6,
    # AR1 queued behind AR0: 7..8; AR_WAIT holds the compute stream until 8 (serial: 6 + 4 = 10)
    seq = [Op("F_all", block=0), Op("F_all", block=1), Op("B", block=1), Op("AR", block=0),
           Op("B", block=0), Op("AR", block=1), Op("AR_WAIT")]
    run = price(seq, BucketCost([3.0, 1.0]))
    assert (run.makespan, run.busy[0], run.wait[0]) == (8.0, 6.0, 2.0)
    run = price(seq[:-1], BucketCost([3.0, 1.0]))         # no wait: the step ends with B0
    assert run.makespan == 6.0


def test_pipeline_peak_bytes_equal_bytes_times_in_flight():
    for name, S, M in (("1f1b", 4, 8), ("gpipe", 3, 5), ("interleaved", 4, 4)):
        lists = sch.SCHEDULES[name](S, M, 2 if name == "interleaved" else S)
        sim = sch.simulate(lists, 1.0, 2.0, act_bytes=3.0)
        assert sim.peak_bytes == [3.0 * k for k in sim.peak_inflight], name
    assert sch.simulate(lists, 1.0, 2.0).peak_bytes is None


def test_pipeline_peak_bytes_by_hand_with_split_backward():
    # ZB-H1, 2 stages, 2 micro-batches; a micro-batch holds 10 bytes from F to B, 4 from B to W.
    # stage 0 runs F0 F1 B0 W0 B1 W1: 10, 20, 14, 10, 4, 0 -> peak 20
    # stage 1 runs F0 B0 F1 B1 W0 W1: 10, 4, 14, 8, 4, 0 -> peak 14
    lists = sch.zb_h1(2, 2, 2)
    assert [[i.kind for i in lst if i.kind in "FBW"] for lst in lists] == \
        [list("FFBWBW"), list("FBFBWW")]
    sim = sch.simulate(lists, 1.0, 1.0, 1.0, act_bytes=10.0, w_bytes=4.0)
    assert sim.peak_bytes == [20.0, 14.0] and sim.peak_held == [2, 2]


def test_invalid_ops_are_named_with_their_position():
    with pytest.raises(SequenceError, match=r"^op 1 \(B0\): the backward front is at stage 2"):
        simulate([Op("F_all", block=0), Op("B", block=0)], chain3())
    one = [1.0, 1.0]
    lists = [[Op("F", 0, 0), Op("SEND_ACT", 0, 0, peer=1)],
             [Op("RECV_ACT", 0, 0, peer=0), Op("F_ck", block=0)]]
    with pytest.raises(ValueError, match=r"^rank 1, op 1 \(F_ck0\): unknown op 'F_ck'"):
        price(lists, sch.PipelineCost(one, one, one, 0.0, False, one, one))
    with pytest.raises(ValueError, match="deadlock, no matching SEND"):
        price([[Op("F", 0, 0)], [Op("RECV_ACT", 0, 0, peer=0)]],
              sch.PipelineCost(one, one, one, 0.0, False, one, one))
