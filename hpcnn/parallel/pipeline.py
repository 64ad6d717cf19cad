"""Pipeline parallelism: run a schedule's instruction lists (:mod:`.schedules`) on MPI.

The chain is cut into stages (:mod:`.partition`); stage ``s`` lives on pipeline rank ``s % p``
(one stage per rank, or v *virtual* stages for interleaved 1F1B), or for ZB-V on the rank the V
gives (:func:`.schedules.placement`: rank r holds stages r and 2p-1-r, so rank 0 has the loss).
Each rank executes its own list:

    F(mb, s)      forward of micro-batch mb through stage s; the first stage reads the micro-batch,
                  the last computes the loss; one cache per (stage, mb) in flight
    B(mb, s)      backward: the whole one, or, when the list holds W's (zero bubble, Qi et al.
                  ICLR 2024), only the input gradient: a Linear runs ``backward_input`` and keeps
                  (block, dy, cache) for W, other blocks their whole ``backward``
    W(mb, s)      the kept ``backward_weight`` calls
    SEND_*/RECV_* ``isend`` of the produced array (kept alive until completion, all waited at the
                  end) / ``irecv`` into a fresh buffer of the known shape, waited at once (receives
                  block, sends are eager: what :func:`.schedules.validate` proves deadlock-free)

Messages carry the MPI tag of ``(kind, mb, stage)``, the producing stage (:func:`tag_of`).
Parameter gradients accumulate over the micro-batches (zero them once per step). Every
instruction becomes a timeline event ``(rank, kind, microbatch, t_start, t_end)`` for
:meth:`hpcnn.log.runlog.RunLog.log_events`; live activation memory is the sum of the blocks'
``spec().bytes_cache`` over the caches alive, its peak is reported with the peak number of
micro-batches in flight (F done, B not yet).

    mpiexec -n 4 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn import data; from hpcnn.nn import models; \\
        from hpcnn.parallel.comm import Communicator; from hpcnn.parallel import pipeline; \\
        d = data.digits(); m = models.mlp(64, (32, 32, 32), 10); \\
        out = pipeline.train_step('1f1b', m, Communicator(MPI.COMM_WORLD), \\
            d.x_train[:32].astype(np.float32), d.y_train[:32], 4, layout='1|3|2|1'); \\
        print(MPI.COMM_WORLD.rank, out['loss'], out['peak_inflight'])"
"""
from __future__ import annotations

import time

import numpy

from hpcnn import backend
from hpcnn.nn.layers import place_draws
from hpcnn.parallel import partition, schedules

KINDS = ("ACT", "GRAD")


# -- stages ---------------------------------------------------------------------------------------
class PipelineStage:
    """Stage ``index`` of ``n_stages``: a sub-chain of the model; the last stage owns the loss."""

    def __init__(self, index: int, chain, n_stages: int):
        self.index, self.chain, self.n_stages = int(index), chain, int(n_stages)
        self.first, self.last = self.index == 0, self.index == self.n_stages - 1
        if self.last and chain.loss is None:
            raise ValueError(f"stage {index} is the last of {n_stages} but {chain.name} has no loss")
        self._bytes = {}                                   # input shape -> (after F, after B)
        self.remat, self.inflight = None, 1                # a RematPolicy, micro-batches in flight

    @staticmethod
    def _splittable(block) -> bool:
        return hasattr(block, "backward_input") and hasattr(block, "backward_weight")

    def forward(self, x, targets=None):
        """F: returns ``(y, caches)``, or ``(loss, caches)`` on the last stage (loss cache last)."""
        if self.remat is not None:    # the sequence's forward part; the state is the "cache"
            ex = self.remat.executor(self.chain, x.shape, need_dx=not self.first,
                                     inflight=self.inflight)
            return ex.forward(x, targets)          # (output or loss, state: state.executor = ex)
        if self.last:
            return self.chain.forward(x, targets)
        return self.chain.forward_blocks(x)

    def backward(self, dy, caches, split: bool = False):
        """B from the output gradient ``dy`` (on the last stage: the dloss factor).

        Returns ``(dx, pending)``: dx is None on the first stage (no one needs it, so its first
        Linear skips ``backward_input``); with ``split`` the weight halves are not run but
        returned in ``pending`` as (block, dy, cache) for :meth:`weight`, else ``pending == []``.
        """
        if self.remat is not None:
            dx = caches.executor.backward(caches, dy)
            self.remat.note_peak(caches.peak)
            return (None if self.first else dx), []
        blocks = self.chain.blocks
        if self.last:
            dy = self.chain.loss.backward(dy, caches[-1])  # from loss, lc = loss.forward(out, t)
        pending = []
        for i in range(len(blocks) - 1, -1, -1):
            b, c, no_dx = blocks[i], caches[i], self.first and i == 0
            if self._splittable(b) and (split or no_dx):
                if split:
                    pending.append((b, dy, c))
                else:
                    b.backward_weight(dy, c)
                dy = None if no_dx else b.backward_input(dy, c)
            elif split and b.defers_weights:   # a block built from Linears: defer their W halves
                dy = b.backward(dy, c, defer=pending)
            else:
                dy = b.backward(dy, c)
        return (None if self.first else dy), pending

    @staticmethod
    def weight(pending) -> None:
        """W: the weight-gradient halves kept by a split :meth:`backward`."""
        for b, dy, c in pending:
            b.backward_weight(dy, c)

    def cache_bytes(self, x_shape) -> tuple[int, int]:
        """Bytes of one micro-batch's caches for input ``x_shape``: after F, and after a split B
        (the Linear caches and their output gradients, kept for W). From ``spec``, not measured."""
        key = tuple(x_shape)
        if key not in self._bytes:
            specs = self.chain.spec(key)
            # a split B keeps each Linear's input and output gradient until W; composite blocks
            # (whose inner Linears defer too) are counted with their whole cache, an upper bound
            kept = sum(s.bytes_cache + (s.bytes_y if self._splittable(b) else 0)
                       for b, s in zip(self.chain.blocks, specs)
                       if self._splittable(b) or b.params)
            self._bytes[key] = (sum(s.bytes_cache for s in specs), kept)
        return self._bytes[key]

    def held_bytes(self, caches, x_shape) -> int:
        """Bytes one micro-batch keeps between its F and its B: the caches (from ``spec``), or
        with rematerialization what the executor's account holds after the forward part."""
        if self.remat is not None:
            return int(caches.trace[-1][1])
        return self.cache_bytes(x_shape)[0]

    def __repr__(self) -> str:
        return f"PipelineStage({self.index}/{self.n_stages}, {self.chain.name})"


def build_stages(chain, ranges, rank: int, n_ranks: int, owner=None) -> list[PipelineStage]:
    """This rank's stages as sub-chains: ranges[s] for every s with ``owner[s] == rank``
    (default round robin: s = rank, rank + p, ..., p = n_ranks), in stage order."""
    if len(ranges) % n_ranks:
        raise ValueError(f"{len(ranges)} stages do not split evenly over {n_ranks} pipeline ranks")
    owner = owner or schedules.round_robin(len(ranges), n_ranks)
    chains = partition.stage_chains(chain, ranges)
    return [PipelineStage(s, chains[s], len(ranges)) for s in range(len(ranges))
            if owner[s] == rank]


def boundary_shapes(chain, ranges, micro_shapes) -> list[list[tuple]]:
    """``shapes[mb][i]``: the input shape of stage i for micro-batch mb (i = S: the output)."""
    memo, out = {}, []
    for shape in micro_shapes:
        shape = tuple(shape)
        if shape not in memo:
            ins = [shape] + [s.out_shape for s in chain.spec(shape, include_loss=False)]
            memo[shape] = [ins[a] for a, _ in ranges] + [ins[-1]]
        out.append(memo[shape])
    return out


def tag_of(kind: str, mb: int, stage: int, n_stages: int) -> int:
    """The MPI tag of message ``(kind, mb, stage)``: unique per step, < 2 M S (M micro-batches)."""
    return 2 * (mb * n_stages + stage) + KINDS.index(kind)


# -- executor -------------------------------------------------------------------------------------
def run_schedule(instrs, stages, pp_comm, micro_inputs, micro_targets, *, dloss, shapes, dtype,
                 clock=None, t0=None, rank=None, draws=None) -> dict:
    """Execute one rank's instruction list.

    Parameters: ``instrs``: this rank's list (:class:`.schedules.Instr`); ``stages``: its
    :class:`PipelineStage` s; ``pp_comm``: the pipeline :class:`.comm.Communicator` (peers are its
    ranks); ``micro_inputs`` / ``micro_targets``: per micro-batch (read on the first / last stage
    only); ``dloss``: the loss-gradient factor, a number or one per micro-batch (mean over the
    global batch: micro-batch size / global size); ``shapes``: :func:`boundary_shapes`;
    ``dtype``: of activations and gradients; ``clock`` (default ``time.perf_counter``) and ``t0``
    (default: now) time the events; ``rank`` labels them (default ``pp_comm.rank``);
    ``draws``: per micro-batch (step, global index of its first row), given to the stage's dropouts
    before its F (:func:`hpcnn.nn.layers.place_draws`), so masks are those of the serial step.

    Returns a dict: ``loss`` (sum of micro-batch losses times dloss; None off the last stage),
    ``losses`` {mb: loss}, ``events`` [(rank, kind, mb, t_start, t_end)], ``peak_bytes``,
    ``peak_inflight`` (this rank), ``peak_inflight_stage`` {stage: peak}.
    """
    clock = clock or time.perf_counter
    t0 = clock() if t0 is None else t0
    rank = pp_comm.rank if rank is None else rank
    mine = {st.index: st for st in stages}
    n_stages = stages[0].n_stages
    split = any(i.op == "W" for i in instrs)
    factor = (lambda mb: dloss) if isinstance(dloss, (int, float)) else (lambda mb: dloss[mb])
    caches, pending, msgs, losses = {}, {}, {}, {}
    sends, live, events = [], {}, []
    peak_bytes, inflight = 0, {s: 0 for s in mine}
    peak_stage, peak_rank = dict(inflight), 0
    for ins in instrs:
        ts, op, mb, s = clock(), ins.op, ins.mb, ins.stage
        if op == "F":
            st = mine[s]
            x = micro_inputs[mb] if st.first else msgs.pop(("ACT", mb, s - 1))
            if draws is not None:
                place_draws(st.chain, *draws[mb])
            out, caches[(s, mb)] = st.forward(x, micro_targets[mb] if st.last else None)
            if st.last:
                losses[mb] = out
            else:
                msgs[("ACT", mb, s)] = out
            live[(s, mb)] = st.held_bytes(caches[(s, mb)], shapes[mb][s])
            inflight[s] += 1
        elif op == "B":
            st = mine[s]
            dy = factor(mb) if st.last else msgs.pop(("GRAD", mb, s + 1))
            dx, pending[(s, mb)] = st.backward(dy, caches.pop((s, mb)), split)
            if not st.first:
                msgs[("GRAD", mb, s)] = dx
            live[(s, mb)] = st.cache_bytes(shapes[mb][s])[1] if split else 0
            inflight[s] -= 1
        elif op == "W":
            PipelineStage.weight(pending.pop((s, mb)))
            live[(s, mb)] = 0
        elif op.startswith("SEND"):
            buf = backend.xp.ascontiguousarray(msgs.pop((op[5:], mb, s)))
            sends.append((pp_comm.isend(buf, ins.peer, tag_of(op[5:], mb, s, n_stages)), buf))
        else:                                                  # RECV_ACT / RECV_GRAD
            shape = shapes[mb][s + 1 if op == "RECV_ACT" else s]
            buf = backend.xp.empty(shape, dtype=dtype)
            pp_comm.irecv(buf, ins.peer, tag_of(op[5:], mb, s, n_stages)).wait()
            msgs[(op[5:], mb, s)] = buf
        events.append((rank, op, mb, ts - t0, clock() - t0))
        sends = [(q, b) for q, b in sends if not q.test()]     # progress; drop completed buffers
        peak_bytes = max(peak_bytes, sum(live.values()))
        peak_stage = {k: max(v, inflight[k]) for k, v in peak_stage.items()}
        peak_rank = max(peak_rank, sum(inflight.values()))
    for q, _ in sends:
        q.wait()
    if msgs or caches or any(pending.values()):
        raise RuntimeError(f"rank {rank}: schedule left {len(msgs)} messages, {len(caches)} caches "
                           f"and {sum(map(bool, pending.values()))} W's unused (incomplete list)")
    loss = sum(losses[mb] * factor(mb) for mb in sorted(losses)) if losses else None
    return {"loss": loss, "losses": losses, "events": events, "peak_bytes": peak_bytes,
            "peak_inflight": peak_rank, "peak_inflight_stage": peak_stage}


# -- one training step ----------------------------------------------------------------------------
def split_batch(x, y, n_micro: int):
    """Cut a global batch along axis 0 into ``n_micro`` contiguous micro-batches (sizes differ by at
    most one, the larger first); returns the lists (xs, ys)."""
    n = int(x.shape[0])
    if not isinstance(n_micro, int) or not 1 <= n_micro <= n:
        raise ValueError(f"n_micro ({n_micro!r}) must be an integer in [1, batch size ({n})]")
    q, r = divmod(n, n_micro)
    cuts = [0]
    for i in range(n_micro):
        cuts.append(cuts[-1] + q + (i < r))
    return ([x[a:b] for a, b in zip(cuts, cuts[1:])], [y[a:b] for a, b in zip(cuts, cuts[1:])])


def forward_only(chain, ranges, pp, x, y=None, owner=None):
    """Forward of the whole chain through the pipeline, stage after stage (evaluation).

    Returns the last stage's output (logits) on the rank owning the last stage, None elsewhere.
    Stage s lives on rank ``owner[s]`` (default s % p); activations go to the next stage's rank
    by point-to-point.
    """
    p, S = pp.size, len(ranges)
    owner = owner or schedules.round_robin(S, p)
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
    """A :class:`.comm.Communicator` on the pipeline axis of a ProcessGrid, a Communicator or a
    raw mpi4py communicator."""
    from hpcnn.parallel.comm import Communicator
    if isinstance(comm, Communicator):
        return comm
    if hasattr(comm, "pp_comm"):
        return Communicator(comm.pp_comm, name="pp")
    return Communicator(comm, name="pp")


def max_inflight(instrs) -> dict:
    """Per stage: the most micro-batches between their F and their B in one rank's list."""
    now, peak = {}, {}
    for ins in instrs:
        if ins.op in ("F", "B"):
            now[ins.stage] = now.get(ins.stage, 0) + (1 if ins.op == "F" else -1)
            peak[ins.stage] = max(peak.get(ins.stage, 0), now[ins.stage])
    return peak


def attach_remat(stages, instrs, policy, schedule_name: str) -> None:
    """Give each stage the policy and the number of micro-batches it holds at once in this
    rank's list ``instrs`` (its budget is split over them); refuses lists with W's."""
    if any(i.op == "W" for i in instrs):
        raise ValueError(f"schedule {schedule_name!r} splits backwards (W); rematerialized "
                         f"stages run whole backwards")
    inflight = max_inflight(instrs)
    for st in stages:
        st.remat, st.inflight = policy, max(1, inflight.get(st.index, 1))


def plan_remat(policy, schedule_name, chain, ranges, comm, rows: int, feat: tuple, n_micro: int,
               virtual: int = 1) -> list:
    """Solve the rematerialization sequences of this rank's stages for a batch of ``rows`` rows
    of ``feat``-shaped samples (what :func:`train_step` would solve at its first F); returns the
    stages with the policy attached."""
    pp = _pp_communicator(comm)
    n_stages = pp.size * int(virtual)
    lists = schedules.SCHEDULES[schedule_name](n_stages, n_micro, pp.size)
    sizes = [len(a) for a in numpy.array_split(numpy.arange(rows), n_micro)]
    shapes = boundary_shapes(chain, ranges, [(m,) + tuple(feat) for m in sizes])
    stages = build_stages(chain, ranges, pp.rank, pp.size,
                          schedules.placement(schedule_name, n_stages, pp.size))
    attach_remat(stages, lists[pp.rank], policy, schedule_name)
    for st in stages:
        for mb in range(n_micro):
            policy.executor(st.chain, shapes[mb][st.index], need_dx=not st.first,
                            inflight=st.inflight)
    return stages


def train_step(schedule_name, chain, comm, x, y, n_micro, *, ranges=None, layout=None,
               virtual: int = 1, clock=None, t0=None, rank=None, dloss_scale: float = 1.0,
               broadcast_loss: bool = True, remat=None, draw=None, row0: int = 0) -> dict:
    """One pipelined forward/backward of the global batch (x, y); the optimizer step is the caller's.

    ``comm``: ProcessGrid, pipeline Communicator or mpi4py communicator of p ranks. Stages: the
    explicit ``ranges``, else ``layout`` (``"1|3|2|1"``), else :func:`.partition.uniform` into
    ``p * virtual`` stages. The schedule ``schedules.SCHEDULES[schedule_name](S, n_micro, p)`` is
    validated, the local stages' gradients zeroed once, the list run (:func:`run_schedule`) with
    dloss = dloss_scale * micro-batch size / global size (the global mean loss, scaled: data
    parallelism passes b_i/B so that the replicas' sum is the full-batch gradient). Every rank needs x and y for
    the shapes (the first stage reads x, the last y).

    Stage s runs on rank ``schedules.placement(schedule_name, S, p)[s]``: round robin, or the V
    of zb_v (which needs ``virtual=2``); the loss is broadcast from the last stage's rank.

    ``remat``: a :class:`hpcnn.memory.policy.RematPolicy`; each local stage then runs its
    rematerialization sequence (forward part at F, the rest at B), its budget divided by the
    micro-batches it holds at once in this schedule (:func:`max_inflight`).

    ``draw``: the step whose dropout masks to draw, ``x`` being rows ``row0 ..`` of that step's
    global batch (each micro-batch gets the masks of its rows in the serial step); None: each
    dropout advances its own counter.

    Returns :func:`run_schedule`'s dict with ``loss`` broadcast to every pipeline rank, plus
    ``stages`` (this rank's :class:`PipelineStage` s) and ``ranges``.
    """
    if schedule_name not in schedules.SCHEDULES:
        raise ValueError(f"unknown schedule {schedule_name!r}: one of "
                         f"{', '.join(schedules.SCHEDULES)}")
    pp = _pp_communicator(comm)
    p, n_stages = pp.size, pp.size * int(virtual)
    if ranges is None:
        ranges = (partition.parse_layout(layout, len(chain)) if layout is not None
                  else partition.uniform(len(chain), n_stages))
    ranges = [tuple(r) for r in ranges]
    if len(ranges) != n_stages:
        raise ValueError(f"{len(ranges)} stages given, expected pp * virtual = {p} * {virtual}")
    # -- plan: schedule, micro-batches, receive shapes (identical on every rank) --
    owner = schedules.placement(schedule_name, n_stages, p)
    lists = schedules.SCHEDULES[schedule_name](n_stages, n_micro, p)
    schedules.validate(lists, n_stages, n_micro, p, owner)
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
    starts = numpy.cumsum([int(row0)] + [a.shape[0] for a in xs])
    draws = None if draw is None else [(int(draw), int(a)) for a in starts[:-1]]
    out = run_schedule(lists[pp.rank], stages, pp, xs, ys, dloss=dloss, shapes=shapes,
                       dtype=dtype, clock=clock, t0=t0, rank=rank, draws=draws)
    # -- the loss lives on the last stage's rank (owner[S-1]: p-1, or 0 for zb_v); a caller that
    # reduces gradients next (data parallelism) broadcasts it later, so that the last stages
    # start their allreduce while the first ones are still in the cool-down --
    if broadcast_loss:
        buf = backend.xp.asarray([out["loss"] if out["loss"] is not None else 0.0], dtype="float64")
        pp.bcast(buf, root=owner[-1])
        out["loss"] = float(buf[0])
    out.update(stages=stages, ranges=ranges)
    return out
