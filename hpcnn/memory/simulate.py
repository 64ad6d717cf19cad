"""Simulate an operation sequence on a chain profile: validity, makespan and peak memory.

The model (the same one :mod:`.rotor` optimises and :mod:`.executor` runs):

- memory holds the stored checkpoints x[i] (set A), the stored x̄[i] (set F) and one gradient
  δ[d]; it starts with x[0] and δ[n] (the loss gradient, 0 bytes, or a stage's output gradient);
- a compute op needs its result bytes plus its transient on top of what is stored: F_ck/F_n(i)
  wx[i+1] + of[i], F_all(i) wbar[i+1] + of[i], B(i) wd[i] + ob[i]; the peak is the largest sum;
- OFF/PRE run on a second resource (the channel, ``bandwidth`` bytes/s, one transfer at a time in
  issue order) concurrently with compute. An offloaded value's memory is released when its copy
  ends; a prefetched value's memory is taken when the PRE is issued, and a compute op that reads
  it waits for the copy to end. With a ``budget``, a compute op (or a PRE) that does not fit waits
  for the in-flight offloads to complete, oldest first, as the executor does.

Sizes may be bytes or slots (any consistent unit); ``bandwidth`` is in that unit per second.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpcnn.memory.sequence import CHANNEL, Op


class SequenceError(ValueError):
    """The sequence is not valid for the chain (names the op and its position)."""


@dataclass
class SimResult:
    time: float                    # makespan of the compute stream (seconds)
    peak: float                    # largest memory in use, input included
    compute: float                 # sum of the compute ops' durations
    stall: float = 0.0             # time compute waited for the channel (prefetch or memory)
    offloaded: float = 0.0         # bytes (or slots) moved out
    peaks: list = field(default_factory=list)   # memory in use at each op (for plots)


def simulate(seq, prof, *, bandwidth: float | None = None, budget: float | None = None) -> SimResult:
    """Run ``seq`` (list of :class:`~.sequence.Op`) on ``prof``; raise SequenceError if invalid."""
    n = len(prof)
    wx, wbar, wd, uf, ub, of, ob = (prof.wx, prof.wbar, prof.wd, prof.uf, prof.ub, prof.of, prof.ob)
    A, F, d = {0}, set(), n
    where = {}                       # (item, i) -> "mem" | "out" | "away" | ("in", ready time)
    where[("x", 0)] = "mem"
    mem = float(wx[0] + wd[n])
    pending = []                     # in-flight offloads: [end time, size, key], FIFO
    tc = tch = compute = stall = moved = 0.0
    peak = mem
    peaks = []

    def fail(pos, op, msg):
        raise SequenceError(f"op {pos} ({op}): {msg}")

    def retire(t):
        nonlocal mem
        while pending and pending[0][0] <= t:
            _, size, key = pending.pop(0)
            mem -= size
            if where.get(key) == "out":
                where[key] = "away"

    def wait_for_room(t, need):
        while budget is not None and mem + need > budget + 1e-9 and pending:
            t = max(t, pending[0][0])
            retire(t)
        return t

    def holder(i):
        return ("x", i) if i in A else ("bar", i) if i in F else None

    def size_of(key):
        return wx[key[1]] if key[0] == "x" else wbar[key[1]]

    def ready(pos, op, key, t):
        state = where.get(key)
        if state in ("out", "away"):
            fail(pos, op, f"{key[0]}{key[1]} is offloaded (PRE it first)")
        if isinstance(state, tuple):
            where[key] = "mem"
            return max(t, state[1])
        return t

    for pos, op in enumerate(seq):
        kind, i = op.kind, op.index
        if kind in CHANNEL:
            key = (op.item, i)
            if op.item not in ("x", "bar"):
                fail(pos, op, f"channel op item must be 'x' or 'bar', got {op.item!r}")
            if bandwidth is None or not bandwidth > 0:
                fail(pos, op, f"channel ops need a bandwidth > 0, got {bandwidth}")
            if kind == "OFF":
                if where.get(key) != "mem" or holder(i) != key:
                    fail(pos, op, f"{op.item}{i} is not stored in memory")
                start = max(tch, tc)
                tch = start + size_of(key) / bandwidth
                pending.append([tch, size_of(key), key])
                where[key] = "out"
                moved += size_of(key)
            else:
                if where.get(key) not in ("out", "away"):
                    fail(pos, op, f"{op.item}{i} was not offloaded")
                size = size_of(key)
                t0 = wait_for_room(tc, size)
                stall += t0 - tc
                tc = t0
                mem += size
                peak = max(peak, mem)
                start = max(tch, tc)
                tch = start + size / bandwidth
                where[key] = ("in", tch)
            peaks.append(mem)
            continue
        if not 0 <= i < n:
            fail(pos, op, f"stage index must be in [0, {n}), got {i}")
        t0 = tc
        retire(t0)
        if kind in ("F_ck", "F_n", "F_all"):
            src = holder(i)
            if src is None:
                fail(pos, op, f"x{i} is not stored")
            t0 = ready(pos, op, src, t0)
            if (i + 1) in A or (i + 1) in F:
                fail(pos, op, f"x{i + 1} is already stored")
            out = wbar[i + 1] if kind == "F_all" else wx[i + 1]
            need, dur = out + of[i], uf[i]
        elif kind == "B":
            if d != i + 1:
                fail(pos, op, f"the backward front is at stage {d - 1}, not {i}")
            if (i + 1) not in F:
                fail(pos, op, f"x̄{i + 1} is not stored (B needs F_all{i} first)")
            src = holder(i)
            if src is None:
                fail(pos, op, f"x{i} is not stored")
            t0 = ready(pos, op, ("bar", i + 1), t0)
            t0 = ready(pos, op, src, t0)
            need, dur = wd[i] + ob[i], ub[i]
        else:
            fail(pos, op, f"unknown op kind {kind!r}")
        t1 = wait_for_room(t0, need)
        stall += t1 - tc
        peak = max(peak, mem + need)
        peaks.append(mem + need)
        tc = t1 + dur
        compute += dur
        if kind == "B":
            mem += wd[i] - wd[i + 1] - wbar[i + 1]
            F.discard(i + 1)
            where.pop(("bar", i + 1), None)
            if i in A:
                A.discard(i)
                where.pop(("x", i), None)
                mem -= wx[i]
            d = i
        else:
            if kind == "F_all":
                F.add(i + 1)
                where[("bar", i + 1)] = "mem"
            else:
                A.add(i + 1)
                where[("x", i + 1)] = "mem"
            mem += out
            if kind == "F_n" and i in A:
                A.discard(i)
                where.pop(("x", i), None)
                mem -= wx[i]
    if d != 0 or A or F:
        raise SequenceError(f"sequence ends with the backward front at {d} (not 0), checkpoints "
                            f"{sorted(A)} and x̄ {sorted(F)} still stored")
    return SimResult(time=tc, peak=peak, compute=compute, stall=stall, offloaded=moved,
                     peaks=peaks)


def check_peak(seq, prof, budget, **kw) -> SimResult:
    """Simulate and raise if the peak exceeds ``budget`` (names both)."""
    r = simulate(seq, prof, budget=budget, **kw)
    if r.peak > budget + 1e-9:
        raise SequenceError(f"simulated peak {r.peak:g} exceeds the budget {budget:g}")
    return r


__all__ = ["Op", "SequenceError", "SimResult", "simulate", "check_peak"]
