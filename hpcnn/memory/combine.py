"""Rematerialization combined with offloading under a budget and a channel bandwidth (a heuristic).

Beaumont, Eyraud-Dubois, Shilova (NeurIPS 2021) solve this with a dynamic program over both
resources. This module uses a documented heuristic over the exact solver instead:

1. candidates: the optimal remat-only sequences (:class:`.rotor.Solver`) for budgets M' from the
   given budget M up to the store-all peak (``candidates`` of them, evenly spaced);
2. each candidate is made to fit M by offloading stored values during their idle gaps: a value
   (checkpoint x[j] or x̄[j]) is idle between two ops that use it; OFF goes right after the first,
   PRE early enough before the second that the copy back is hidden by the compute in between
   (``size / bandwidth`` seconds, by the profile's times). Gaps are taken largest bytes x seconds
   first (with the PRE just before the use when the hidden one costs more memory), each kept only
   if it lowers the memory above M summed over the ops, until the peak fits;
3. the answer is the fastest candidate whose two-resource simulation (:func:`.simulate.simulate`
   with the bandwidth and the budget) fits M, the remat-only optimum at M among them: never slower
   than rematerialization alone, by construction.
"""
from __future__ import annotations

import numpy

from hpcnn.schedule.ops import Op
from hpcnn.memory.rotor import InfeasibleBudget, Solution, Solver
from hpcnn.memory.simulate import simulate


def _uses(seq):
    """Per stored value (item, j): [creation position, use positions...] in ``seq``."""
    events, alive = {}, {}
    for pos, op in enumerate(seq):
        k, i = op.kind, op.block
        if k in ("F_ck", "F_n", "F_all"):
            for key in (("x", i), ("bar", i)):
                if key in alive:
                    events[alive[key]].append(pos)
            new = ("bar", i + 1) if k == "F_all" else ("x", i + 1)
            alive[new] = (new, pos)
            events[alive[new]] = [pos]
            if k == "F_n":
                alive.pop(("x", i), None)
        elif k == "B":
            for key in (("bar", i + 1), ("x", i), ("bar", i)):
                if key in alive:
                    events[alive[key]].append(pos)
            alive.pop(("bar", i + 1), None)
            alive.pop(("x", i), None)
    return events


def _op_times(seq, prof) -> list:
    """Seconds of each (compute) op of ``seq``."""
    return [prof.ub[op.block] if op.kind == "B" else prof.uf[op.block] for op in seq]


def _gaps(seq, prof, times):
    """(score, item, j, after position, before position, size) for each idle gap of each value;
    ``times``: :func:`_op_times` of ``seq``."""
    cum = numpy.concatenate([[0.0], numpy.cumsum(times)])
    out = []
    for ((item, j), _), pos in _uses(seq).items():
        size = float(prof.wx[j] if item == "x" else prof.wbar[j])
        if size <= 0:
            continue
        for a, b in zip(pos[:-1], pos[1:]):
            if b - a >= 2:
                idle = cum[b] - cum[a + 1]
                out.append((size * idle, item, j, a, b, size))
    out.sort(key=lambda g: -g[0])
    return out


def insert(seq, times, gaps, bandwidth):
    """``seq`` with OFF after each gap's start and PRE ahead of its end: early enough to hide the
    copy (by the ops' ``times``), or (a gap whose size is negative, see :func:`fit`) just before
    the use."""
    after, before = {}, {}
    for _, item, j, a, b, size in gaps:
        lead, p = (abs(size) / bandwidth if size > 0 else 0.0), b
        while p > a + 1 and lead > 0:
            p -= 1
            lead -= times[p]
        after.setdefault(a, []).append(Op("OFF", block=j, item=item))
        before.setdefault(p, []).append(Op("PRE", block=j, item=item))
    out = []
    for pos, op in enumerate(seq):
        out += before.get(pos, [])
        out.append(op)
        out += after.get(pos, [])
    return out


def _excess(sim, budget):
    return sum(max(0.0, p - budget) for p in sim.peaks)


def fit(seq, prof, budget, bandwidth, max_gaps: int = 64):
    """Offload gaps of ``seq`` until its simulated peak fits ``budget``; (sequence, sim) or None.

    A gap is kept when it lowers the memory above the budget summed over the ops (a single value
    rarely lowers the peak alone when several ops share it)."""
    best = simulate(seq, prof, bandwidth=bandwidth, budget=budget)
    if best.peak <= budget:
        return seq, best
    chosen, excess, times = [], _excess(best, budget), _op_times(seq, prof)
    for g in _gaps(seq, prof, times)[:max_gaps]:
        for gap in (g, g[:-1] + (-g[-1],)):          # PRE hidden, else PRE just before the use
            trial = insert(seq, times, chosen + [gap], bandwidth)
            r = simulate(trial, prof, bandwidth=bandwidth, budget=budget)
            e = _excess(r, budget)
            if e < excess:
                chosen.append(gap)
                best, excess = r, e
                if best.peak <= budget:
                    return trial, best
                break
    return None


def solve(prof, budget: float, bandwidth: float, *, slots: int = 500, candidates: int = 32,
          solver: Solver | None = None) -> Solution:
    """The fastest remat+offload sequence found within ``budget`` bytes for a channel of
    ``bandwidth`` bytes/s (see the module docstring); never slower than remat alone."""
    if not bandwidth > 0:
        raise ValueError(f"offload bandwidth must be > 0 bytes/s, got {bandwidth}")
    solver = solver or Solver(prof, slots)
    found = []
    try:
        base = solver.solve(budget)
        found.append((base.time, base.sequence, base.peak))
    except InfeasibleBudget:
        base = None
    lo = max(budget, solver.least)
    for target in numpy.linspace(lo, solver.top, candidates):
        if base is not None and target <= budget:
            continue
        cand = solver.solve(target).sequence
        got = fit(cand, prof, budget, bandwidth)
        if got is not None:
            seq, sim = got
            found.append((sim.time, seq, sim.peak))
    if not found:
        raise InfeasibleBudget(
            f"memory budget {budget / 2**20:.3f} MiB ({budget:.0f} B) is too small even with "
            f"offloading at {bandwidth / 1e9:.3g} GB/s; remat alone needs "
            f"{solver.least / 2**20:.3f} MiB", budget, None)
    t, seq, peak = min(found, key=lambda f: f[0])
    return Solution(seq, float(t), float(peak), float(budget), solver.slot_bytes,
                    policy="optimal+offload")
