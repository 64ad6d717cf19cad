"""Run one rank's schedule for one step: the executor every training step goes through.

The list is a schedule's per-rank instruction list (:mod:`hpcnn.schedule.pipeline`): a serial or
data-parallel step is the one-stage list ``F(0) B(0) F(1) B(1) ...`` (one F/B per micro-batch:
gradient accumulation), a pipeline step its rank's list of the chosen schedule. Each instruction
acts on this rank's :class:`~hpcnn.engine.stage.Stage` s::

    F(mb, s)      forward of micro-batch mb through stage s; the first stage reads the micro-batch,
                  the last computes the loss; one cache per (stage, mb) in flight
    B(mb, s)      backward: the whole one, or, when the list holds W's (zero bubble, Qi et al.
                  ICLR 2024), only the input gradient, the weight halves kept for W
    W(mb, s)      the kept weight halves
    SEND_*/RECV_* ``isend`` of the produced array (kept alive until completion, all waited at the
                  end) / ``irecv`` into a fresh buffer of the known shape, waited at once (receives
                  block, sends are eager: what :func:`hpcnn.schedule.pipeline.validate` proves
                  deadlock-free)

A rematerialized stage runs its op sequence inside its F and B (:class:`.stage.Stage`); data
parallelism is the ``on_block_done`` hook of the backwards (:func:`run`'s ``hook``), which launches
gradient buckets as their blocks finish. Messages carry the MPI tag of ``(kind, mb, stage)``, the
producing stage (:func:`tag_of`). Every instruction becomes a timeline event ``(rank, kind,
microbatch, t_start, t_end)``; live activation memory is the sum of the blocks'
``spec().bytes_cache`` over the caches alive (or the executor's account when rematerialized).
"""
from __future__ import annotations

import time

from hpcnn import backend
from hpcnn.nn.layers import place_draws

KINDS = ("ACT", "GRAD")


def tag_of(kind: str, mb: int, stage: int, n_stages: int) -> int:
    """The MPI tag of message ``(kind, mb, stage)``: unique per step, < 2 M S (M micro-batches)."""
    return 2 * (mb * n_stages + stage) + KINDS.index(kind)


def _remat_ops(stage, state, since: int) -> list:
    """The ops a rematerialized stage's executor ran since position ``since`` of its trace
    (none for a plain stage)."""
    if stage.remat is None:
        return []
    return [op for op, _ in state.trace[since:] if op != "start"]


class _Run:
    """The state of one list's execution: caches, pending W's, messages, memory account."""

    def __init__(self, stages, comm, inputs, targets, dloss, shapes, dtype, draws, hook):
        self.mine = {st.index: st for st in stages}
        self.n_stages = stages[0].n_stages
        self.comm, self.inputs, self.targets = comm, inputs, targets
        self.factor = (lambda mb: dloss) if isinstance(dloss, (int, float)) else dloss.__getitem__
        self.shapes, self.dtype, self.draws, self.hook = shapes, dtype, draws, hook
        self.split = False
        self.caches, self.pending, self.msgs, self.losses = {}, {}, {}, {}
        self.sends, self.live, self.held = [], {}, 0    # live bytes per (stage, mb); their sum
        self.inflight = {s: 0 for s in self.mine}
        self.peak_bytes, self.peak_rank, self.peak_stage = 0, 0, dict(self.inflight)

    def _hold(self, key, nbytes: int) -> None:
        """(stage, mb) now holds ``nbytes`` between its ops; the peak of the sum follows."""
        self.held += nbytes - self.live.get(key, 0)
        self.live[key] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.held)

    def _inside(self, key, st, state, since: int) -> None:
        """A rematerialized stage's pass peaks inside it, recomputed caches on top of what the
        micro-batch keeps (its executor's account, ``state.trace``): the others' held bytes
        plus that peak count as the rank's too."""
        if st.remat is not None:
            inside = max((b for _, b in state.trace[since:]), default=0)
            self.peak_bytes = max(self.peak_bytes, self.held - self.live.get(key, 0) + inside)

    def _count(self, s: int, d: int) -> None:
        """Micro-batches in flight on stage s change by d (F: +1, B: -1); peaks follow."""
        self.inflight[s] += d
        if d > 0:
            self.peak_stage[s] = max(self.peak_stage[s], self.inflight[s])
            self.peak_rank = max(self.peak_rank, sum(self.inflight.values()))

    def forward(self, mb, s):
        st = self.mine[s]
        x = self.inputs[mb] if st.first else self.msgs.pop(("ACT", mb, s - 1))
        if self.draws is not None:
            place_draws(st.chain, *self.draws[mb])
        out, state = st.forward(x, self.targets[mb] if st.last else None)
        self.caches[(s, mb)] = state
        if st.last:
            self.losses[mb] = out
        else:
            self.msgs[("ACT", mb, s)] = out
        self._inside((s, mb), st, state, 0)
        self._hold((s, mb), st.held_bytes(state, self.shapes[mb][s]))
        self._count(s, 1)
        return _remat_ops(st, state, 0)

    def backward(self, mb, s):
        st = self.mine[s]
        dy = self.factor(mb) if st.last else self.msgs.pop(("GRAD", mb, s + 1))
        hook = self.hook(mb) if self.hook is not None else None
        state = self.caches.pop((s, mb))
        since = len(state.trace) if st.remat is not None else 0
        dx, self.pending[(s, mb)] = st.backward(dy, state, self.split, hook)
        self._inside((s, mb), st, state, since)
        if not st.first:
            self.msgs[("GRAD", mb, s)] = dx
        self._hold((s, mb), st.cache_bytes(self.shapes[mb][s])[1] if self.split else 0)
        self._count(s, -1)
        return _remat_ops(st, state, since)

    def weight(self, mb, s):
        self.mine[s].weight(self.pending.pop((s, mb)))
        self._hold((s, mb), 0)

    def send(self, ins):
        kind = ins.kind[5:]
        buf = backend.xp.ascontiguousarray(self.msgs.pop((kind, ins.mb, ins.stage)))
        req = self.comm.isend(buf, ins.peer, tag_of(kind, ins.mb, ins.stage, self.n_stages))
        self.sends.append((req, buf))

    def receive(self, ins):
        kind, mb, s = ins.kind[5:], ins.mb, ins.stage
        buf = backend.xp.empty(self.shapes[mb][s + 1 if kind == "ACT" else s], dtype=self.dtype)
        self.comm.irecv(buf, ins.peer, tag_of(kind, mb, s, self.n_stages)).wait()
        self.msgs[(kind, mb, s)] = buf

    def progress(self):
        """Progress the sends, dropping the buffers of completed ones."""
        if self.sends:
            self.sends = [(q, b) for q, b in self.sends if not q.test()]


def run(instrs, stages, comm, micro_inputs, micro_targets, *, dloss, shapes, dtype, clock=None,
        t0=None, rank=None, draws=None, hook=None, trace=None) -> dict:
    """Execute one rank's instruction list.

    Parameters: ``instrs``: this rank's list (:class:`hpcnn.schedule.ops.Op`);
    ``stages``: its :class:`~.stage.Stage` s; ``comm``: the pipeline Communicator (peers are its
    ranks; unused by a one-stage list); ``micro_inputs`` / ``micro_targets``: per micro-batch
    (read on the first / last stage only); ``dloss``: the loss-gradient factor, a number or one
    per micro-batch; ``shapes``: :func:`.stage.boundary_shapes`; ``dtype``: of activations and
    gradients; ``clock`` (default ``time.perf_counter``) and ``t0`` (default: now) time the
    events; ``rank`` labels them (default ``comm.rank``); ``draws``: per micro-batch (step,
    global index of its first row), given to the stage's dropouts before its F
    (:func:`hpcnn.nn.layers.place_draws`), so masks are those of the serial step; ``hook(mb)``:
    the ``on_block_done`` callback for micro-batch mb's backward, or None (data parallelism);
    ``trace``: a list receiving ``(instruction, ops run inside it)`` as they run (the ops: a
    rematerialized stage's sequence part, :mod:`hpcnn.schedule.expand`).

    Returns a dict: ``loss`` (sum of micro-batch losses times dloss; None off the last stage),
    ``losses`` {mb: loss}, ``events`` [(rank, kind, mb, t_start, t_end)], ``peak_bytes`` (the
    largest sum of the caches the rank's micro-batches hold between their passes, a
    rematerialized pass's inside peak in place of its micro-batch's share while it runs),
    ``peak_inflight`` (this rank), ``peak_inflight_stage`` {stage: peak}.
    """
    clock = clock or time.perf_counter
    t0 = clock() if t0 is None else t0
    rank = comm.rank if rank is None else rank
    r = _Run(stages, comm, micro_inputs, micro_targets, dloss, shapes, dtype, draws, hook)
    r.split = any(i.kind == "W" for i in instrs)
    compute = {"F": r.forward, "B": r.backward, "W": r.weight}
    events = []
    for ins in instrs:
        ts, inner = clock(), None
        if ins.kind in compute:
            inner = compute[ins.kind](ins.mb, ins.stage)
        elif ins.kind.startswith("SEND"):
            r.send(ins)
        else:                                                  # RECV_ACT / RECV_GRAD
            r.receive(ins)
        events.append((rank, ins.kind, ins.mb, ts - t0, clock() - t0))
        if trace is not None:
            trace.append((ins, inner or []))
        r.progress()
    for q, _ in r.sends:
        q.wait()
    if r.msgs or r.caches or any(r.pending.values()):
        raise RuntimeError(f"rank {rank}: schedule left {len(r.msgs)} messages, {len(r.caches)} "
                           f"caches and {sum(map(bool, r.pending.values()))} W's unused "
                           f"(incomplete list)")
    loss = sum(r.losses[mb] * r.factor(mb) for mb in sorted(r.losses)) if r.losses else None
    return {"loss": loss, "losses": r.losses, "events": events, "peak_bytes": r.peak_bytes,
            "peak_inflight": r.peak_rank, "peak_inflight_stage": r.peak_stage}
