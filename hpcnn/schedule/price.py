"""The one cost entry: :func:`price` runs a schedule as a discrete-event simulation.

Any schedule of :class:`~.ops.Op` records, one list per rank (a single list for a remat
sequence), is priced the same way; only the cost model changes. Per rank there are

- a **compute stream**: compute ops (F, B, W, F_ck, F_n, F_all) run one after the other;
- **messages**: a SEND is eager (the sender does not wait), its message arrives the model's
  seconds later; a RECV blocks the compute stream until its message arrived. A SEND and its
  RECV match on ``(kind without SEND_/RECV_, mb, stage)``;
- a **channel stream** for OFF/PRE, one transfer at a time in issue order, concurrent with
  compute. An offloaded value's memory is released when its copy ends; a prefetched value's
  memory is taken when the PRE is issued, and a compute op that reads it (the model says which
  values an op reads) waits for the copy. With a ``budget``, a compute op or a PRE that does not
  fit waits for the in-flight offloads to complete, oldest first;
- a **communication stream** for AR (a bucket's allreduce, overlapping compute); AR_WAIT makes
  the compute stream wait for every launched AR;
- a **memory account**: bytes held now, the op's transient on top during a compute op, the peak.

The cost model answers per op (:meth:`CostModel.cost`) with an :class:`OpCost`: seconds on its
stream (a SEND's: the message's flight time), transient bytes, memory delta after the op, the
size moved, the stored values it reads. It may keep state and raise ValueError on an invalid op:
:func:`price` re-raises it naming the op and its position. The two models of the project are
``schedules.PipelineCost`` (pipeline lists) and ``memory.simulate.RematCost`` (rotor sequences).
:func:`walk` is the order a run with eager sends and blocking receives follows, shared with the
pipeline validator.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from hpcnn.schedule.ops import CHANNEL, COMPUTE, Op

EPS = 1e-9                       # budget slack (sizes are floats)


class OpCost(NamedTuple):
    """What one op costs: ``seconds`` on its stream (compute, channel, allreduce; a SEND's is the
    flight time of its message), ``transient`` bytes needed on top of the held ones during a
    compute op, ``delta`` bytes held after the op minus before, ``size`` bytes moved (channel,
    message, allreduce), ``reads`` the keys ``(item, block, mb, stage)`` of the stored values a
    compute op reads (it waits for their prefetch)."""

    seconds: float = 0.0
    transient: float = 0.0
    delta: float = 0.0
    size: float = 0.0
    reads: tuple = ()


class CostModel:
    """The interface :func:`price` asks. ``start(rank)``: bytes held when the rank begins;
    ``cost(op, rank)``: an :class:`OpCost` (raise ValueError if the op is invalid);
    ``finish(rank)``: raise ValueError if the rank ends in an invalid state."""

    def start(self, rank: int) -> float:
        return 0.0

    def cost(self, op: Op, rank: int) -> OpCost:
        raise NotImplementedError

    def finish(self, rank: int) -> None:
        return None


@dataclass
class Priced:
    """A priced schedule, per rank: ``end`` (compute stream), ``busy`` (compute seconds),
    ``stall`` (compute waiting for the channel: a prefetch or room in the budget), ``wait``
    (compute waiting for a message or an allreduce), ``peak`` bytes, ``peaks[r][k]`` bytes in use
    during op k, ``moved`` bytes through the channel, ``timelines[r]`` (op, start, end) of the
    compute ops. ``makespan``: the latest end."""

    makespan: float
    end: list
    busy: list
    stall: list
    wait: list
    peak: list
    peaks: list
    moved: list
    timelines: list = field(default_factory=list)


class _Rank:
    """One rank's streams and memory account during :func:`price`."""

    def __init__(self, mem):
        self.tc = self.tch = self.tcomm = 0.0        # compute, channel, allreduce streams
        self.busy = self.stall = self.wait = self.moved = 0.0
        self.mem = self.peak = float(mem)
        self.pending = deque()                       # in-flight offloads: (end time, size), FIFO
        self.ready = {}                              # prefetched key -> end of its copy
        self.peaks, self.timeline = [], []

    def retire(self, t):
        """Release the offloads whose copies ended by t."""
        while self.pending and self.pending[0][0] <= t:
            self.mem -= self.pending.popleft()[1]

    def wait_for_room(self, t, need, budget):
        """The time from t at which ``need`` more bytes fit the budget (oldest offloads first)."""
        while budget is not None and self.mem + need > budget + EPS and self.pending:
            t = max(t, self.pending[0][0])
            self.retire(t)
        return t

    def compute(self, op, c, budget):
        t0 = self.tc
        self.retire(t0)
        for key in c.reads:
            t0 = max(t0, self.ready.pop(key, t0))
        t1 = self.wait_for_room(t0, c.transient, budget)
        self.stall += t1 - self.tc
        self.peak = max(self.peak, self.mem + c.transient)
        self.peaks.append(self.mem + c.transient)
        self.tc = t1 + c.seconds
        self.timeline.append((op, t1, self.tc))
        self.busy += c.seconds
        self.mem += c.delta
        self.peak = max(self.peak, self.mem)

    def channel(self, op, c, budget):
        if op.kind == "OFF":
            self.tch = max(self.tch, self.tc) + c.seconds
            self.pending.append((self.tch, c.size))
            self.moved += c.size
        else:                                        # PRE: room first, then the copy
            t0 = self.wait_for_room(self.tc, c.size, budget)
            self.stall += t0 - self.tc
            self.tc = t0
            self.mem += c.size
            self.peak = max(self.peak, self.mem)
            self.tch = max(self.tch, self.tc) + c.seconds
            self.ready[(op.item, op.block, op.mb, op.stage)] = self.tch
        self.peaks.append(self.mem)

    def other(self, op, c, arrival):
        """Messages and allreduces: they move the compute clock only by waiting."""
        t0 = self.tc
        if op.kind.startswith("SEND"):
            arrival[_message(op)] = self.tc + c.seconds
        elif op.kind.startswith("RECV"):
            self.tc = max(self.tc, arrival.pop(_message(op)))
        elif op.kind == "AR":
            self.tcomm = max(self.tcomm, self.tc) + c.seconds
        elif op.kind == "AR_WAIT":
            self.tc = max(self.tc, self.tcomm)
        else:
            raise ValueError(f"unknown op kind {op.kind!r}")
        self.wait += self.tc - t0
        self.mem += c.delta
        self.peak = max(self.peak, self.mem)
        self.peaks.append(self.mem)


def _message(op):
    """The key a SEND and its RECV share: (ACT or GRAD, mb, stage)."""
    return op.kind[5:], op.mb, op.stage


def price(lists, model: CostModel, *, budget: float | None = None) -> Priced:
    """Price ``lists`` (one list of :class:`~.ops.Op` per rank, or a single list) with ``model``.

    Ranks run in an order a run with eager sends and blocking receives could follow
    (:func:`walk`); an invalid op raises the model's error type, prefixed with its position
    (``op k (F_ck3): ...`` for a single list, ``rank r, op k (...)`` for several).
    """
    single = not lists or isinstance(lists[0], Op)
    lists = [lists] if single else lists
    ranks = [_Rank(model.start(r)) for r in range(len(lists))]
    arrival = {}
    for r, k, op, _ in walk(lists):
        try:
            c = model.cost(op, r)
        except ValueError as e:
            where = f"op {k} ({op})" if single else f"rank {r}, op {k} ({op})"
            raise type(e)(f"{where}: {e}") from None
        if op.kind in COMPUTE:
            ranks[r].compute(op, c, budget)
        elif op.kind in CHANNEL:
            ranks[r].channel(op, c, budget)
        else:
            ranks[r].other(op, c, arrival)
    for r in range(len(lists)):
        model.finish(r)
    end = [q.tc for q in ranks]
    return Priced(makespan=max(end, default=0.0), end=end, busy=[q.busy for q in ranks],
                  stall=[q.stall for q in ranks], wait=[q.wait for q in ranks],
                  peak=[q.peak for q in ranks], peaks=[q.peaks for q in ranks],
                  moved=[q.moved for q in ranks], timelines=[q.timeline for q in ranks])


# -- the order of a run with eager sends and blocking receives -------------------------------------
def _deadlock(lists, pc):
    """Message for a stuck state: blame a RECV whose SEND exists nowhere, else the first blocked
    rank, naming the rank where its SEND waits (a cycle of receives)."""
    later = {}                                 # (kind, mb, stage) -> (rank, position) not yet run
    for q, lst in enumerate(lists):
        for j in range(pc[q], len(lst)):
            if lst[j].kind.startswith("SEND"):
                later.setdefault(_message(lst[j]), (q, j))
    blocked = [(r, pc[r], lists[r][pc[r]]) for r in range(len(pc)) if pc[r] < len(lists[r])]
    for r, k, ins in blocked:
        if _message(ins) not in later:
            return f"rank {r}, position {k}, {ins}: deadlock, no matching SEND in the schedule"
    r, k, ins = blocked[0]
    q, j = later[_message(ins)]
    others = "; ".join(f"rank {q2} at position {j2}, {i2}" for q2, j2, i2 in blocked[1:])
    return (f"rank {r}, position {k}, {ins}: deadlock, its SEND is at rank {q}, position {j}, "
            f"which is never reached (also blocked: {others})")


def walk(lists):
    """Run the lists with eager sends and blocking receives; yield (rank, position, op, done)
    before each op executes (``done``: set of (kind, mb, stage) already run on the rank).
    Raises ValueError on deadlock and on a SEND nobody receives."""
    n = len(lists)
    pc, done = [0] * n, [set() for _ in range(n)]
    posted = {}                                             # (kind, mb, stage) -> deque of (r, k)
    while True:
        progress = False
        for r, lst in enumerate(lists):
            while pc[r] < len(lst):
                ins, k = lst[pc[r]], pc[r]
                key = _message(ins)
                if ins.kind.startswith("RECV"):
                    if not posted.get(key):
                        break
                    posted[key].popleft()
                yield r, k, ins, done[r]
                if ins.kind.startswith("SEND"):
                    posted.setdefault(key, deque()).append((r, k))
                done[r].add((ins.kind, ins.mb, ins.stage))
                pc[r] += 1
                progress = True
        if all(pc[r] == len(lst) for r, lst in enumerate(lists)):
            break
        if not progress:
            raise ValueError(_deadlock(lists, pc))
    for q in posted.values():
        if q:
            r, k = q[0]
            raise ValueError(f"rank {r}, position {k}, {lists[r][k]}: SEND with no matching RECV")
