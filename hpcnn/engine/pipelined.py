"""Pipeline parallelism: a chain cut into stages, one rank's instruction list run per step.

The chain is cut into stages (:mod:`.partition`); stage ``s`` lives on pipeline rank ``s % p``
(one stage per rank, or v *virtual* stages for interleaved 1F1B), or for ZB-V on the rank the V
gives (:func:`.schedules.placement`: rank r holds stages r and 2p-1-r, so rank 0 has the loss).
Each rank executes its own list of the schedule (:mod:`.schedules`) with the step engine's
executor (:func:`hpcnn.engine.execute.run`: F, B, W on its :class:`hpcnn.engine.stage.Stage` s,
SEND/RECV of activations and gradients). The training loop builds the stages once
(:class:`hpcnn.engine.context.ParallelContext`); :func:`train_step` here is the same step on its
own, for experiments and tests, and :func:`forward_only` the evaluation forward.

    mpiexec -n 4 python -m mpi4py -c "import numpy as np; \\
        from hpcnn import datasets; from hpcnn.nn import models; \\
        from hpcnn.parallel.collectives import world; from hpcnn.engine import pipelined; \\
        d = datasets.digits(); m = models.mlp(64, (32, 32, 32), 10); c = world(); \\
        out = pipelined.train_step('1f1b', m, c, \\
            d.x_train[:32].astype(np.float32), d.y_train[:32], 4, layout='1|3|2|1'); \\
        print(c.rank, out['loss'], out['peak_inflight'])"
"""
from __future__ import annotations

from hpcnn import backend
from hpcnn.engine.execute import run
from hpcnn.engine.stage import attach_remat, boundary_shapes, build_stages
from hpcnn.engine.step import micro_draws, split_batch
from hpcnn.schedule import stages as partition, pipeline


def forward_only(chain, ranges, pp, x, y=None, owner=None):
    """Forward of the whole chain through the pipeline, stage after stage (evaluation).

    Returns the last stage's output (logits) on the rank owning the last stage, None elsewhere.
    Stage s lives on rank ``owner[s]`` (default s % p); activations go to the next stage's rank
    by point-to-point.
    """
    p, S = pp.size, len(ranges)
    owner = owner or pipeline.round_robin(S, p)
    chains = partition.stage_chains(chain, ranges)
    shapes = boundary_shapes(chain, ranges, [x.shape])[0]
    dtype = chain.params[0].data.dtype
    h = x
    for s in range(S):
        if pp.rank == owner[s]:
            if s > 0 and owner[s - 1] != owner[s]:
                h = backend.xp.empty(shapes[s], dtype=dtype)
                pp.irecv(h, owner[s - 1], tag=s).wait()
            h = chains[s].forward_blocks(h)[0]
            if s < S - 1 and owner[s + 1] != owner[s]:
                pp.isend(h, owner[s + 1], tag=s + 1).wait()
    return h if pp.rank == owner[S - 1] else None


def _pp_communicator(comm):
    """A :class:`.collectives.Communicator` on the pipeline axis of a ProcessGrid, a
    Communicator or a raw MPI communicator."""
    from hpcnn.parallel.collectives import Communicator
    if isinstance(comm, Communicator):
        return comm
    if hasattr(comm, "pp_comm"):
        return Communicator(comm.pp_comm, name="pp")
    return Communicator(comm, name="pp")


def _plan(schedule_name, chain, p: int, n_micro: int, ranges, layout, virtual: int):
    """Stage ranges, stage owners and the validated per-rank lists (the same on every rank)."""
    if schedule_name not in pipeline.SCHEDULES:
        raise ValueError(f"unknown schedule {schedule_name!r}: one of "
                         f"{', '.join(pipeline.SCHEDULES)}")
    n_stages = p * int(virtual)
    if ranges is None:
        ranges = (partition.parse_layout(layout, len(chain)) if layout is not None
                  else partition.uniform(len(chain), n_stages))
    ranges = [tuple(r) for r in ranges]
    if len(ranges) != n_stages:
        raise ValueError(f"{len(ranges)} stages given, expected pp * virtual = {p} * {virtual}")
    owner = pipeline.placement(schedule_name, n_stages, p)
    lists = pipeline.SCHEDULES[schedule_name](n_stages, n_micro, p)
    pipeline.validate(lists, n_stages, n_micro, p, owner)
    return ranges, owner, lists


def train_step(schedule_name, chain, comm, x, y, n_micro, *, ranges=None, layout=None,
               virtual: int = 1, clock=None, t0=None, rank=None, dloss_scale: float = 1.0,
               broadcast_loss: bool = True, remat=None, draw=None, row0: int = 0) -> dict:
    """One pipelined forward/backward of the global batch (x, y); the optimizer step is the caller's.

    ``comm``: ProcessGrid, pipeline Communicator or MPI communicator of p ranks. Stages: the
    explicit ``ranges``, else ``layout`` (``"1|3|2|1"``), else :func:`.partition.uniform` into
    ``p * virtual`` stages. The schedule ``pipeline.SCHEDULES[schedule_name](S, n_micro, p)`` is
    validated, the local stages' gradients zeroed once, the list run (the engine's executor) with
    dloss = dloss_scale * micro-batch size / global size (the global mean loss, scaled: data
    parallelism passes b_i/B so that the replicas' sum is the full-batch gradient). Every rank needs x and y for
    the shapes (the first stage reads x, the last y).

    Stage s runs on rank ``pipeline.placement(schedule_name, S, p)[s]``: round robin, or the V
    of zb_v (which needs ``virtual=2``); the loss is broadcast from the last stage's rank.

    ``remat``: a :class:`hpcnn.engine.remat.RematPolicy`; each local stage then runs its
    rematerialization sequence (forward part at F, the rest at B), its budget divided by the
    micro-batches it holds at once in this schedule (:func:`hpcnn.engine.stage.max_inflight`).

    ``draw``: the step whose dropout masks to draw, ``x`` being rows ``row0 ..`` of that step's
    global batch (each micro-batch gets the masks of its rows in the serial step); None: each
    dropout advances its own counter.

    Returns :func:`hpcnn.engine.execute.run`'s dict with ``loss`` broadcast to every pipeline rank, plus
    ``stages`` (this rank's :class:`hpcnn.engine.stage.Stage` s) and ``ranges``.
    """
    pp = _pp_communicator(comm)
    ranges, owner, lists = _plan(schedule_name, chain, pp.size, n_micro, ranges, layout, virtual)
    p = pp.size
    xs, ys = split_batch(x, y, n_micro)
    shapes = boundary_shapes(chain, ranges, [a.shape for a in xs])
    dtype = chain.params[0].data.dtype
    stages = build_stages(chain, ranges, pp.rank, p, owner)
    if remat:                        # each stage's budget covers its micro-batches in flight
        attach_remat(stages, lists[pp.rank], remat, schedule_name)
    # -- run: zero once, accumulate over micro-batches --
    for st in stages:
        st.chain.zero_grad()
    dloss = [dloss_scale * a.shape[0] / x.shape[0] for a in xs]
    draws = None if draw is None else micro_draws(draw, row0, [a.shape[0] for a in xs])
    out = run(lists[pp.rank], stages, pp, xs, ys, dloss=dloss, shapes=shapes, dtype=dtype,
              clock=clock, t0=t0, rank=rank, draws=draws)
    # -- the loss lives on the last stage's rank (owner[S-1]: p-1, or 0 for zb_v); a caller that
    # reduces gradients next (data parallelism) broadcasts it later, so that the last stages
    # start their allreduce while the first ones are still in the cool-down --
    if broadcast_loss:
        buf = backend.xp.asarray([out["loss"] if out["loss"] is not None else 0.0], dtype="float64")
        pp.bcast(buf, root=owner[-1])
        out["loss"] = float(buf[0])
    out.update(stages=stages, ranges=ranges)
    return out
