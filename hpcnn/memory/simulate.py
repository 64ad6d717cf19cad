"""Simulate an operation sequence on a chain profile: validity, makespan and peak memory.

The model (the same one :mod:`.rotor` optimises and :mod:`.executor` runs):

- memory holds the stored checkpoints x[i] (set A), the stored x̄[i] (set F) and one gradient
  δ[d]; it starts with x[0] and δ[n] (the loss gradient, 0 bytes, or a stage's output gradient);
- a compute op needs its result bytes plus its transient on top of what is stored: F_ck/F_n(i)
  wx[i+1] + of[i], F_all(i) wbar[i+1] + of[i], B(i) wd[i] + ob[i]; the peak is the largest sum;
  F_all of the last block of a chain without a loss may recompute from a stored output x[n]
  (a pipeline stage's, kept until its gradient comes): x̄[n] replaces it;
- OFF/PRE run on a second resource (the channel, ``bandwidth`` bytes/s, one transfer at a time in
  issue order) concurrently with compute. An offloaded value's memory is released when its copy
  ends; a prefetched value's memory is taken when the PRE is issued, and a compute op that reads
  it waits for the copy to end. With a ``budget``, a compute op (or a PRE) that does not fit waits
  for the in-flight offloads to complete, oldest first, as the executor does.

Sizes may be bytes or slots (any consistent unit); ``bandwidth`` is in that unit per second.
The streams and the memory account are :func:`hpcnn.schedule.price.price`'s; this module owns the
remat cost model (:class:`RematCost`: durations, sizes and the validity of a sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpcnn.schedule.ops import CHANNEL
from hpcnn.schedule.price import CostModel, OpCost, price


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


class RematCost(CostModel):
    """Rotor's cost model for :func:`~hpcnn.schedule.price.price`, with the validity checks of a
    sequence on the chain profile ``prof``: which x[i] (set A) and x̄[i] (set F) are stored, where
    each stored value is (``"mem"``, offloaded ``"off"``, prefetched ``"in"``) and the backward
    front d (the one gradient δ[d] held). One instance prices one sequence."""

    def __init__(self, prof, bandwidth=None):
        self.prof, self.bandwidth, self.n = prof, bandwidth, len(prof)
        self.A, self.F, self.d = {0}, set(), self.n
        self.where = {("x", 0): "mem"}

    def start(self, rank):
        return float(self.prof.wx[0] + self.prof.wd[self.n])

    def finish(self, rank):
        if self.d != 0 or self.A or self.F:
            raise SequenceError(f"sequence ends with the backward front at {self.d} (not 0), "
                                f"checkpoints {sorted(self.A)} and x̄ {sorted(self.F)} still "
                                f"stored")

    def cost(self, op, rank):
        if op.kind in CHANNEL:
            return self._channel(op)
        if not 0 <= op.block < self.n:
            raise SequenceError(f"stage index must be in [0, {self.n}), got {op.block}")
        if op.kind in ("F_ck", "F_n", "F_all"):
            return self._forward(op)
        if op.kind == "B":
            return self._backward(op)
        raise SequenceError(f"unknown op kind {op.kind!r}")

    def _holder(self, i):
        return ("x", i) if i in self.A else ("bar", i) if i in self.F else None

    def _size(self, key):
        return self.prof.wx[key[1]] if key[0] == "x" else self.prof.wbar[key[1]]

    def _read(self, key, op):
        """Check that the stored value ``key`` can be read; its price key (a prefetch to wait)."""
        if self.where.get(key) == "off":
            raise SequenceError(f"{key[0]}{key[1]} is offloaded (PRE it first)")
        self.where[key] = "mem"
        return key + (op.mb, op.stage)

    def _drop(self, key, held):
        held.discard(key[1])
        self.where.pop(key, None)

    def _channel(self, op):
        key, i = (op.item, op.block), op.block
        if op.item not in ("x", "bar"):
            raise SequenceError(f"channel op item must be 'x' or 'bar', got {op.item!r}")
        if self.bandwidth is None or not self.bandwidth > 0:
            raise SequenceError(f"channel ops need a bandwidth > 0, got {self.bandwidth}")
        if op.kind == "OFF":
            if self.where.get(key) != "mem" or self._holder(i) != key:
                raise SequenceError(f"{op.item}{i} is not stored in memory")
            self.where[key] = "off"
        else:
            if self.where.get(key) != "off":
                raise SequenceError(f"{op.item}{i} was not offloaded")
            self.where[key] = "in"
        size = self._size(key)
        return OpCost(size / self.bandwidth, size=size)

    def _forward(self, op):
        p, i = self.prof, op.block
        src = self._holder(i)
        if src is None:
            raise SequenceError(f"x{i} is not stored")
        reads = (self._read(src, op),)
        upgrade = op.kind == "F_all" and (i + 1) in self.A and self.where.get(("x", i + 1)) \
            == "mem" and i + 1 == self.n          # a stage's stored output turned into x̄
        if ((i + 1) in self.A and not upgrade) or (i + 1) in self.F:
            raise SequenceError(f"x{i + 1} is already stored")
        out = p.wbar[i + 1] if op.kind == "F_all" else p.wx[i + 1]
        delta = out
        if upgrade:                               # x̄[n] holds the output x[n]: it replaces it
            self._drop(("x", i + 1), self.A)
            delta -= p.wx[i + 1]
        if op.kind == "F_all":
            self.F.add(i + 1)
            self.where[("bar", i + 1)] = "mem"
        else:
            self.A.add(i + 1)
            self.where[("x", i + 1)] = "mem"
        if op.kind == "F_n" and i in self.A:
            self._drop(("x", i), self.A)
            delta -= p.wx[i]
        return OpCost(p.uf[i], transient=out + p.of[i], delta=delta, reads=reads)

    def _backward(self, op):
        p, i = self.prof, op.block
        if self.d != i + 1:
            raise SequenceError(f"the backward front is at stage {self.d - 1}, not {i}")
        if (i + 1) not in self.F:
            raise SequenceError(f"x̄{i + 1} is not stored (B needs F_all{i} first)")
        src = self._holder(i)
        if src is None:
            raise SequenceError(f"x{i} is not stored")
        reads = (self._read(("bar", i + 1), op), self._read(src, op))
        delta = p.wd[i] - p.wd[i + 1] - p.wbar[i + 1]
        self._drop(("bar", i + 1), self.F)
        if i in self.A:
            self._drop(("x", i), self.A)
            delta -= p.wx[i]
        self.d = i
        return OpCost(p.ub[i], transient=p.wd[i] + p.ob[i], delta=delta, reads=reads)


def simulate(seq, prof, *, bandwidth: float | None = None, budget: float | None = None) -> SimResult:
    """Run ``seq`` (list of :class:`~hpcnn.schedule.ops.Op`) on ``prof``; raise SequenceError if
    invalid: :func:`~hpcnn.schedule.price.price` with a :class:`RematCost`."""
    run = price(list(seq), RematCost(prof, bandwidth), budget=budget)
    return SimResult(time=run.end[0], peak=run.peak[0], compute=run.busy[0], stall=run.stall[0],
                     offloaded=run.moved[0], peaks=run.peaks[0])


def check_peak(seq, prof, budget, **kw) -> SimResult:
    """Simulate and raise if the peak exceeds ``budget`` (names both)."""
    r = simulate(seq, prof, budget=budget, **kw)
    if r.peak > budget + 1e-9:
        raise SequenceError(f"simulated peak {r.peak:g} exceeds the budget {budget:g}")
    return r


__all__ = ["RematCost", "SequenceError", "SimResult", "simulate", "check_peak"]
