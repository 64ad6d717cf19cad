"""Pipeline schedules as data: validity on a grid of sizes, textbook orders, simulated makespans,
in-flight memory, and a validator that rejects broken schedules with the right message."""
import pytest

from hpcnn.parallel import schedules as sch
from hpcnn.parallel.schedules import Instr

RANKS, MICRO = (1, 2, 3, 4), (1, 2, 3, 4, 8)


def _grid():
    for name in sch.SCHEDULES:
        for p in RANKS:
            for v in ((1, 2) if name in ("gpipe", "interleaved") else (1,)):
                for m in MICRO:
                    yield name, p * v, m, p


@pytest.mark.parametrize("name,S,M,P", list(_grid()))
def test_every_schedule_validates(name, S, M, P):
    if name == "interleaved" and S > P and M % P:
        with pytest.raises(ValueError, match=rf"n_micro \({M}\).*multiple of n_ranks \({P}\)"):
            sch.interleaved_1f1b(S, M, P)
        return
    lists = sch.SCHEDULES[name](S, M, P)
    sch.validate(lists, S, M, P)
    ops = [i.op for lst in lists for i in lst]
    assert ops.count("F") == ops.count("B") == S * M
    assert ops.count("W") == (S * M if name == "zb_h1" else 0)
    if P == 1:                                  # consecutive stages on one rank: no messages
        assert set(ops) <= {"F", "B", "W"}


def test_one_stage_per_rank_required():
    with pytest.raises(ValueError, match=r"n_stages \(4\) != n_ranks \(2\)"):
        sch.one_f_one_b(4, 4, 2)
    with pytest.raises(ValueError, match=r"n_stages \(4\) != n_ranks \(2\)"):
        sch.zb_h1(4, 4, 2)
    with pytest.raises(ValueError, match=r"n_stages \(3\) is not a multiple of n_ranks \(2\)"):
        sch.gpipe(3, 4, 2)
    with pytest.raises(ValueError, match="n_micro must be a positive integer"):
        sch.gpipe(2, 0, 2)


def _compute(lst):
    return [(i.op, i.mb) for i in lst if i.op in sch.COMPUTE]


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
    assert lists[1][:3] == [Instr("RECV_ACT", 0, 0, 0), Instr("F", 0, 1),
                            Instr("SEND_ACT", 0, 1, 2)]
    assert lists[2][:4] == [Instr("RECV_ACT", 0, 1, 1), Instr("F", 0, 2), Instr("B", 0, 2),
                            Instr("SEND_GRAD", 0, 2, 1)]
    assert lists[0][-2:] == [Instr("RECV_GRAD", 1, 1, 1), Instr("B", 1, 0)]
    assert str(Instr("SEND_ACT", 3, 1, 2)) == "SEND_ACT(mb=3, stage=1, peer=2)"


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
    if M >= S:
        # W's bounded so that activations held from F until W never exceed 1F1B's S - s: at unit
        # costs 3M + 2(S-1), between 1F1B's 3(M + S - 1) and Qi et al.'s 3M + S - 1 (which
        # keeps one more micro-batch's W-side memory)
        assert sch.simulate(sch.zb_h1(S, M, S), 1, 1, 1).makespan == 3 * M + 2 * (S - 1)


@pytest.mark.parametrize("S", [2, 3, 4])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_zb_h1_memory_from_f_to_w_is_bounded_like_1f1b(S, M):
    for s, instrs in enumerate(sch.zb_h1(S, M, S)):
        live = peak = 0
        for ins in instrs:
            live += {"F": 1, "W": -1}.get(ins.op, 0)
            peak = max(peak, live)
        assert peak <= min(S - s, M), (s, peak)


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


def test_per_stage_costs_and_comm():
    sim = sch.simulate(sch.gpipe(2, 3, 2), t_f=[1, 2], t_b=[2, 4], t_comm=0.5)
    # stage 1 is the bottleneck: F's start after F(0) + comm, B's of stage 0 trail by comm
    assert sim.makespan == 1 + 0.5 + 3 * 2 + 3 * 4 + 0.5 + 2
    assert [(i.op, i.mb, a, b) for i, a, b in sim.timelines[1]][:2] == [("F", 0, 1.5, 3.5),
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
    k = lists[1].index(Instr("F", 2, 1))
    del lists[1][k]
    _bad(r"rank 1, position \d+, F\(mb=2, stage=1\): missing", lists)
    lists = _good()
    lists[0].append(Instr("B", 3, 0))
    _bad(r"rank 0, position \d+, B\(mb=3, stage=0\): duplicate", lists)
    lists = _good()
    lists[1].insert(0, Instr("W", 0, 1))        # one W means every (stage, mb) needs one
    _bad(r"W\(mb=0, stage=0\): missing", lists)


def test_rejects_swapped_dependency():
    lists = _good()                              # last stage: F(0) B(0) -> B(0) F(0)
    k = lists[2].index(Instr("F", 0, 2))
    lists[2][k], lists[2][k + 1] = lists[2][k + 1], lists[2][k]
    _bad(rf"rank 2, position {k}, B\(mb=0, stage=2\): runs before F\(mb=0, stage=2\)", lists)
    zb = sch.zb_h1(2, 2, 2)
    k = zb[1].index(Instr("W", 0, 1))
    zb[1].insert(0, zb[1].pop(k))
    _bad(r"rank 1, position 0, W\(mb=0, stage=1\): runs before B\(mb=0, stage=1\)", zb, 2, 2, 2)


def test_rejects_wrong_peer_and_placement():
    lists = _good()
    k = lists[1].index(Instr("SEND_ACT", 0, 1, 2))
    lists[1][k] = Instr("SEND_ACT", 0, 1, 0)
    _bad(rf"rank 1, position {k}, SEND_ACT\(mb=0, stage=1, peer=0\): peer is 0, expected rank 2",
         lists)
    lists = _good()
    lists[0].append(Instr("F", 0, 1))
    _bad(r"rank 0, position \d+, F\(mb=0, stage=1\): stage 1 lives on rank 1, not 0", lists)
    _bad("2 instruction lists for 3 ranks", _good()[:2])


def test_rejects_deadlock_and_unmatched():
    lists = _good()                              # a RECV whose SEND was dropped
    del lists[0][lists[0].index(Instr("SEND_ACT", 1, 0, 1))]
    _bad(r"rank 1, position \d+, RECV_ACT\(mb=1, stage=0, peer=0\): deadlock, no matching SEND "
         r"in the schedule", lists)
    lists = [list(lst) for lst in sch.one_f_one_b(2, 1, 2)]   # rank 0 waits for the grad first
    assert lists[0][1:3] == [Instr("SEND_ACT", 0, 0, 1), Instr("RECV_GRAD", 0, 1, 1)]
    lists[0][1], lists[0][2] = lists[0][2], lists[0][1]
    _bad(r"rank 0, position 1, RECV_GRAD.*deadlock, its SEND is at rank 1, position 3, which is "
         r"never reached \(also blocked: rank 1 at position 0, RECV_ACT", lists, 2, 1, 2)
    lists = _good()
    lists[0].append(Instr("SEND_ACT", 3, 0, 1))
    _bad(r"rank 0, position \d+, SEND_ACT\(mb=3, stage=0, peer=1\): SEND with no matching RECV",
         lists)
