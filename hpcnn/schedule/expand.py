"""One rank's training step printed as the single schedule it ran.

``hpcnn train --show_schedule=true`` traces the first step: every instruction of the rank's list
as it ran (:func:`hpcnn.engine.execute.run`), the rematerialization ops its stage's executor ran
inside each F and B (:class:`hpcnn.memory.executor.Executor`), and the gradient buckets' allreduce
launches: ``AR k`` right after the block whose backward completed bucket k (overlap: the
data-parallel hook of the last micro-batch's backward; at ZeRO-2 and 3 every micro-batch's
backward launches its buckets, the last's shown), or after the list when they are reduced
at the end (pipelines, blocking algorithms), then ``AR_WAIT``. A plain stage's B is shown as the
chain's reverse loop, block by block, when buckets launch inside it. Rank 0 prints every rank's
lines and the run log keeps them in ``/plan`` (``step_schedule``)::

    rank 0 (dp 0, tp 0, pp 0)
      F(mb=0, stage=0): F_ck0 F_n1 F_all2
      SEND_ACT(mb=0, stage=0, peer=1)
      ...
      B(mb=3, stage=0): F_all0 F_all1 B2 B1 B0
      AR0 AR1 AR_WAIT
"""
from __future__ import annotations

from hpcnn.schedule.ops import Op, fmt


def _with_launches(ops, after: dict) -> list:
    """``ops`` with ``AR k`` inserted after the B of the block that completed bucket k."""
    out = []
    for op in ops:
        out.append(op)
        if op.kind == "B" and op.block in after:
            out += [Op("AR", block=k) for k in after[op.block]]
    return out


def step_lines(trace, launched, stages) -> list[str]:
    """The lines of one rank's step: ``trace`` the (instruction, inner ops) pairs of
    :func:`~.execute.run`, ``launched`` the engine's (bucket position, block; -1 at the end)
    launches, ``stages`` the rank's stages."""
    n_blocks = {st.index: len(st.chain.blocks) for st in stages}
    after, at_end = {}, []
    for k, i in launched:
        (after.setdefault(i, []) if i >= 0 else at_end).append(k)
    backs = [n for n, (ins, _) in enumerate(trace) if ins.kind == "B"]
    out = []
    for n, (ins, inner) in enumerate(trace):
        ops = list(inner)
        if after and backs and n == backs[-1]:       # the hook ran in the last backward
            if not ops:                              # the chain's reverse loop, block by block
                ops = [Op("B", block=i) for i in reversed(range(n_blocks[ins.stage]))]
            ops = _with_launches(ops, after)
        out.append(f"  {ins}" + (f": {fmt(ops)}" if ops else ""))
    if launched:
        out.append("  " + fmt([Op("AR", block=k) for k in at_end] + [Op("AR_WAIT")]))
    return out


def show(ctx, log, say) -> None:
    """Gather every rank's traced step (``ctx.traced``) to rank 0: print it with ``say`` and
    keep it in the log's plan. Collective over the world."""
    trace, launched = ctx.traced
    head = f"rank {ctx.rank} (dp {ctx.dp.rank}, tp {ctx.tp.rank}, pp {ctx.pp.rank})"
    ranks = ctx.world.gather_objects([head] + step_lines(trace, launched, ctx.stages), root=0)
    ctx.traced = None
    if ranks is None:
        return
    say("hpcnn: the first step as each rank ran it\n" + "\n".join("\n".join(r) for r in ranks))
    if log is not None:
        log.set_plan({"step_schedule": ranks})
