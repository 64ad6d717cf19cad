"""Predicted timelines: a planned step as the per-rank events a measured run logs in ``/timeline``.

A predicted run log holds the same table as a measured one (rank, kind, micro-batch, t_start,
t_end; :mod:`hpcnn.log.runlog`), so ``hpcnn report`` draws the two Gantt charts side by side and
``hpcnn report --trace`` exports either. Two planners' predictions are laid out:

- **a GPT layout** (:func:`gpt_events`, :mod:`.hybrid`): the schedule's per-rank instruction lists
  simulated (:func:`hpcnn.schedule.pipeline.simulate`, messages free) with the stage pass times
  that :func:`.hybrid.price` uses (:func:`.hybrid.stage_times`), the tensor-parallel allreduces
  inside the passes. The price's pipeline messages are drawn as the fill and drain's: the
  first micro-batch's activation relayed down the pipeline before the passes, the last
  gradient relayed up after them, and the rest of the price's message seconds (1F1B's steady
  state waits) after those. Then every rank runs ``allreduce``
  (data parallel) and ``optimizer``, after ``held`` where the price has one (one block, as the
  price adds it once per step). Where ranks share cores (``bubble_weight`` w < 1,
  :class:`.machine.Level`) the times are mapped t -> t - (1 - w) x (the first stage's idle time
  before t), so fill and drain shrink to w of their length as priced, the events keeping their
  order. Every rank of dp x tp x pp gets its track, ranked as
  :class:`hpcnn.parallel.collectives.grid.ProcessGrid` ranks them; the ranks of one stage run the same events.
- **an MLP cut plan** (:func:`mlp_events`, :mod:`.cost`): :func:`.cost.strategy_cost`'s terms as
  consecutive supersteps, the same on every rank (BSP: no overlap): ``compute`` for an operator's
  forward and backward, ``optimizer`` for its update, ``allreduce`` for its reductions and
  gradient allreduce, ``alltoall`` for a redistribution between neighbours.

Either way the last event ends at the predicted step time (:func:`makespan`;
tests/test_plan_timeline.py).
"""
from __future__ import annotations

from hpcnn.schedule import pipeline

Event = tuple     # (rank, kind, microbatch, t_start, t_end), as RunLog.log_events takes them


def makespan(events) -> float:
    """The end of the last event (the predicted step time of a timeline starting at 0)."""
    return max((e[4] for e in events), default=0.0)


def gpt_events(model, layout, machine) -> list[Event]:
    """The predicted events of one step of ``layout`` (a :class:`.hybrid.Layout`) of ``model`` on
    ``machine``, every rank of dp x tp x pp (see the module docstring)."""
    from hpcnn.plan import hybrid
    st = hybrid.stage_times(model, layout, machine)
    pp, m_count = layout.pp, layout.microbatches
    v = layout.virtual                             # interleaved: v chunk passes a stage pass
    lists = pipeline.SCHEDULES[layout.schedule](pp * v, m_count, pp)
    sim = pipeline.simulate(lists, st.t_f / v, (st.t_b - st.t_w) / v, st.t_w / v)
    warp = _warp(sim, hybrid._neighbours(layout, machine).bubble_weight if pp > 1 else 1.0)
    # a relayed message, as long as the price's where it waits on the fill and drain's at least
    msg = min(st.msg, st.pp_s / (2 * (pp - 1))) if pp > 1 else 0.0
    fill = (pp - 1) * msg                          # activation of micro-batch 0, relayed down
    per_stage = []
    for s in range(pp):
        evs = [("SEND_ACT", 0, s * msg, (s + 1) * msg)] if s < pp - 1 else []
        evs += [(ins.kind, ins.mb, fill + warp(t0), fill + warp(t1))
                for ins, t0, t1 in sim.timelines[s]]
        end = fill + warp(sim.makespan)            # the last gradient, relayed up
        if s > 0:
            k = pp - 1 - s
            evs.append(("SEND_GRAD", m_count - 1, end + k * msg, end + (k + 1) * msg))
        end += st.pp_s - fill
        if st.held_s > 0:                          # fresh memory of the activations held
            evs.append(("held", -1, end, end + st.held_s))
            end += st.held_s
        if st.dp_s > 0:
            evs.append(("allreduce", -1, end, end + st.dp_s))
        evs.append(("optimizer", -1, end + st.dp_s, end + st.dp_s + st.opt_s))
        per_stage.append(evs)
    n_group = layout.dp * layout.tp                # ranks per stage: tp fastest, then dp
    return [(s * n_group + g, kind, mb, t0, t1) for s, evs in enumerate(per_stage)
            for g in range(n_group) for kind, mb, t0, t1 in evs]


def _warp(sim, weight: float):
    """t -> t - (1 - weight) x the first stage's idle time in [0, t] of the simulated run
    ``sim`` (the identity for weight 1): see :func:`gpt_events`."""
    if weight == 1:
        return lambda t: t
    gaps, last = [], 0.0                           # the first stage's idle intervals
    for _, t0, t1 in sorted(sim.timelines[0], key=lambda e: e[1]):
        if t0 > last:
            gaps.append((last, t0))
        last = max(last, t1)
    gaps.append((last, sim.makespan))

    def warp(t: float) -> float:
        idle = sum(max(0.0, min(t, b) - a) for a, b in gaps)
        return t - (1 - weight) * idle
    return warp


def term_kind(term) -> str:
    """The event kind of a :class:`.cost.Term`: compute, optimizer, allreduce or alltoall."""
    if term.what.endswith("compute"):
        return "compute"
    if term.what.endswith("update"):
        return "optimizer"
    return "alltoall" if term.what.startswith("redistribute") else "allreduce"


def mlp_events(graph, cuts, machine, dtype: str = "float32") -> list[Event]:
    """The predicted events of one step of the cut plan ``cuts`` (one :class:`.cost.Cut` per
    operator of ``graph``) on ``machine``: :func:`.cost.strategy_cost`'s terms back to back,
    the same on each of the machine's ranks; the micro-batch column holds the operator's index
    (-1 for a redistribution)."""
    from hpcnn.plan import cost
    t, steps = 0.0, []
    for term in cost.strategy_cost(graph, cuts, machine, dtype).terms:
        op = int(term.what[2:].split()[0]) if term.what.startswith("op") else -1
        steps.append((term_kind(term), op, t, t + term.seconds))
        t += term.seconds
    return [(r, *step) for r in range(machine.p) for step in steps]


__all__ = ["gpt_events", "makespan", "mlp_events", "term_kind"]
