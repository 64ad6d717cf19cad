"""Pipeline schedules as data: per-rank instruction lists, a validator and a cost simulator.

A schedule is a function ``(n_stages, n_micro, n_ranks) -> list[list[Op]]``: one instruction list
per pipeline rank. Stage ``s`` lives on rank ``s % n_ranks``; with ``v = n_stages / n_ranks > 1`` a
rank holds v *virtual* stages (interleaved placement, Narayanan et al. 2021). ZB-V places its 2p
stages in a V instead (:func:`v_shape`); :func:`placement` gives any schedule's stage -> rank map.
No MPI here: the executor runs the lists, :func:`simulate` costs them, the analysis scripts draw
them.

Instructions (:class:`~hpcnn.schedule.ops.Op` records, ``block = -1``: the whole stage): ``F(mb, s)``
and ``B(mb, s)`` (the whole backward, or only its input-gradient half when the schedule splits it,
``W(mb, s)`` then being the weight half); ``SEND_ACT``/``RECV_ACT(mb, s, peer)`` stage s's output
to or from the rank of stage s+1 or s; ``SEND_GRAD``/``RECV_GRAD(mb, s, peer)`` stage s's input
gradient. The ``stage`` of a SEND/RECV is the stage that *produced* the message, so a matched
pair has equal ``(kind, mb, stage)``, the executor's MPI tag. A RECV sits right before the pass
that consumes it, a SEND right after the pass that produced it; between stages on the same rank
there is no message. Sends may be eager (``Isend``): :func:`validate` proves the order cannot
deadlock when only receives block.

Schedules: :func:`gpipe` (Huang et al. 2019), :func:`one_f_one_b` (PipeDream-Flush, Narayanan et al.
2021), :func:`interleaved_1f1b` (Narayanan et al. 2021, Sec. 2.2), :func:`zb_h1` and :func:`zb_v`
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

    >>> from hpcnn.parallel import schedules as sch
    >>> lists = sch.one_f_one_b(4, 8, 4)              # S = 4 stages, M = 8, 4 ranks
    >>> sch.validate(lists, 4, 8, 4)
    >>> round(sch.simulate(lists, t_f=1, t_b=2).bubble, 4)   # (S-1)/(M+S-1) = 3/11
    0.2727
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from hpcnn.schedule.ops import COMM, PIPELINE, Op
from hpcnn.schedule.price import CostModel, OpCost, price, walk

OPS = PIPELINE + COMM                     # the kinds a pipeline list may hold


def _check_sizes(n_stages, n_micro, n_ranks, same=False):
    for name, v in (("n_stages", n_stages), ("n_micro", n_micro), ("n_ranks", n_ranks)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if n_stages % n_ranks:
        raise ValueError(f"n_stages ({n_stages}) is not a multiple of n_ranks ({n_ranks})")
    if same and n_stages != n_ranks:
        raise ValueError(f"this schedule runs one stage per rank: n_stages ({n_stages}) != n_ranks "
                         f"({n_ranks}); use interleaved_1f1b for virtual stages")


def round_robin(n_stages, n_ranks):
    """Stage s on rank s % p: one stage per rank, or interleaved virtual stages (the default)."""
    return [s % n_ranks for s in range(n_stages)]


def v_shape(n_stages, n_ranks):
    """Two stages per rank in a V (ZB-V, Qi et al. 2024, Sec. 6): rank r holds stage r (going
    down) and stage 2p-1-r (coming back up), so the last rank holds the two middle stages p-1
    and p, and rank 0 both the first stage and the last one (the loss)."""
    if n_stages != 2 * n_ranks:
        raise ValueError(f"the V placement (zb_v) puts two stages on each of the {n_ranks} "
                         f"ranks: {n_stages} stages given, {2 * n_ranks} needed (virtual=2)")
    return [s if s < n_ranks else n_stages - 1 - s for s in range(n_stages)]


def placement(name, n_stages, n_ranks):
    """``owner[s]``: the rank of stage s under schedule ``name`` (:func:`v_shape` for zb_v,
    :func:`round_robin` for the others)."""
    return (v_shape if name == "zb_v" else round_robin)(n_stages, n_ranks)


def with_comm(compute, n_stages, n_ranks, owner=None):
    """Insert SEND/RECV around per-rank compute orders ``[[(op, mb, stage), ...], ...]``;
    ``owner[s]`` is the rank of stage s (default :func:`round_robin`)."""
    owner = owner or round_robin(n_stages, n_ranks)
    out = [[] for _ in range(n_ranks)]
    for r, ops in enumerate(compute):
        for op, mb, s in ops:
            up = owner[s - 1] if s > 0 else r                   # ranks of stages s-1 and s+1
            down = owner[s + 1] if s < n_stages - 1 else r
            if op == "F" and up != r:
                out[r].append(Op("RECV_ACT", mb, s - 1, peer=up))
            if op == "B" and down != r:
                out[r].append(Op("RECV_GRAD", mb, s + 1, peer=down))
            out[r].append(Op(op, mb, s))
            if op == "F" and down != r:
                out[r].append(Op("SEND_ACT", mb, s, peer=down))
            if op == "B" and up != r:
                out[r].append(Op("SEND_GRAD", mb, s, peer=up))
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


def _zb_h1_order(s, n_stages, n_micro):
    """ZB-H1 compute order of stage s: [(op, mb, stage), ...] (see :func:`zb_h1`)."""
    warm = min(n_stages - 1 - s, n_micro)
    ops = [("F", mb, s) for mb in range(warm)]                    # warm-up: 1F1B's forwards
    w = 0                                                         # next micro-batch's W
    for k in range(n_micro):                                      # the k-th B
        steady = warm + k < n_micro
        if steady:
            ops.append(("F", warm + k, s))
        ops.append(("B", k, s))
        if k >= s or not steady:          # steady: W trails its B by s F-B rounds; cool-down: BW
            ops.append(("W", w, s))
            w += 1
    return ops + [("W", mb, s) for mb in range(w, n_micro)]      # the W's still pending


def zb_h1(n_stages, n_micro, n_ranks):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 3.1): 1F1B with the
    backward split into B (input gradient, on the critical path) and W (weight gradient, off it).

    Stage s runs 1F1B's warm-up (S-1-s forwards) and its F,B steady state, but the W of each
    micro-batch waits s steady rounds: the first s rounds run F,B only, the later ones F,B,W.
    In the cool-down each B is followed by one pending W, the last s W's close the stage. The
    deferred W's fill what is 1F1B's cool-down bubble, so the last stage, which runs F,B,W
    back to back, sets the pace and stage s ends s+1 W's after its last B.

    Memory (the paper's account, Sec. 3.1): between F and B stage s holds at most S - s
    micro-batches, exactly 1F1B's; it keeps at most s more between their B and their W (the
    inputs and output gradients W needs), so at most S micro-batches anywhere: the peak of
    1F1B's first stage. Makespan, for M >= S and t_w <= t_f, t_b:
    M (t_f + t_b + t_w) + (S - 1)(t_f + t_b - t_w), i.e. 3M + S - 1 at unit costs, against
    3(M + S - 1) for 1F1B; with a longer W, (S - 1) max(t_f, t_b, t_f + t_b - t_w)
    (:func:`formula_makespan`).
    """
    _check_sizes(n_stages, n_micro, n_ranks, same=True)
    compute = [_zb_h1_order(s, n_stages, n_micro) for s in range(n_stages)]
    return with_comm(compute, n_stages, n_ranks)


def _zb_v_order(r, p, n_micro):
    """ZB-V compute order of rank r of p: [(op, mb, stage), ...] (see :func:`zb_v`)."""
    n = max(n_micro, 2 * p - 1)           # the pattern's shape; micro-batches >= M dropped below
    chunk = (r, 2 * p - 1 - r)            # stage of chunk 0 (going down) and of chunk 1 (up)
    count = {}                            # (op, chunk) -> micro-batches issued
    ops = []

    def run(*steps):                      # steps: "F0", "B1", "W0", ...: the next micro-batch
        for step in steps:
            op, c = step[0], int(step[1])
            mb = count.get((op, c), 0)
            count[(op, c)] = mb + 1
            ops.append((op, mb, chunk[c]))

    run(*["F0"] * (2 * (p - r) - 1))      # 1: chunk-0 forwards until chunk 1's first input comes
    for _ in range(r):                    # 2: both chunks' forwards, alternating
        run("F1", "F0")
    for _ in range(p - r):                # 3: chunk 1's first backwards, each with its W
        run("F1", "B1", "W1")
    while count[("F", 1)] < n:            # 4: steady state, both chunks F,B,W
        run(*(["F0"] if count[("F", 0)] < n else []), "B0", "W0", "F1", "B1", "W1")
    for _ in range(r):                    # 5: cool-down, the backwards first ...
        run("B0", "B1")
    for _ in range(p - r):
        run("B0", "W0")
    run(*["W1"] * (n - count[("W", 1)]), *["W0"] * (n - count[("W", 0)]))   # ... the W's last
    return [op for op in ops if op[1] < n_micro]


def zb_v(n_stages, n_micro, n_ranks):
    """ZB-V (Qi et al. 2024, Sec. 6; PyTorch's ScheduleZBVZeroBubble): 2p stages on p ranks in a
    V (:func:`v_shape`), backward split into B and W as in :func:`zb_h1`.

    Rank r runs, on its chunk 0 (stage r) and chunk 1 (stage 2p-1-r): (1) 2(p-r)-1 chunk-0
    forwards, the time micro-batch 0 takes down to the V's tip and back to r; (2) r pairs F1, F0;
    (3) p-r triples F1, B1, W1: the loss gradient climbs back to rank r; (4) the steady state
    F0, B0, W0, F1, B1, W1 until every forward has run; (5) the cool-down: r pairs B0, B1, then
    p-r pairs B0, W0, then the W's left. At t_f = t_b = t_w every rank is busy from the moment
    its first input arrives (time r) to its end: the makespan is 6M + p - 1 chunk costs for
    M >= 2p - 1 (the work of 2M chunk passes, and the p-1 steps the first micro-batch takes to
    reach the last rank). With fewer micro-batches the same pattern (built for 2p-1) runs with
    the missing ones left out, so any M >= 1 works, with a larger bubble.

    Memory: a rank holds at most 2p chunk micro-batches between their F and their W, i.e. p
    whole-stage micro-batches of a p-stage cut, the peak of 1F1B's first stage.
    """
    _check_sizes(n_stages, n_micro, n_ranks)
    owner = v_shape(n_stages, n_ranks)
    compute = [_zb_v_order(r, n_ranks, n_micro) for r in range(n_ranks)]
    return with_comm(compute, n_stages, n_ranks, owner)


def formula_makespan(name, n_ranks, n_micro, t_f, t_b, t_w=0.0, virtual=1):
    """The published closed-form makespan of schedule ``name`` on p = n_ranks ranks, v =
    ``virtual`` stages per rank, M = n_micro, every stage costing t_f, t_b, t_w (a whole backward
    t_b + t_w) and messages free; None where the literature gives none (outside its conditions).

    GPipe, 1F1B (v = 1): (M + p - 1)(t_f + t_b + t_w). Interleaved (M % p == 0): (vM + p - 1)
    (t_f + t_b + t_w). ZB-H1 (M >= p): M (t_f + t_b + t_w) + (p - 1) max(t_f, t_b, t_f + t_b
    - t_w), the published form (p - 1)(t_f + t_b - t_w) where t_w <= t_f, t_b; beyond it (a
    weight half longer than a forward or an input half) the max is our extension, equal to the
    simulated makespan of :func:`zb_h1`'s lists (tests/test_schedules.py checks it on random
    times). ZB-V (M >= 2p - 1, t_f = t_b = t_w): (6M + p - 1) t_f. :func:`simulate` reaches
    each exactly (tests/test_schedules.py).
    """
    p, M, v, whole = n_ranks, n_micro, virtual, t_f + t_b + t_w
    if name in ("gpipe", "1f1b") and v == 1:
        return (M + p - 1) * whole
    if name == "interleaved" and (v == 1 or M % p == 0):
        return (v * M + p - 1) * whole
    if name == "zb_h1" and v == 1 and M >= p:
        return M * whole + (p - 1) * max(t_f, t_b, t_f + t_b - t_w)
    if name == "zb_v" and v == 2 and M >= 2 * p - 1 and t_f == t_b == t_w:
        return (6 * M + p - 1) * t_f
    return None


def formula_messages(name, n_ranks, n_micro, virtual=1):
    """How many message times the makespan of schedule ``name`` grows by when each message
    between ranks takes t_comm (:func:`simulate`'s eager sends and blocking receives), every
    stage costing alike: the message delays on its longest path. None where we have no closed
    form (ZB-V). Ours, each equal to the simulated count on random times
    (tests/test_schedules.py), for t_comm up to half the shortest pass (1F1B and GPipe: up to
    the shortest):

    - GPipe: 2(p - 1), the first forward relayed down and the last backward up.
    - 1F1B (v = 1): 2(p - 1) + 2 floor((M - 1)(p - 1) / p). Its steady state alternates F
      and B on every rank, so a rank's backward waits for its successor's, whose forward
      waited for this rank's: the waits chain across the pipeline, and a micro-batch costs
      2(p - 1) / p messages beyond the fill and the drain.
    - Interleaved (v > 1, M % p == 0): 2(pv - 1). The warm-up's extra forwards (its
      (v - 1) p chunk passes) leave each wait slack, and only the fill and drain cross.
    - ZB-H1: 2(p - 1) + 2 min(max(M - 2, 0), p - 1) where t_w <= t_f, t_b (the published
      makespan's condition); beyond it the deferred W's cover more waits and the simulated
      count is 1/2 to 1 times this one (checked), which is then an upper bound.
    """
    p, M, v = n_ranks, n_micro, virtual
    if name == "gpipe" and v == 1:
        return 2 * (p - 1)
    if name in ("1f1b", "interleaved") and v == 1:
        return 2 * (p - 1) + 2 * ((M - 1) * (p - 1) // p)
    if name == "interleaved" and M % p == 0:
        return 2 * (p * v - 1)
    if name == "zb_h1" and v == 1:
        return 2 * (p - 1) + 2 * min(max(M - 2, 0), p - 1)
    return None


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb_h1": zb_h1,
             "zb_v": zb_v}


# -- validation -----------------------------------------------------------------------------------
def _needs(ins, n_stages, owner):
    """What must have run on the same rank before ``ins``: a list of (op, mb, stage)."""
    op, mb, s = ins.kind, ins.mb, ins.stage
    need = {"B": [("F", mb, s)], "W": [("B", mb, s)], "SEND_ACT": [("F", mb, s)],
            "SEND_GRAD": [("B", mb, s)]}.get(op, [])
    if op == "F" and s > 0:                  # the previous stage's F, or its message
        need = [("F" if owner[s - 1] == owner[s] else "RECV_ACT", mb, s - 1)]
    if op == "B" and s < n_stages - 1:
        need.append(("B" if owner[s + 1] == owner[s] else "RECV_GRAD", mb, s + 1))
    return need


def _check_instr(ins, r, n_stages, n_micro, owner):
    """Static checks of one instruction on rank r (``owner[s]``: rank of stage s): returns an
    error string or None."""
    if ins.kind not in OPS:
        return f"unknown op {ins.kind!r} (one of {', '.join(OPS)})"
    if not (0 <= ins.stage < n_stages and 0 <= ins.mb < n_micro):
        return f"stage must be in [0, {n_stages}) and mb in [0, {n_micro})"
    s = ins.stage
    if ins.kind in PIPELINE:
        return None if owner[s] == r else f"stage {s} lives on rank {owner[s]}, not {r}"
    to = s + 1 if ins.kind.endswith("ACT") else s - 1          # stage the message goes to
    if not 0 <= to < n_stages:
        return f"stage {s} has no stage {to} to exchange with"
    me, other = (owner[s], owner[to]) if ins.kind.startswith("SEND") else (owner[to], owner[s])
    if me != r:
        return f"belongs on rank {me}, not {r}"
    if me == other:
        return f"stages {s} and {to} share rank {r}: no message"
    if ins.peer != other:
        return f"peer is {ins.peer}, expected rank {other}"
    return None


def validate(schedule_lists, n_stages, n_micro, n_ranks, owner=None):
    """Check a schedule; raise ValueError naming the rank, position and instruction of the first
    violation. ``owner[s]``: the rank stage s must live on (default :func:`round_robin`; zb_v:
    :func:`placement`). Checks: ops, ranges, placement and peers; completeness (one F and one B per
    (stage, mb), and one W if any W appears); dependency order (F after the previous stage's F or
    its RECV_ACT, B after F and after the next stage's B or its RECV_GRAD, W after B, SEND after
    the compute it sends); deadlock freedom with eager sends and blocking receives; every SEND
    received."""
    _check_sizes(n_stages, n_micro, n_ranks)
    if len(schedule_lists) != n_ranks:
        raise ValueError(f"{len(schedule_lists)} instruction lists for {n_ranks} ranks")
    owner = list(owner or round_robin(n_stages, n_ranks))
    if len(owner) != n_stages or any(not 0 <= q < n_ranks for q in owner):
        raise ValueError(f"placement {owner}: expected one rank in [0, {n_ranks}) per stage "
                         f"({n_stages} stages)")
    seen = {}                                               # (op, mb, stage) -> position
    for r, lst in enumerate(schedule_lists):
        for k, ins in enumerate(lst):
            err = _check_instr(ins, r, n_stages, n_micro, owner)
            key = (ins.kind, ins.mb, ins.stage)
            if err is None and ins.kind in PIPELINE and key in seen:
                err = f"duplicate (first at position {seen[key]})"
            if err:
                raise ValueError(f"rank {r}, position {k}, {ins}: {err}")
            seen[key] = k
    ops = ("F", "B", "W") if any(op == "W" for op, _, _ in seen) else ("F", "B")
    for s, mb, op in itertools.product(range(n_stages), range(n_micro), ops):
        if (op, mb, s) not in seen:
            r = owner[s]
            raise ValueError(f"rank {r}, position {len(schedule_lists[r])}, {Op(op, mb, s)}: "
                             f"missing (incomplete schedule)")
    for r, k, ins, done in walk(schedule_lists):       # dependencies, deadlock, unmatched
        for need in _needs(ins, n_stages, owner):
            if need not in done:
                raise ValueError(f"rank {r}, position {k}, {ins}: runs before "
                                 f"{Op(*need)} (dependency order)")


# -- cost simulation ------------------------------------------------------------------------------
@dataclass
class Simulation:
    """Predicted run of a schedule. ``timelines[r]``: (instr, start, end) of rank r's compute
    instructions; ``busy[r]``: its compute time; ``bubble`` = 1 - sum(busy) / (n_ranks makespan);
    ``peak_inflight[r]`` / ``peak_inflight_stage[s]``: most micro-batches whose activations are
    alive (F done, B not yet) at once on rank r / stage s; ``peak_held[r]`` /
    ``peak_held_stage[s]``: most micro-batches holding any memory (F done, W not yet: a split B
    keeps what W needs; without W's, the same as in flight); ``peak_bytes[r]``: rank r's largest
    activation memory when :func:`simulate` is given the bytes a micro-batch holds, else None."""

    timelines: list
    makespan: float
    busy: list
    bubble: float
    peak_inflight: list
    peak_inflight_stage: list
    peak_held: list
    peak_held_stage: list
    peak_bytes: list | None = None


def _per_stage(t, n_stages, name):
    if isinstance(t, (int, float)):
        return [float(t)] * n_stages
    t = [float(x) for x in t]
    if len(t) != n_stages:
        raise ValueError(f"{name} has {len(t)} entries for {n_stages} stages")
    return t


def _peaks(schedule_lists, n_stages, release):
    """Most micro-batches between their F and their ``release`` op, per rank and per stage."""
    peak_r, peak_s, live_s = [0] * len(schedule_lists), [0] * n_stages, [0] * n_stages
    for r, lst in enumerate(schedule_lists):
        live = 0
        for ins in lst:
            d = 1 if ins.kind == "F" else -1 if ins.kind == release else 0
            live, live_s[ins.stage] = live + d, live_s[ins.stage] + d
            peak_r[r], peak_s[ins.stage] = max(peak_r[r], live), max(peak_s[ins.stage],
                                                                     live_s[ins.stage])
    return peak_r, peak_s


class PipelineCost(CostModel):
    """The pipeline's cost model for :func:`~hpcnn.schedule.price.price`: per stage s, F costs
    ``t_f[s]``, B ``t_b[s]`` (``t_b[s] + t_w[s]`` when the schedule does not split the backward),
    W ``t_w[s]``; a message takes ``t_comm``. Memory: a micro-batch holds ``act[s]`` bytes on stage
    s from its F to its B and, when split, ``w_held[s]`` from its B to its W."""

    def __init__(self, t_f, t_b, t_w, t_comm, split, act, w_held):
        self.t_comm, self.split = t_comm, split
        self.seconds = {"F": t_f, "B": t_b if split else [b + w for b, w in zip(t_b, t_w)],
                        "W": t_w}
        w_held = w_held if split else [0.0] * len(act)
        self.delta = {"F": act, "B": [h - a for a, h in zip(act, w_held)],
                      "W": [-h for h in w_held]}

    def cost(self, op, rank):
        if op.kind in PIPELINE:
            return OpCost(self.seconds[op.kind][op.stage], delta=self.delta[op.kind][op.stage])
        if op.kind in COMM:
            return OpCost(self.t_comm if op.kind.startswith("SEND") else 0.0)
        raise ValueError(f"unknown op {op.kind!r} (one of {', '.join(OPS)})")


def makespan(schedule_lists, t_f, t_b, t_w, t_comm=0.0) -> float:
    """The makespan :func:`simulate` gives ``schedule_lists`` (validated already) with these
    per-stage times (lists, one per stage) and each message taking ``t_comm`` (0: messages
    free), without its timelines, peaks and checks: the planner prices many stage cuts'
    schedules and needs only this. Each rank runs its list in order; a compute instruction
    takes its stage's time (B the whole backward ``t_b + t_w`` where the lists have no W), a
    SEND stamps its message with the rank's clock plus ``t_comm``, a RECV waits for it; the
    ranks are swept until every list is done."""
    split = any(op.kind == "W" for lst in schedule_lists for op in lst)
    seconds = {"F": t_f, "B": t_b if split else [b + w for b, w in zip(t_b, t_w)], "W": t_w}
    pos, clock, arrival = [0] * len(schedule_lists), [0.0] * len(schedule_lists), {}
    left = sum(len(lst) for lst in schedule_lists)
    while left:
        moved = 0
        for r, lst in enumerate(schedule_lists):
            i, t = pos[r], clock[r]
            while i < len(lst):
                op = lst[i]
                kind = op.kind
                if kind in seconds:
                    t += seconds[kind][op.stage]
                elif kind[0] == "S":                    # SEND_ACT, SEND_GRAD
                    arrival[kind[5:], op.mb, op.stage] = t + t_comm
                else:                                   # RECV_ACT, RECV_GRAD
                    sent = arrival.pop((kind[5:], op.mb, op.stage), None)
                    if sent is None:
                        break
                    t = max(t, sent)
                i += 1
            moved += i - pos[r]
            pos[r], clock[r] = i, t
        if not moved:
            raise ValueError("makespan: the lists deadlock (validate them first)")
        left -= moved
    return max(clock, default=0.0)


def _owner_of(schedule_lists, n_stages):
    """Each stage on the lowest rank that runs a compute instruction of it."""
    owner = round_robin(n_stages, len(schedule_lists))
    for r in reversed(range(len(schedule_lists))):
        for ins in schedule_lists[r]:
            if ins.kind in PIPELINE and 0 <= ins.stage < n_stages:
                owner[ins.stage] = r
    return owner


def simulate(schedule_lists, t_f, t_b, t_w=0.0, t_comm=0.0, n_stages=None, n_micro=None, *,
             act_bytes=None, w_bytes=0.0, validated=False):
    """Cost a schedule: each rank runs its list in order, a compute instruction takes its cost,
    a SEND is instantaneous (eager) and its message arrives ``t_comm`` later, a RECV waits for it
    (:func:`~hpcnn.schedule.price.price` with a :class:`PipelineCost`).

    Parameters: t_f, t_b, t_w: forward, input-gradient and weight-gradient cost, scalars or one per
    stage; a schedule without W runs the whole backward as B, costing ``t_b + t_w`` (so the same
    costs compare 1F1B with ZB-H1 fairly). n_stages, n_micro default to what the lists hold.
    ``act_bytes`` (scalar or per stage): bytes a micro-batch holds on a stage between its F and
    its B; ``w_bytes``: between its B and its W (split schedules). With ``act_bytes`` the result's
    ``peak_bytes[r]`` predicts rank r's peak. Returns a :class:`Simulation`; the schedule is
    validated first (unless ``validated``: lists the caller has validated already), each stage
    placed on the lowest rank that runs a compute instruction of it (any placement: round
    robin, V, ...).
    """
    n_ranks = len(schedule_lists)
    flat = [i for lst in schedule_lists for i in lst]
    n_stages = n_stages or 1 + max(i.stage for i in flat)
    n_micro = n_micro or 1 + max(i.mb for i in flat)
    if not validated:
        validate(schedule_lists, n_stages, n_micro, n_ranks, _owner_of(schedule_lists, n_stages))
    split = any(i.kind == "W" for i in flat)
    per_stage = [_per_stage(t, n_stages, name) for t, name in (
        (t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w"), (act_bytes or 0.0, "act_bytes"),
        (w_bytes, "w_bytes"))]
    run = price(schedule_lists, PipelineCost(*per_stage[:3], t_comm, split, *per_stage[3:]))
    makespan = run.makespan
    bubble = 1.0 - sum(run.busy) / (n_ranks * makespan) if makespan > 0 else 0.0
    in_flight = _peaks(schedule_lists, n_stages, "B")
    held = _peaks(schedule_lists, n_stages, "W" if split else "B")
    return Simulation(run.timelines, makespan, run.busy, bubble, *in_flight, *held,
                      peak_bytes=run.peak if act_bytes is not None else None)
