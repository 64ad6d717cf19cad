"""Optimal rematerialization of a heterogeneous chain under a memory budget (rotor's dynamic program).

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for heterogeneous chains:
how to train deep neural networks with limited memory" (ACM TOMS; arXiv 1911.13214). With the
sizes and ops of :mod:`.simulate`, let Opt[s][t][m] be the least time to run the forwards s..t and
the backwards t..s starting from a stored x[s] (counted outside m) and the gradient δ[t+1] (counted
inside m), with m slots for everything else. It ends holding δ[s], with x[s] freed if it was a
checkpoint. Then, for s < t, the best of

- F_all(s) first:  uf[s] + Opt[s+1][t][m - wbar[s+1]] + ub[s],
  if m >= wd[t+1] + wbar[s+1] + of[s]  and  m >= wd[s+1] + wbar[s+1] + wd[s] + ob[s];
- a checkpoint at j (s < j <= t): F_ck(s), F_n(s+1..j-1), then
  Σ_{k=s}^{j-1} uf[k] + Opt[j][t][m - wx[j]] + Opt[s][j-1][m],
  if m >= wd[t+1] + wx[s+1] + of[s]  and  m >= wd[t+1] + wx[k] + wx[k+1] + of[k] for s < k < j;

and for s = t only F_all(s), B(s) (same two conditions with t = s). The whole chain is
Opt[0][n-1][M - wx[0]] for a budget M that counts the input. Each (s, t) is a vector over m, so
the table costs O(n^3) NumPy operations on vectors of M+1 slots (vectorised, not compiled): L = 64
and 500 slots take about a second. The sequence is rebuilt from the argmin table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from hpcnn.schedule.ops import Op
from hpcnn.memory.profile import ChainProfile
from hpcnn.schedule.sequences import forward_run, revolve, segments, store_all
from hpcnn.memory.simulate import simulate

INF = numpy.inf
ALL, NONE = -1, -2


class InfeasibleBudget(ValueError):
    """No sequence fits the budget; ``minimum`` is the least feasible budget found (bytes)."""

    def __init__(self, msg, budget, minimum):
        super().__init__(msg)
        self.budget, self.minimum = budget, minimum


def _shift(a, w):
    """out[m] = a[m - w] (inf where m < w)."""
    w = int(w)
    if w <= 0:
        return a
    out = numpy.full_like(a, INF)
    if w < len(a):
        out[w:] = a[:len(a) - w]
    return out


def table(p: ChainProfile, M: int):
    """The DP over slot sizes ``p`` (integers) for m = 0..M: (opt, choice) as dicts keyed (s, t)."""
    n = len(p)
    wx, wbar, wd = (numpy.asarray(a, dtype=numpy.int64) for a in (p.wx, p.wbar, p.wd))
    of, ob = numpy.asarray(p.of, dtype=numpy.int64), numpy.asarray(p.ob, dtype=numpy.int64)
    m = numpy.arange(M + 1)
    cum = numpy.concatenate([[0.0], numpy.cumsum(p.uf)])
    opt, choice = {}, {}
    for span in range(n):
        for s in range(n - span):
            t = s + span
            bwd = wd[s + 1] + wbar[s + 1] + wd[s] + ob[s]
            thr = max(wd[t + 1] + wbar[s + 1] + of[s], bwd)
            base = float(p.uf[s] + p.ub[s])
            if s == t:
                best = numpy.where(m >= thr, base, INF)
                arg = numpy.where(m >= thr, ALL, NONE).astype(numpy.int16)
                opt[s, t], choice[s, t] = best, arg
                continue
            best = numpy.where(m >= thr, base + _shift(opt[s + 1, t], wbar[s + 1]), INF)
            arg = numpy.where(numpy.isfinite(best), ALL, NONE).astype(numpy.int16)
            fthr = wd[t + 1] + wx[s + 1] + of[s]
            for j in range(s + 1, t + 1):
                if j > s + 1:
                    k = j - 1
                    fthr = max(fthr, wd[t + 1] + wx[k] + wx[k + 1] + of[k])
                cand = (cum[j] - cum[s]) + _shift(opt[j, t], wx[j]) + opt[s, j - 1]
                cand = numpy.where(m >= fthr, cand, INF)
                better = cand < best
                best = numpy.where(better, cand, best)
                arg[better] = j
            opt[s, t], choice[s, t] = best, arg
    return opt, choice


def rebuild(p: ChainProfile, choice, m: int, s: int = 0, t: int | None = None) -> list[Op]:
    """The op sequence of Opt[s][t][m] from the argmin table."""
    t = len(p) - 1 if t is None else t
    out = []
    stack = [("run", s, t, m)]
    while stack:
        item = stack.pop()
        if item[0] == "op":
            out.append(item[1])
            continue
        _, s, t, m = item
        c = int(choice[s, t][m])
        if c == NONE:
            raise RuntimeError(f"no sequence for stages {s}..{t} with {m} slots")
        if s == t:
            out += [Op("F_all", block=s), Op("B", block=s)]
        elif c == ALL:
            out.append(Op("F_all", block=s))
            stack += [("op", Op("B", block=s)), ("run", s + 1, t, m - int(p.wbar[s + 1]))]
        else:
            out += forward_run(s, c)
            stack += [("run", s, c - 1, m), ("run", c, t, m - int(p.wx[c]))]
    return out


@dataclass
class Solution:
    sequence: list            # of Op
    time: float               # predicted makespan (seconds)
    peak: float               # simulated peak on the exact byte sizes (<= budget)
    budget: float             # bytes
    slot_bytes: float
    policy: str = "optimal"


class Solver:
    """The DP table of a chain, built once; :meth:`solve` answers any budget from it.

    Memory is cut into slots of ``store-all peak / slots`` bytes whatever the budget, so budgets
    share one table and the makespan never increases with the budget; at or above the store-all
    peak the answer is store-all itself. Sizes are rounded up to whole slots, so a returned
    sequence's exact peak is within its budget (at a cost of up to a slot per stored value).
    Near the least budget that rounding can make the table miss a sequence that fits exactly, so
    the answer is the fastest of the table's and of the baselines (√L-style segments, Revolve)
    whose exact peak fits: a set that only grows with the budget, so the time stays monotone.
    """

    def __init__(self, prof: ChainProfile, slots: int = 500):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.prof, self.slots = prof, int(slots)
        self.top = float(prof.store_all_bytes())
        self.slot_bytes = max(self.top / self.slots, 1.0)
        self.p = prof.slots(self.slot_bytes)
        top = int(simulate(store_all(len(prof)), self.p).peak)
        self.opt, self.choice = table(self.p, max(top - int(self.p.wx[0]), 0))
        finite = numpy.flatnonzero(numpy.isfinite(self.opt[0, len(prof) - 1]))
        self.least = float((finite[0] + self.p.wx[0]) * self.slot_bytes) if len(finite) else self.top
        self.baselines = self._baselines()
        self.least = min([self.least] + [peak for _, peak, _ in self.baselines])

    def _baselines(self):
        """(time, exact peak, sequence) of the √L-style segmentations and Revolve schedules:
        rounding to slots can make the DP miss a budget that one of them fits exactly."""
        n = len(self.prof)
        blocks = max(1, n - 1)
        seqs = [segments(n, k) for k in range(1, blocks + 1)]
        seqs += [revolve(n, c) for c in range(1, min(n - 1, 8) + 1)]
        out = []
        for seq in seqs:
            r = simulate(seq, self.prof)
            out.append((float(r.time), float(r.peak), seq))
        return out

    def solve(self, budget: float) -> Solution:
        """The fastest sequence whose peak stays within ``budget`` bytes; raises
        :class:`InfeasibleBudget` (naming the least feasible budget) when nothing fits."""
        if not budget > 0:
            raise ValueError(f"memory budget must be > 0 bytes, got {budget}")
        if budget >= self.top:
            seq = store_all(len(self.prof))
            return Solution(seq, self.prof.store_all_time, self.top, float(budget),
                            self.slot_bytes)
        m = int(numpy.floor(budget / self.slot_bytes + 1e-9)) - int(self.p.wx[0])
        col = self.opt[0, len(self.prof) - 1]
        m = min(m, len(col) - 1)
        found = [(t, peak, seq, "baseline") for t, peak, seq in self.baselines if peak <= budget]
        if m >= 0 and numpy.isfinite(col[m]):
            seq = rebuild(self.p, self.choice, m)
            found.append((float(col[m]), simulate(seq, self.prof).peak, seq, "optimal"))
        if not found:
            raise InfeasibleBudget(
                f"memory budget {budget / 2**20:.3f} MiB ({budget:.0f} B) is below the least "
                f"feasible one for this chain: {self.least / 2**20:.3f} MiB ({self.least:.0f} B), "
                f"to within one slot of {self.slot_bytes:.0f} B", budget, self.least)
        t, peak, seq, how = min(found, key=lambda f: (f[0], f[3] != "optimal"))
        return Solution(seq, t, peak, float(budget), self.slot_bytes,
                        policy="optimal" if how == "optimal" else "optimal (baseline fits better)")


def solve(prof: ChainProfile, budget: float, slots: int = 500) -> Solution:
    """The fastest sequence within ``budget`` bytes: ``Solver(prof, slots).solve(budget)``."""
    return Solver(prof, slots).solve(budget)
