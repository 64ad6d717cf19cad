"""Pipeline schedules as data: validity on a grid of sizes, textbook orders, simulated makespans,
in-flight memory, and a validator that rejects broken schedules with the right message."""
import itertools
import random

import pytest

from hpcnn.schedule.ops import PIPELINE, Op
from hpcnn.schedule import pipeline as sch

RANKS, MICRO = (1, 2, 3, 4), (1, 2, 3, 4, 8)


def _grid():
    for name in sch.SCHEDULES:
        for p in RANKS:
            for v in {"gpipe": (1, 2), "interleaved": (1, 2), "zb_v": (2,)}.get(name, (1,)):
                for m in MICRO:
                    yield name, p * v, m, p


@pytest.mark.parametrize("name,S,M,P", list(_grid()))
def test_every_schedule_validates(name, S, M, P):
    if name == "interleaved" and S > P and M % P:
        with pytest.raises(ValueError, match=rf"n_micro \({M}\).*multiple of n_ranks \({P}\)"):
            sch.interleaved_1f1b(S, M, P)
        return
    lists = sch.SCHEDULES[name](S, M, P)
    sch.validate(lists, S, M, P, sch.placement(name, S, P))
    ops = [i.kind for lst in lists for i in lst]
    assert ops.count("F") == ops.count("B") == S * M
    assert ops.count("W") == (S * M if name in ("zb_h1", "zb_v") else 0)
    if P == 1:                                  # consecutive stages on one rank: no messages
        assert set(ops) <= {"F", "B", "W"}


def test_one_stage_per_rank_required():
    with pytest.raises(ValueError, match=r"n_stages \(4\) != n_ranks \(2\)"):
        sch.one_f_one_b(4, 4, 2)
    with pytest.raises(ValueError, match=r"n_stages \(4\) != n_ranks \(2\)"):
        sch.zb_h1(4, 4, 2)
    with pytest.raises(ValueError, match=r"two stages on each of the 2 ranks: 2 stages given, 4 "
                                         r"needed \(virtual=2\)"):
        sch.zb_v(2, 4, 2)
    with pytest.raises(ValueError, match=r"n_stages \(3\) is not a multiple of n_ranks \(2\)"):
        sch.gpipe(3, 4, 2)
    with pytest.raises(ValueError, match="n_micro must be a positive integer"):
        sch.gpipe(2, 0, 2)


def _compute(lst):
    return [(i.kind, i.mb) for i in lst if i.kind in PIPELINE]


@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("M", MICRO)
def test_1f1b_textbook_order(S, M):
    """Stage s: min(S-1-s, M) warm-up F's, then F,B pairs (steady), then the remaining B's."""
    lists = sch.one_f_one_b(S, M, S)
    for s, lst in enumerate(lists):
        w = min(S - 1 - s, M)
        expect = [("F", mb) for mb in range(w)]
        for k in range(M - w):
            expect += [("F", w + k), ("B", k)]
        expect += [("B", mb) for mb in range(M - w, M)]
        assert _compute(lst) == expect
        first_b = next(k for k, (op, _) in enumerate(_compute(lst)) if op == "B")
        assert first_b == min(S - s, M)          # warm-up forwards + the first steady F


def test_send_recv_placement():
    lists = sch.one_f_one_b(3, 2, 3)
    assert lists[1][:3] == [Op("RECV_ACT", 0, 0, peer=0), Op("F", 0, 1),
                            Op("SEND_ACT", 0, 1, peer=2)]
    assert lists[2][:4] == [Op("RECV_ACT", 0, 1, peer=1), Op("F", 0, 2), Op("B", 0, 2),
                            Op("SEND_GRAD", 0, 2, peer=1)]
    assert lists[0][-2:] == [Op("RECV_GRAD", 1, 1, peer=1), Op("B", 1, 0)]
    assert str(Op("SEND_ACT", 3, 1, peer=2)) == "SEND_ACT(mb=3, stage=1, peer=2)"


@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("M", MICRO)
def test_makespans_unit_costs(S, M):
    for sched in (sch.gpipe, sch.one_f_one_b):
        for t_f, t_b in ((1, 1), (1, 2)):
            sim = sch.simulate(sched(S, M, S), t_f=t_f, t_b=t_b)
            assert sim.makespan == (M + S - 1) * (t_f + t_b)
            assert sim.bubble == pytest.approx((S - 1) / (M + S - 1))
            assert sim.busy == [M * (t_f + t_b)] * S
    # ZB-H1: B + W = the 1F1B backward, strictly shorter whenever there is a bubble
    one = sch.simulate(sch.one_f_one_b(S, M, S), t_f=1, t_b=0.5, t_w=0.5).makespan
    zb = sch.simulate(sch.zb_h1(S, M, S), t_f=1, t_b=0.5, t_w=0.5).makespan
    assert one == 2 * (M + S - 1)
    assert zb < one if S > 1 else zb == one


# -- zero bubble ----------------------------------------------------------------------------------
ZB_COSTS = [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 1, 1), (3, 2, 1), (1, 1, 0.5), (2, 3, 2),
            (1.5, 1, 1)]                                  # (t_f, t_b, t_w), t_w <= t_f, t_b


@pytest.mark.parametrize("S", [2, 3, 4, 5, 6])
def test_zb_h1_makespan_is_the_papers(S):
    """Qi et al. 2024, Sec. 3.1: at t_f = t_b = t_w = 1, 3M + S - 1 (1F1B: 3(M + S - 1)); in
    general a bubble of (S - 1)(t_f + t_b - t_w) per stage when t_w <= t_f, t_b (M >= S)."""
    for M in (S, S + 1, 2 * S, 8, 13):
        lists = sch.zb_h1(S, M, S)
        sim = sch.simulate(lists, 1, 1, 1)
        assert sim.makespan == 3 * M + S - 1, M
        assert sim.bubble == pytest.approx((S - 1) / (3 * M + S - 1))
        assert sch.simulate(sch.one_f_one_b(S, M, S), 1, 2).makespan == 3 * (M + S - 1)
        for f, b, w in ZB_COSTS:
            sim = sch.simulate(lists, f, b, w)
            assert sim.makespan == pytest.approx(M * (f + b + w) + (S - 1) * (f + b - w)), (M, f)
            assert sim.busy == [pytest.approx(M * (f + b + w))] * S


@pytest.mark.parametrize("S", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("M", [1, 2, 4, 6, 16])
def test_zb_h1_memory_is_1f1bs(S, M):
    """Without its W's, ZB-H1 is 1F1B's order (same warm-up, same F-to-B memory per stage,
    S - s); a stage holds at most S micro-batches between F and W, 1F1B's peak (stage 0's)."""
    zb, one = sch.zb_h1(S, M, S), sch.one_f_one_b(S, M, S)
    for a, b in zip(zb, one):
        assert [i for i in a if i.kind != "W"] == b
    sim_zb, sim_one = sch.simulate(zb, 1, 1, 1), sch.simulate(one, 1, 1, 1)
    assert sim_zb.peak_inflight_stage == sim_one.peak_inflight_stage == [min(S - s, M)
                                                                         for s in range(S)]
    assert max(sim_zb.peak_held_stage) == max(sim_one.peak_held_stage) == min(S, M)
    assert sim_one.peak_held_stage == sim_one.peak_inflight_stage     # no W: held until B


def test_v_placement():
    assert sch.v_shape(8, 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert sch.placement("zb_v", 8, 4) == sch.v_shape(8, 4)
    assert sch.placement("interleaved", 8, 4) == sch.round_robin(8, 4) == [0, 1, 2, 3] * 2
    lists = sch.zb_v(6, 5, 3)
    # the V's middle (stages 2 and 3, both on rank 2) exchanges no message; rank 0 starts the V
    # (stage 0) and ends it (stage 5, the loss, fed by rank 1's stage 4)
    assert not [i for i in lists[2] if i.kind.endswith("ACT") and i.stage == 2]
    assert lists[0][:2] == [Op("F", 0, 0), Op("SEND_ACT", 0, 0, peer=1)]
    assert Op("RECV_ACT", 0, 4, peer=1) in lists[0] and Op("SEND_GRAD", 0, 5, peer=1) in lists[0]
    with pytest.raises(ValueError, match=r"rank 0, position \d+, RECV_ACT\(mb=0, stage=4, peer=1\): "
                                         r"belongs on rank 2, not 0"):
        sch.validate(lists, 6, 5, 3)                     # round robin expected: refused


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_zb_v_makespan_and_memory(p):
    """At t_f = t_b = t_w = 1 per chunk pass, every rank is busy from its first input (time r)
    on: makespan 6M + p - 1 for M >= 2p - 1. A rank holds at most 2p chunk micro-batches (p
    whole-stage ones, 1F1B's peak). Against 1F1B and ZB-H1 on p stages of twice the cost."""
    for M in sorted({2 * p - 1, 2 * p, 3 * p + 1, 8}):
        if M < 2 * p - 1:
            continue
        lists = sch.zb_v(2 * p, M, p)
        sim = sch.simulate(lists, 1, 1, 1)
        assert sim.makespan == 6 * M + p - 1, M
        assert sim.busy == [6 * M] * p
        assert sim.bubble == pytest.approx((p - 1) / (6 * M + p - 1))
        assert sim.peak_held == [2 * p] * p
        for r in range(p):                              # busy without a gap after time r
            starts = [(a, b) for _, a, b in sim.timelines[r]]
            assert starts[0][0] == r and all(b == a2 for (_, b), (a2, _) in zip(starts,
                                                                                starts[1:]))
        h1 = sch.simulate(sch.zb_h1(p, M, p), 2, 2, 2)
        one = sch.simulate(sch.one_f_one_b(p, M, p), 2, 4)
        assert one.makespan == 6 * (M + p - 1) and h1.makespan == 6 * M + 2 * (p - 1)
        assert sim.makespan <= h1.makespan <= one.makespan
        assert max(sim.peak_held) == 2 * max(one.peak_inflight)       # half-size chunks


@pytest.mark.parametrize("name", list(sch.SCHEDULES))
def test_formula_makespan_is_simulated(name):
    """Wherever the closed form applies, the simulated makespan equals it; and it applies to
    ZB-H1 and ZB-V in the paper's conditions."""
    applied = 0
    for p, M, v in itertools.product((1, 2, 3, 4, 5), (1, 2, 3, 4, 6, 9), (1, 2)):
        for f, b, w in ZB_COSTS:
            want = sch.formula_makespan(name, p, M, f, b, w, v)
            if want is None:
                continue
            lists = sch.SCHEDULES[name](p * v, M, p)     # without W's, B costs t_b + t_w
            assert sch.simulate(lists, f, b, w).makespan == pytest.approx(want), (p, M, v, f, b)
            applied += 1
    assert applied >= 10
    assert sch.formula_makespan("zb_h1", 4, 3, 1, 1, 1) is None              # M < p
    assert sch.formula_makespan("zb_h1", 4, 8, 1, 1, 2) == 8 * 4 + 3 * 1     # t_w > t_f
    assert sch.formula_makespan("zb_v", 4, 8, 1, 2, 1, 2) is None            # unequal costs
    assert sch.formula_makespan("zb_v", 4, 8, 1, 1, 1, 2) == 51


def _waits(name, p, M, v, f, b, w, c):
    """The simulated makespan's growth when every message takes c, in messages; the fast
    makespan the planner uses grows alike."""
    lists = sch.SCHEDULES[name](p * v, M, p)
    grow = (sch.simulate(lists, f, b, w, c).makespan - sch.simulate(lists, f, b, w).makespan)
    fast = sch.makespan(lists, *[[x] * (p * v) for x in (f, b, w)], c) - sch.makespan(
        lists, *[[x] * (p * v) for x in (f, b, w)])
    assert fast == pytest.approx(grow, rel=1e-9, abs=1e-12)
    return grow / c


def test_formula_messages_counts_the_simulated_waits_on_messages():
    """Every stage alike and each message taking c: the makespan grows by formula_messages x c,
    on random times, p up to 8, M up to 40: GPipe and 1F1B for c up to the shortest pass,
    interleaved (v = 2-4) and ZB-H1 (t_w <= t_f, t_b) for c up to half of it; beyond that
    condition ZB-H1 waits on 1/2 to 1 times its count; ZB-V has none."""
    rng = random.Random(41)
    for name, reach in (("gpipe", 1.0), ("1f1b", 1.0), ("interleaved", 0.5), ("zb_h1", 0.5)):
        for _ in range(25):
            p, v = rng.randint(2, 8), rng.choice((2, 3, 4)) if name == "interleaved" else 1
            M = p * rng.randint(1, 5) if name == "interleaved" else rng.randint(1, 40)
            f, b = rng.uniform(0.5, 2), rng.uniform(0.5, 3)
            w = rng.uniform(0.1, 1.0) * min(f, b) if name == "zb_h1" else 0.0
            c = rng.uniform(0.01, reach) * min(f, b, w or f) / v
            count = sch.formula_messages(name, p, M, v)
            assert _waits(name, p, M, v, f / v, b / v, w, c) == pytest.approx(count), \
                (name, p, M, v, f, b, w, c)
    assert sch.formula_messages("1f1b", 4, 8) == 2 * 3 + 2 * 5          # steady state: 7 x 3/4
    assert sch.formula_messages("interleaved", 4, 8, 2) == 14
    assert sch.formula_messages("zb_v", 4, 8, 2) is None
    for _ in range(25):
        p, M = rng.randint(2, 8), rng.randint(1, 30)
        f, b = rng.uniform(0.5, 2), rng.uniform(0.5, 2)
        w = rng.uniform(1.0, 2.0) * min(f, b)                             # the longer weight half
        ratio = _waits("zb_h1", p, M, 1, f, b, w, 0.05 * min(f, b)) / sch.formula_messages(
            "zb_h1", p, M)
        assert 0.5 - 1e-9 <= ratio <= 1 + 1e-9, (p, M, f, b, w)


def test_zb_h1s_closed_form_holds_with_a_long_weight_half():
    """Where the weight half is longer than a forward or an input half (the published form's
    condition fails), the makespan is M (t_f + t_b + t_w) + (p - 1) max(t_f, t_b, t_f + t_b -
    t_w): equal to the simulation on random times, p up to 16, M from p to 3p + 2."""
    rng = random.Random(40)
    long_w = 0
    for _ in range(400):
        p = rng.choice((1, 2, 3, 4, 5, 8, 16))
        M = rng.randint(p, 3 * p + 2)
        f, b, w = rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.uniform(0.0, 4)
        long_w += w > min(f, b)
        sim = sch.simulate(sch.zb_h1(p, M, p), f, b, w).makespan
        assert sch.formula_makespan("zb_h1", p, M, f, b, w) == pytest.approx(sim, rel=1e-12), \
            (p, M, f, b, w)
    assert long_w > 100


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3])
def test_zb_v_few_micro_batches(p, M):
    """Below 2p - 1 micro-batches the pattern runs with the missing ones left out: valid, all
    work done, never faster than the work allows."""
    sim = sch.simulate(sch.zb_v(2 * p, M, p), 1, 1, 1)
    assert sim.busy == [6 * M] * p and sim.makespan >= 6 * M + p - 1
    assert max(sim.peak_held) <= 2 * p


@pytest.mark.parametrize("P,v,M", [(2, 2, 2), (2, 2, 8), (3, 2, 6), (4, 2, 8), (4, 3, 4),
                                   (1, 2, 3)])
def test_interleaved_makespan(P, v, M):
    """Per virtual stage costs t_f, t_b: (M v + P - 1)(t_f + t_b), bubble shrunk by v."""
    sim = sch.simulate(sch.interleaved_1f1b(P * v, M, P), t_f=0.5, t_b=0.5)
    assert sim.makespan == M * v + P - 1
    assert sim.makespan <= sch.simulate(sch.one_f_one_b(P, M, P), 0.5 * v, 0.5 * v).makespan


@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("M", MICRO)
def test_peak_in_flight(S, M):
    one = sch.simulate(sch.one_f_one_b(S, M, S), 1, 1)
    assert one.peak_inflight_stage == [min(S - s, M) for s in range(S)]
    assert max(one.peak_inflight) <= S
    assert sch.simulate(sch.gpipe(S, M, S), 1, 1).peak_inflight == [M] * S
    assert sch.simulate(sch.zb_h1(S, M, S), 1, 1, 1).peak_inflight == one.peak_inflight
    assert one.peak_held == one.peak_inflight


def test_per_stage_costs_and_comm():
    sim = sch.simulate(sch.gpipe(2, 3, 2), t_f=[1, 2], t_b=[2, 4], t_comm=0.5)
    # stage 1 is the bottleneck: F's start after F(0) + comm, B's of stage 0 trail by comm
    assert sim.makespan == 1 + 0.5 + 3 * 2 + 3 * 4 + 0.5 + 2
    assert [(i.kind, i.mb, a, b) for i, a, b in sim.timelines[1]][:2] == [("F", 0, 1.5, 3.5),
                                                                        ("F", 1, 3.5, 5.5)]
    assert sch.simulate(sch.gpipe(3, 4, 3), 1, 1, t_comm=0.25).makespan == 6 * 2 + 4 * 0.25
    with pytest.raises(ValueError, match="t_f has 3 entries for 2 stages"):
        sch.simulate(sch.gpipe(2, 3, 2), t_f=[1, 1, 1], t_b=1)


# -- the validator rejects broken schedules ---------------------------------------------------
def _good():
    return [list(lst) for lst in sch.one_f_one_b(3, 4, 3)]


def _bad(msg, lists, S=3, M=4, P=3):
    with pytest.raises(ValueError, match=msg):
        sch.validate(lists, S, M, P)


def test_rejects_missing_and_duplicate():
    lists = _good()
    k = lists[1].index(Op("F", 2, 1))
    del lists[1][k]
    _bad(r"rank 1, position \d+, F\(mb=2, stage=1\): missing", lists)
    lists = _good()
    lists[0].append(Op("B", 3, 0))
    _bad(r"rank 0, position \d+, B\(mb=3, stage=0\): duplicate", lists)
    lists = _good()
    lists[1].insert(0, Op("W", 0, 1))        # one W means every (stage, mb) needs one
    _bad(r"W\(mb=0, stage=0\): missing", lists)


def test_rejects_swapped_dependency():
    lists = _good()                              # last stage: F(0) B(0) -> B(0) F(0)
    k = lists[2].index(Op("F", 0, 2))
    lists[2][k], lists[2][k + 1] = lists[2][k + 1], lists[2][k]
    _bad(rf"rank 2, position {k}, B\(mb=0, stage=2\): runs before F\(mb=0, stage=2\)", lists)
    zb = sch.zb_h1(2, 2, 2)
    k = zb[1].index(Op("W", 0, 1))
    zb[1].insert(0, zb[1].pop(k))
    _bad(r"rank 1, position 0, W\(mb=0, stage=1\): runs before B\(mb=0, stage=1\)", zb, 2, 2, 2)


def test_rejects_wrong_peer_and_placement():
    lists = _good()
    k = lists[1].index(Op("SEND_ACT", 0, 1, peer=2))
    lists[1][k] = Op("SEND_ACT", 0, 1, peer=0)
    _bad(rf"rank 1, position {k}, SEND_ACT\(mb=0, stage=1, peer=0\): peer is 0, expected rank 2",
         lists)
    lists = _good()
    lists[0].append(Op("F", 0, 1))
    _bad(r"rank 0, position \d+, F\(mb=0, stage=1\): stage 1 lives on rank 1, not 0", lists)
    _bad("2 instruction lists for 3 ranks", _good()[:2])


def test_rejects_deadlock_and_unmatched():
    lists = _good()                              # a RECV whose SEND was dropped
    del lists[0][lists[0].index(Op("SEND_ACT", 1, 0, peer=1))]
    _bad(r"rank 1, position \d+, RECV_ACT\(mb=1, stage=0, peer=0\): deadlock, no matching SEND "
         r"in the schedule", lists)
    lists = [list(lst) for lst in sch.one_f_one_b(2, 1, 2)]   # rank 0 waits for the grad first
    assert lists[0][1:3] == [Op("SEND_ACT", 0, 0, peer=1), Op("RECV_GRAD", 0, 1, peer=1)]
    lists[0][1], lists[0][2] = lists[0][2], lists[0][1]
    _bad(r"rank 0, position 1, RECV_GRAD.*deadlock, its SEND is at rank 1, position 3, which is "
         r"never reached \(also blocked: rank 1 at position 0, RECV_ACT", lists, 2, 1, 2)
    lists = _good()
    lists[0].append(Op("SEND_ACT", 3, 0, peer=1))
    _bad(r"rank 0, position \d+, SEND_ACT\(mb=3, stage=0, peer=1\): SEND with no matching RECV",
         lists)


@pytest.mark.parametrize("name", list(sch.SCHEDULES))
def test_lean_makespan_equals_the_simulation(name):
    """:func:`makespan` (the planner's, without timelines or peaks) gives the simulation's
    makespan bit for bit on every schedule of the grid, with random per-stage times."""
    import random
    rng = random.Random(7)
    for _, S, M, P in (g for g in _grid() if g[0] == name):
        if name == "interleaved" and S > P and M % P:
            continue
        lists = sch.SCHEDULES[name](S, M, P)
        t_f, t_b, t_w = ([rng.uniform(0.5, 2.0) for _ in range(S)] for _ in range(3))
        assert sch.makespan(lists, t_f, t_b, t_w) == sch.simulate(lists, t_f, t_b, t_w).makespan
    stuck = [[Op("RECV_ACT", 0, 0, peer=1), Op("F", 0, 1)], [Op("RECV_GRAD", 0, 1, peer=0)]]
    with pytest.raises(ValueError, match="deadlock"):
        sch.makespan(stuck, [1.0, 1.0], [1.0, 1.0], [0.0, 0.0])
