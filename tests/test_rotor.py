"""The rotor solver against an exhaustive search, its monotonicity, and the baselines' validity."""
import heapq
import math

import numpy as np
import pytest

from hpcnn.schedule.ops import Op, fmt
from hpcnn.memory import rotor
from hpcnn.schedule import sequences as sequence
from hpcnn.memory.profile import ChainProfile
from hpcnn.memory.simulate import SequenceError, check_peak, simulate


def random_chain(rng, n, transients=True):
    """n stages (the last a loss: no output, no output gradient), integer sizes, random times."""
    wx = rng.integers(1, 6, n + 1)
    wbar = wx + rng.integers(0, 6, n + 1)
    wd = wx.copy()
    wx[n] = wbar[n] = wd[n] = 0
    wbar[n] = rng.integers(1, 4)
    wbar[0] = 0
    z = np.zeros(n, dtype=np.int64)
    of = rng.integers(0, 3, n) if transients else z
    ob = rng.integers(0, 3, n) if transients else z.copy()
    return ChainProfile(tuple(f"s{i}" for i in range(n)), rng.uniform(0.5, 2.0, n),
                        rng.uniform(1.0, 3.0, n), wx, wbar, wd, of, ob)


def byte_chain(rng, n):
    """n stages (the last a loss) with sizes in bytes, from a few hundred to tens of thousands:
    no size is a multiple of a slot, so rounding to slots matters."""
    wx = rng.integers(300, 40_000, n + 1)
    wbar = wx + rng.integers(0, 60_000, n + 1)
    wd = wx.copy()
    wx[n] = wd[n] = 0
    wbar[n] = rng.integers(300, 20_000)
    wbar[0] = 0
    return ChainProfile(tuple(f"s{i}" for i in range(n)), rng.uniform(0.5, 2.0, n),
                        rng.uniform(1.0, 3.0, n), wx, wbar, wd, rng.integers(0, 8_000, n),
                        rng.integers(0, 8_000, n))


def exhaustive(p, M):
    """Least makespan over all valid *persistent* sequences with peak <= M: Dijkstra over the
    states (stored x's A, those of them kept as checkpoints C, stored x̄'s F, backward front d),
    with the op semantics written out again. Persistent (rotor's model): a value kept by F_ck
    stays until its backward; F_n may drop only a value no F_ck kept. (Without that rule a
    sequence can drop a checkpoint early and recompute it, which is sometimes faster: seed 5 here
    finds 21.27 against the persistent optimum 21.84.)"""
    n = len(p)
    start = (frozenset([0]), frozenset(), frozenset(), n)

    def mem(A, F, d):
        return sum(p.wx[i] for i in A) + sum(p.wbar[i] for i in F) + p.wd[d]

    best = {start: 0.0}
    heap = [(0.0, 0, start)]
    tie = 1
    while heap:
        cost, _, st = heapq.heappop(heap)
        if cost > best[st]:
            continue
        A, C, F, d = st
        if d == 0 and not A and not F:
            return cost
        base = mem(A, F, d)
        moves = []
        for i in range(n):
            if (i in A or i in F) and i + 1 not in A and i + 1 not in F:
                if base + p.wx[i + 1] + p.of[i] <= M:
                    moves.append((p.uf[i], A | {i + 1}, C | ({i} & A), F, d))          # F_ck
                    if i not in C:
                        moves.append((p.uf[i], (A | {i + 1}) - {i}, C, F, d))         # F_n
                if base + p.wbar[i + 1] + p.of[i] <= M:
                    moves.append((p.uf[i], A, C, F | {i + 1}, d))                     # F_all
        i = d - 1
        if i >= 0 and i + 1 in F and (i in A or i in F) and base + p.wd[i] + p.ob[i] <= M:
            moves.append((p.ub[i], A - {i}, C - {i}, F - {i + 1}, i))                 # B
        for dt, A2, C2, F2, d2 in moves:
            st2 = (frozenset(A2), frozenset(C2), frozenset(F2), d2)
            if cost + dt < best.get(st2, math.inf) - 1e-12:
                best[st2] = cost + dt
                heapq.heappush(heap, (cost + dt, tie, st2))
                tie += 1
    return math.inf


# the draws whose exhaustive search takes seconds (the longer chains) in make test-long
@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.long) if s in (0, 2, 3, 7)
                                  else s for s in range(12)])
def test_dp_equals_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    p = random_chain(rng, n, transients=seed % 2 == 0)
    top = int(simulate(sequence.store_all(n), p).peak)
    opt, choice = rotor.table(p, top)
    low = int(p.wx[0])
    row = opt[0, n - 1]
    # the search at both ends of every stretch of budgets where the DP's answer is constant: the
    # optimum cannot rise with the budget, so equal at both ends it is equal all along
    ends = {low, top} | {M for M in range(low + 1, top + 1) if row[M - low] != row[M - 1 - low]}
    ends |= {M - 1 for M in ends if M > low}
    for M in range(low, top + 1):
        got = row[M - low]
        if M in ends:
            want = exhaustive(p, M)
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12) or (
                got == want == math.inf), (seed, n, M, got, want)
        if np.isfinite(got):
            seq = rotor.rebuild(p, choice, M - low)
            r = check_peak(seq, p, M)
            assert r.time == pytest.approx(got, rel=1e-12)


def test_makespan_monotone_and_reaches_store_all():
    rng = np.random.default_rng(7)
    p = random_chain(rng, 12)
    p = ChainProfile(p.names, p.uf, p.ub, p.wx * 1000, p.wbar * 1000, p.wd * 1000,
                     p.of * 1000, p.ob * 1000)
    solver = rotor.Solver(p, slots=200)
    top = p.store_all_bytes()
    times, last = [], math.inf
    for budget in np.linspace(solver.least, top * 1.1, 40):
        sol = solver.solve(budget)
        assert sol.peak <= budget
        assert check_peak(sol.sequence, p, budget).time == pytest.approx(sol.time)
        assert sol.time <= last + 1e-12
        last = sol.time
        times.append(sol.time)
    assert times[-1] == pytest.approx(p.store_all_time)
    assert solver.solve(top).sequence == sequence.store_all(len(p))


def test_every_answer_fits_its_budget():
    """Random 8-stage chains x coarse to fine slots x a fine grid of budgets from the least to
    store-all: the simulated peak (exact sizes) of every returned sequence is within its budget.
    Small integer sizes (a slot of one unit from 100 slots on: no rounding slack) make a memory
    index one slot too generous in ``Solver.solve`` fail about half of these; byte sizes check
    the rounding up."""
    rng = np.random.default_rng(2024)
    over, solves = [], 0
    for chain in range(8):
        p = random_chain(rng, 8) if chain < 6 else byte_chain(rng, 8)
        for slots in (20, 45, 100, 220, 500):
            solver = rotor.Solver(p, slots)
            for budget in np.linspace(solver.least, solver.top, 70):
                sol = solver.solve(budget)
                peak = simulate(sol.sequence, p).peak
                solves += 1
                if peak > budget or sol.peak != peak:
                    over.append((chain, slots, float(budget), float(peak), sol.peak))
    assert not over, f"{len(over)} of {solves} solves over their budget, e.g. {over[:3]}"


def test_below_least_budget_names_it():
    rng = np.random.default_rng(3)
    p = random_chain(rng, 8)
    solver = rotor.Solver(p, slots=100)
    with pytest.raises(rotor.InfeasibleBudget, match="below the least feasible") as e:
        solver.solve(solver.least * 0.9)
    assert e.value.minimum == solver.least
    solver.solve(solver.least)                       # the reported least budget is feasible
    with pytest.raises(ValueError, match="> 0 bytes"):
        solver.solve(0)


@pytest.mark.parametrize("n", [2, 5, 9, 16])
def test_baselines_are_valid_and_no_better_than_optimal(n):
    rng = np.random.default_rng(n)
    p = random_chain(rng, n, transients=False)
    top = int(simulate(sequence.store_all(n), p).peak)
    opt, _ = rotor.table(p, top)
    candidates = ([sequence.store_all(n), sequence.segments(n)]
                  + [sequence.revolve(n, c) for c in (1, 2, 3)])
    for seq in candidates:
        r = simulate(seq, p)
        assert r.compute == pytest.approx(r.time)
        m = int(r.peak) - int(p.wx[0])
        assert opt[0, n - 1][m] <= r.time + 1e-12, (fmt(seq), r.peak)
        assert sorted(op.block for op in seq if op.kind == "B") == list(range(n))


def test_segments_and_revolve_shapes():
    assert fmt(sequence.segments(5, 2)) == ("F_ck0 F_n1 F_all2 F_all3 F_all4 B4 B3 B2 "
                                       "F_all0 F_all1 B1 B0")
    # recomputed forwards follow Griewank's binomial recursion; closed forms at both ends:
    # one checkpoint recomputes l(l-1)/2 stages, l-1 checkpoints each stage once
    for steps, c in ((5, 1), (8, 2), (10, 3), (7, 6)):
        recomputed = sequence.recomputations(sequence.revolve(steps, c))
        assert recomputed == sequence._binomial(steps, c)[0]
    assert sequence.recomputations(sequence.revolve(6, 1)) == 15
    assert sequence.recomputations(sequence.revolve(7, 6)) == 6
    assert sequence._binomial(8, 2)[0] < sequence._binomial(8, 1)[0]


def test_invalid_sequences_are_named():
    p = random_chain(np.random.default_rng(0), 3)
    with pytest.raises(SequenceError, match=r"op 0 \(B2\)"):
        simulate([Op("B", block=2)], p)
    with pytest.raises(SequenceError, match="x1 is not stored"):
        simulate([Op("F_all", block=1)], p)
    with pytest.raises(SequenceError, match="still stored"):
        simulate([Op("F_ck", block=0)], p)
    with pytest.raises(SequenceError, match="offloaded"):
        simulate([Op("F_all", block=0), Op("OFF", block=1, item="bar"), Op("F_all", block=1)],
                 p, bandwidth=1.0)


def test_baselines_that_fit_are_never_refused():
    """Slot rounding can put the table's least budget above a baseline's exact peak; the solver
    then answers with the baseline (and never with something slower than a baseline that fits)."""
    for seed in range(6):
        p = random_chain(np.random.default_rng(100 + seed), 9)
        solver = rotor.Solver(p, slots=20)              # coarse slots: rounding matters
        for seq in [sequence.segments(9)] + [sequence.revolve(9, c) for c in (1, 2, 3)]:
            r = simulate(seq, p)
            assert solver.least <= r.peak
            sol = solver.solve(r.peak)
            assert sol.time <= r.time + 1e-12 and sol.peak <= r.peak
