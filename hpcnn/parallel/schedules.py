"""Pipeline schedules as data: per-rank instruction lists, a validator and a cost simulator.

A schedule is a function ``(n_stages, n_micro, n_ranks) -> list[list[Instr]]``: one instruction list
per pipeline rank. Stage ``s`` lives on rank ``s % n_ranks``; with ``v = n_stages / n_ranks > 1`` a
rank holds v *virtual* stages (interleaved placement, Narayanan et al. 2021). No MPI here: the
executor runs the lists, :func:`simulate` costs them, the analysis scripts draw them.

Instructions (:class:`Instr`)::

    F(mb, s)                 forward of micro-batch mb through stage s
    B(mb, s)                 backward; the whole backward, or only the input-gradient half when the
                             schedule splits it (zero bubble: then W(mb, s) is the weight half)
    SEND_ACT(mb, s, peer)    send stage s's output to ``peer`` (the rank of stage s+1)
    RECV_ACT(mb, s, peer)    receive stage s's output from ``peer`` (the rank of stage s)
    SEND_GRAD(mb, s, peer)   send stage s's input gradient to ``peer`` (the rank of stage s-1)
    RECV_GRAD(mb, s, peer)   receive stage s's input gradient from ``peer`` (the rank of stage s)

The ``stage`` of a SEND/RECV is the stage that *produced* the message, so a matched pair has equal
``(kind, mb, stage)``: the executor can use that triple as the MPI tag. A RECV_ACT sits right before
the F that consumes it, a SEND_ACT right after the F that produced it (B, grads, likewise). Between
stages on the same rank (``n_ranks == 1``) there is no message. Sends may be eager (``Isend``):
:func:`validate` proves the order cannot deadlock when only receives block.

Schedules: :func:`gpipe` (Huang et al. 2019), :func:`one_f_one_b` (PipeDream-Flush, Narayanan et al.
2021), :func:`interleaved_1f1b` (Narayanan et al. 2021, Sec. 2.2), :func:`zb_h1` (Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR 2024).

    >>> from hpcnn.parallel import schedules as sch
    >>> lists = sch.one_f_one_b(4, 8, 4)              # S = 4 stages, M = 8, 4 ranks
    >>> sch.validate(lists, 4, 8, 4)
    >>> round(sch.simulate(lists, t_f=1, t_b=2).bubble, 4)   # (S-1)/(M+S-1) = 3/11
    0.2727
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

COMPUTE = ("F", "B", "W")
COMM = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")
OPS = COMPUTE + COMM


@dataclass(frozen=True)
class Instr:
    """One step of a rank's program: ``op`` on micro-batch ``mb`` of stage ``stage``.

    ``peer`` is the pipeline rank on the other side of a SEND/RECV (None for compute).
    """

    op: str
    mb: int
    stage: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f", peer={self.peer}"
        return f"{self.op}(mb={self.mb}, stage={self.stage}{peer})"


def _check_sizes(n_stages, n_micro, n_ranks, same=False):
    for name, v in (("n_stages", n_stages), ("n_micro", n_micro), ("n_ranks", n_ranks)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if n_stages % n_ranks:
        raise ValueError(f"n_stages ({n_stages}) is not a multiple of n_ranks ({n_ranks})")
    if same and n_stages != n_ranks:
        raise ValueError(f"this schedule runs one stage per rank: n_stages ({n_stages}) != n_ranks "
                         f"({n_ranks}); use interleaved_1f1b for virtual stages")


def with_comm(compute, n_stages, n_ranks):
    """Insert SEND/RECV around per-rank compute orders ``[[(op, mb, stage), ...], ...]``."""
    out = [[] for _ in range(n_ranks)]
    for r, ops in enumerate(compute):
        for op, mb, s in ops:
            up, down = (s - 1) % n_ranks, (s + 1) % n_ranks    # ranks of stages s-1 and s+1
            if op == "F" and s > 0 and up != r:
                out[r].append(Instr("RECV_ACT", mb, s - 1, up))
            if op == "B" and s < n_stages - 1 and down != r:
                out[r].append(Instr("RECV_GRAD", mb, s + 1, down))
            out[r].append(Instr(op, mb, s))
            if op == "F" and s < n_stages - 1 and down != r:
                out[r].append(Instr("SEND_ACT", mb, s, down))
            if op == "B" and s > 0 and up != r:
                out[r].append(Instr("SEND_GRAD", mb, s, up))
    return out


def gpipe(n_stages, n_micro, n_ranks):
    """GPipe (Huang et al. 2019): every forward, then every backward (peak: M activations)."""
    _check_sizes(n_stages, n_micro, n_ranks)
    compute = []
    for r in range(n_ranks):
        mine = range(r, n_stages, n_ranks)
        ops = [("F", mb, s) for s in mine for mb in range(n_micro)]
        ops += [("B", mb, s) for s in reversed(mine) for mb in range(n_micro)]
        compute.append(ops)
    return with_comm(compute, n_stages, n_ranks)


def _one_f_one_b_order(s, n_stages, n_micro):
    """1F1B compute order of stage s: [(op, mb, stage), ...]."""
    warm = min(n_stages - 1 - s, n_micro)
    ops = [("F", mb, s) for mb in range(warm)]                    # warm-up: S-1-s forwards
    for b in range(n_micro - warm):                               # steady 1F1B: F then B
        ops += [("F", warm + b, s), ("B", b, s)]
    ops += [("B", b, s) for b in range(n_micro - warm, n_micro)]  # cool-down: the last B's
    return ops


def one_f_one_b(n_stages, n_micro, n_ranks):
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): stage s runs min(S-1-s, M) warm-up
    forwards, then alternates F and B (steady state), then the remaining B's (cool-down).
    Peak in flight on stage s: min(S - s, M) micro-batches, against M for GPipe."""
    _check_sizes(n_stages, n_micro, n_ranks, same=True)
    compute = [_one_f_one_b_order(s, n_stages, n_micro) for s in range(n_stages)]
    return with_comm(compute, n_stages, n_ranks)


def interleaved_1f1b(n_stages, n_micro, n_ranks):
    """Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2): v = n_stages / n_ranks stages per rank.

    Rank r holds stages r, r + p, ..., (p = n_ranks). Micro-batches go through the rank's chunks in
    groups of p (Megatron-LM's order), so with v > 1 it needs ``n_micro % n_ranks == 0``; other M
    raise ValueError. With v == 1 it is :func:`one_f_one_b` (any M). The pipeline bubble shrinks by
    a factor v: (p-1)/(v M) of the ideal time.
    """
    _check_sizes(n_stages, n_micro, n_ranks)
    p, v = n_ranks, n_stages // n_ranks
    if v == 1:
        return one_f_one_b(n_stages, n_micro, n_ranks)
    if n_micro % p:
        raise ValueError(f"interleaved 1F1B with {v} stages per rank needs n_micro ({n_micro}) "
                         f"to be a multiple of n_ranks ({p})")
    total = n_micro * v

    def unit(k, forward, r):                         # k-th forward (backward) unit of rank r
        chunk = (k % (p * v)) // p
        chunk = chunk if forward else v - 1 - chunk
        return ("F" if forward else "B", (k // (p * v)) * p + k % p, chunk * p + r)

    compute = []
    for r in range(p):
        warm = total if n_micro == p else min(total, 2 * (p - r - 1) + (v - 1) * p)
        ops = [unit(k, True, r) for k in range(warm)]                     # warm-up
        for k in range(total - warm):                                     # steady 1F1B
            ops += [unit(warm + k, True, r), unit(k, False, r)]
        ops += [unit(k, False, r) for k in range(total - warm, total)]    # cool-down
        compute.append(ops)
    return with_comm(compute, n_stages, n_ranks)


def zb_h1(n_stages, n_micro, n_ranks):
    """ZB-H1 (Qi et al., ICLR 2024, Sec. 3.1): 1F1B with B split into B (input gradient, on the
    critical path) and W (weight gradient, off it); W's wait and fill the bubbles. Memory is
    bounded like 1F1B's: at most S - s micro-batches on stage s between their F and their W (a
    pending W keeps its inputs and output gradients alive, so W's cannot all wait for the
    cool-down, or memory would grow with M as in GPipe).

    The order is list scheduling at the paper's unit costs (t_f = t_b = t_w): whenever a stage is
    free it runs, by priority, the next B if its gradient has arrived, else the next F if its input
    has arrived and fewer than S - s micro-batches are between F and W, else the oldest pending
    W. For M >= S this gives a makespan of 3M + 2(S - 1), against 3(M + S - 1) for 1F1B; the
    paper's 3M + S - 1 holds one more micro-batch's W-side memory on each stage.
    """
    _check_sizes(n_stages, n_micro, n_ranks, same=True)
    S, M = n_stages, n_micro
    end = {}                                          # (op, mb, stage) -> unit-time end
    nf, nb, pending, free = [0] * S, [0] * S, [deque() for _ in range(S)], [0] * S
    compute, t = [[] for _ in range(S)], 0
    ready = lambda key: end.get(key, t + 1) <= t      # noqa: E731
    while any(nb[s] < M or pending[s] for s in range(S)):
        for s in range(S):
            f, b = nf[s], nb[s]
            if free[s] > t:
                continue
            if b < f and (s == S - 1 or ready(("B", b, s + 1))):
                op = ("B", b, s)
                nb[s] += 1
                pending[s].append(b)
            elif f < M and f - (b - len(pending[s])) < S - s and (s == 0 or ready(("F", f, s - 1))):
                op = ("F", f, s)
                nf[s] += 1
            elif pending[s]:
                op = ("W", pending[s].popleft(), s)
            else:
                continue
            compute[s].append(op)
            end[op] = free[s] = t + 1
        t += 1
    return with_comm(compute, n_stages, n_ranks)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb_h1": zb_h1}


# -- validation -----------------------------------------------------------------------------------
def _needs(ins, n_stages, n_ranks):
    """What must have run on the same rank before ``ins``: a list of (op, mb, stage)."""
    op, mb, s, local = ins.op, ins.mb, ins.stage, n_ranks == 1   # local: neighbours share rank
    need = {"B": [("F", mb, s)], "W": [("B", mb, s)], "SEND_ACT": [("F", mb, s)],
            "SEND_GRAD": [("B", mb, s)]}.get(op, [])
    if op == "F" and s > 0:
        need = [("F" if local else "RECV_ACT", mb, s - 1)]
    if op == "B" and s < n_stages - 1:
        need.append(("B" if local else "RECV_GRAD", mb, s + 1))
    return need


def _check_instr(ins, r, n_stages, n_micro, n_ranks):
    """Static checks of one instruction on rank r: returns an error string or None."""
    owner = lambda t: t % n_ranks  # noqa: E731
    if ins.op not in OPS:
        return f"unknown op {ins.op!r} (one of {', '.join(OPS)})"
    if not (0 <= ins.stage < n_stages and 0 <= ins.mb < n_micro):
        return f"stage must be in [0, {n_stages}) and mb in [0, {n_micro})"
    s = ins.stage
    if ins.op in COMPUTE:
        return None if owner(s) == r else f"stage {s} lives on rank {owner(s)}, not {r}"
    to = s + 1 if ins.op.endswith("ACT") else s - 1          # stage the message goes to
    if not 0 <= to < n_stages:
        return f"stage {s} has no stage {to} to exchange with"
    me, other = (owner(s), owner(to)) if ins.op.startswith("SEND") else (owner(to), owner(s))
    if me != r:
        return f"belongs on rank {me}, not {r}"
    if me == other:
        return f"stages {s} and {to} share rank {r}: no message"
    if ins.peer != other:
        return f"peer is {ins.peer}, expected rank {other}"
    return None


def validate(schedule_lists, n_stages, n_micro, n_ranks):
    """Check a schedule; raise ValueError naming the rank, position and instruction of the first
    violation. Checks: ops, ranges, placement and peers; completeness (one F and one B per
    (stage, mb), and one W if any W appears); dependency order (F after the previous stage's F or
    its RECV_ACT, B after F and after the next stage's B or its RECV_GRAD, W after B, SEND after
    the compute it sends); deadlock freedom with eager sends and blocking receives; every SEND
    received."""
    _check_sizes(n_stages, n_micro, n_ranks)
    if len(schedule_lists) != n_ranks:
        raise ValueError(f"{len(schedule_lists)} instruction lists for {n_ranks} ranks")
    seen = {}                                               # (op, mb, stage) -> position
    for r, lst in enumerate(schedule_lists):
        for k, ins in enumerate(lst):
            err = _check_instr(ins, r, n_stages, n_micro, n_ranks)
            key = (ins.op, ins.mb, ins.stage)
            if err is None and ins.op in COMPUTE and key in seen:
                err = f"duplicate (first at position {seen[key]})"
            if err:
                raise ValueError(f"rank {r}, position {k}, {ins}: {err}")
            seen[key] = k
    ops = ("F", "B", "W") if any(op == "W" for op, _, _ in seen) else ("F", "B")
    for s, mb, op in itertools.product(range(n_stages), range(n_micro), ops):
        if (op, mb, s) not in seen:
            r = s % n_ranks
            raise ValueError(f"rank {r}, position {len(schedule_lists[r])}, {Instr(op, mb, s)}: "
                             f"missing (incomplete schedule)")
    for r, k, ins, done in _execute(schedule_lists):       # dependencies, deadlock, unmatched
        for need in _needs(ins, n_stages, n_ranks):
            if need not in done:
                raise ValueError(f"rank {r}, position {k}, {ins}: runs before "
                                 f"{Instr(*need)} (dependency order)")


def _deadlock(schedule_lists, pc):
    """Message for a stuck state: blame a RECV whose SEND exists nowhere, else the first blocked
    rank, naming the rank where its SEND waits (a cycle of receives)."""
    later = {}                                 # (kind, mb, stage) -> (rank, position) not yet run
    for q, lst in enumerate(schedule_lists):
        for j in range(pc[q], len(lst)):
            if lst[j].op.startswith("SEND"):
                later.setdefault((lst[j].op[5:], lst[j].mb, lst[j].stage), (q, j))
    blocked = [(r, pc[r], schedule_lists[r][pc[r]]) for r in range(len(pc))
               if pc[r] < len(schedule_lists[r])]
    for r, k, ins in blocked:
        if (ins.op[5:], ins.mb, ins.stage) not in later:
            return f"rank {r}, position {k}, {ins}: deadlock, no matching SEND in the schedule"
    r, k, ins = blocked[0]
    q, j = later[(ins.op[5:], ins.mb, ins.stage)]
    others = "; ".join(f"rank {q2} at position {j2}, {i2}" for q2, j2, i2 in blocked[1:])
    return (f"rank {r}, position {k}, {ins}: deadlock, its SEND is at rank {q}, position {j}, "
            f"which is never reached (also blocked: {others})")


def _execute(schedule_lists):
    """Run the lists with eager sends and blocking receives; yield (rank, position, instr, done)
    before each instruction executes (``done``: set of (op, mb, stage) already run on the rank).
    Raises ValueError on deadlock and on a SEND nobody receives."""
    n = len(schedule_lists)
    pc, done = [0] * n, [set() for _ in range(n)]
    posted = {}                                             # (kind, mb, stage) -> deque of (r, k)
    while True:
        progress = False
        for r, lst in enumerate(schedule_lists):
            while pc[r] < len(lst):
                ins, k = lst[pc[r]], pc[r]
                key = (ins.op[5:], ins.mb, ins.stage)
                if ins.op.startswith("RECV"):
                    if not posted.get(key):
                        break
                    posted[key].popleft()
                yield r, k, ins, done[r]
                if ins.op.startswith("SEND"):
                    posted.setdefault(key, deque()).append((r, k))
                done[r].add((ins.op, ins.mb, ins.stage))
                pc[r] += 1
                progress = True
        if all(pc[r] == len(l) for r, l in enumerate(schedule_lists)):
            break
        if not progress:
            raise ValueError(_deadlock(schedule_lists, pc))
    for key, q in posted.items():
        if q:
            r, k = q[0]
            raise ValueError(f"rank {r}, position {k}, {schedule_lists[r][k]}: SEND with no "
                             f"matching RECV")


# -- cost simulation ------------------------------------------------------------------------------
@dataclass
class Simulation:
    """Predicted run of a schedule. ``timelines[r]``: (instr, start, end) of rank r's compute
    instructions; ``busy[r]``: its compute time; ``bubble`` = 1 - sum(busy) / (n_ranks makespan);
    ``peak_inflight[r]`` / ``peak_inflight_stage[s]``: most micro-batches whose activations are
    alive (F done, B not yet) at once on rank r / stage s."""

    timelines: list
    makespan: float
    busy: list
    bubble: float
    peak_inflight: list
    peak_inflight_stage: list


def _per_stage(t, n_stages, name):
    if isinstance(t, (int, float)):
        return [float(t)] * n_stages
    t = [float(x) for x in t]
    if len(t) != n_stages:
        raise ValueError(f"{name} has {len(t)} entries for {n_stages} stages")
    return t


def simulate(schedule_lists, t_f, t_b, t_w=0.0, t_comm=0.0, n_stages=None, n_micro=None):
    """Cost a schedule: each rank runs its list in order, a compute instruction takes its cost,
    a SEND is instantaneous (eager) and its message arrives ``t_comm`` later, a RECV waits for it.

    Parameters: t_f, t_b, t_w: forward, input-gradient and weight-gradient cost, scalars or one per
    stage; a schedule without W runs the whole backward as B, costing ``t_b + t_w`` (so the same
    costs compare 1F1B with ZB-H1 fairly). n_stages, n_micro default to what the lists hold.
    Returns a :class:`Simulation`; the schedule is validated first.
    """
    n_ranks = len(schedule_lists)
    flat = [i for lst in schedule_lists for i in lst]
    n_stages = n_stages or 1 + max(i.stage for i in flat)
    n_micro = n_micro or 1 + max(i.mb for i in flat)
    validate(schedule_lists, n_stages, n_micro, n_ranks)
    split = any(i.op == "W" for i in flat)
    t_f, t_b, t_w = (_per_stage(t, n_stages, nm) for t, nm in ((t_f, "t_f"), (t_b, "t_b"),
                                                              (t_w, "t_w")))
    cost = {"F": t_f, "B": t_b if split else [b + w for b, w in zip(t_b, t_w)], "W": t_w}
    clock, arrival = [0.0] * n_ranks, {}
    timelines, busy = [[] for _ in range(n_ranks)], [0.0] * n_ranks
    for r, _, ins, _ in _execute(schedule_lists):
        key = (ins.op[5:], ins.mb, ins.stage)
        if ins.op.startswith("SEND"):
            arrival[key] = clock[r] + t_comm
        elif ins.op.startswith("RECV"):
            clock[r] = max(clock[r], arrival.pop(key))
        else:
            c = cost[ins.op][ins.stage]
            timelines[r].append((ins, clock[r], clock[r] + c))
            clock[r] += c
            busy[r] += c
    makespan = max(clock)
    bubble = 1.0 - sum(busy) / (n_ranks * makespan) if makespan > 0 else 0.0
    peak_r, peak_s, live_s = [0] * n_ranks, [0] * n_stages, [0] * n_stages
    for r, lst in enumerate(schedule_lists):
        live = 0
        for ins in lst:
            d = {"F": 1, "B": -1}.get(ins.op, 0)
            live, live_s[ins.stage] = live + d, live_s[ins.stage] + d
            peak_r[r], peak_s[ins.stage] = max(peak_r[r], live), max(peak_s[ins.stage],
                                                                     live_s[ins.stage])
    return Simulation(timelines, makespan, busy, bubble, peak_r, peak_s)
