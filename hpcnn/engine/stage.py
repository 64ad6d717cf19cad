"""A stage: the part of the chain one rank runs as one unit of a schedule (F, B, W).

A one-stage schedule (serial and data-parallel runs) has a single stage, the whole chain with its
loss; a pipeline cuts the chain into stages (:mod:`hpcnn.schedule.stages`) and places them on
ranks (:func:`hpcnn.schedule.pipeline.placement`). A stage is built once per run and runs every
micro-batch of every step:

    F(mb)   ``forward(x, targets)`` -> (output, or the loss on the last stage; caches)
    B(mb)   ``backward(dy, caches)`` -> (dx, pending): the chain's one reverse-over-blocks loop
            (:meth:`hpcnn.nn.chain.Chain.backward_blocks`); with ``split`` (zero-bubble
            schedules) the weight halves are returned in ``pending`` for W instead of being run
    W(mb)   ``weight(pending)``

With a rematerialization policy (:class:`hpcnn.engine.remat.RematPolicy`) the stage's F runs the
forward part of its op sequence and B the rest, inside :class:`hpcnn.memory.executor.Executor`:
the same blocks, the same per-block backward (:func:`hpcnn.nn.chain.backward_block`).
"""
from __future__ import annotations

from hpcnn.nn.chain import splittable
from hpcnn.schedule import stages as partition, pipeline


class Stage:
    """Stage ``index`` of ``n_stages``: a sub-chain of the model; the last stage owns the loss.

    ``remat`` (a RematPolicy or None) and ``inflight`` (micro-batches this stage holds at once in
    its rank's schedule: the remat budget is split over them) are set by the run context."""

    def __init__(self, index: int, chain, n_stages: int):
        self.index, self.chain, self.n_stages = int(index), chain, int(n_stages)
        self.first, self.last = self.index == 0, self.index == self.n_stages - 1
        if self.last and chain.loss is None:
            raise ValueError(f"stage {index} is the last of {n_stages} but {chain.name} has no loss")
        self._bytes = {}                                   # input shape -> (after F, after B)
        self.remat, self.inflight = None, 1

    def forward(self, x, targets=None):
        """F: returns ``(y, caches)``, or ``(loss, caches)`` on the last stage (loss cache last);
        rematerialized: the sequence's forward part, the executor's state standing as caches."""
        if self.remat is not None:
            ex = self.remat.executor(self.chain, x.shape, need_dx=not self.first,
                                     inflight=self.inflight)
            return ex.forward(x, targets)          # (output or loss, state: state.executor = ex)
        if self.last:
            return self.chain.forward(x, targets)
        return self.chain.forward_blocks(x)

    def backward(self, dy, caches, split: bool = False, on_block_done=None):
        """B from the output gradient ``dy`` (on the last stage: the dloss factor).

        Returns ``(dx, pending)``: dx is None on the first stage (no one needs it, so its first
        Linear skips ``backward_input``); with ``split`` the weight halves are not run but
        returned in ``pending`` as (block, dy, cache) for :meth:`weight`, else ``pending == []``.
        ``on_block_done(i)`` is called after block i's gradients are complete (data parallelism
        launches its buckets from it).
        """
        if self.remat is not None:
            dx = caches.executor.backward(dy, caches, on_block_done=on_block_done)
            self.remat.note_peak(caches.peak)
            return (None if self.first else dx), []
        if self.last:
            dy = self.chain.loss.backward(dy, caches[-1])
            caches = caches[:-1]
        pending = [] if split else None
        dx = self.chain.backward_blocks(dy, caches, need_dx=not self.first,
                                        on_block_done=on_block_done, defer=pending)
        return (None if self.first else dx), (pending or [])

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
            kept = sum(s.bytes_cache + (s.bytes_y if splittable(b) else 0)
                       for b, s in zip(self.chain.blocks, specs)
                       if splittable(b) or b.params)
            self._bytes[key] = (sum(s.bytes_cache for s in specs), kept)
        return self._bytes[key]

    def held_bytes(self, caches, x_shape) -> int:
        """Bytes one micro-batch keeps between its F and its B: the caches (from ``spec``), or
        with rematerialization what the executor's account holds after the forward part."""
        if self.remat is not None:
            return int(caches.trace[-1][1])
        return self.cache_bytes(x_shape)[0]

    def __repr__(self) -> str:
        return f"Stage({self.index}/{self.n_stages}, {self.chain.name})"


def build_stages(chain, ranges, rank: int, n_ranks: int, owner=None) -> list[Stage]:
    """This rank's stages as sub-chains: ranges[s] for every s with ``owner[s] == rank``
    (default round robin: s = rank, rank + p, ..., p = n_ranks), in stage order."""
    if len(ranges) % n_ranks:
        raise ValueError(f"{len(ranges)} stages do not split evenly over {n_ranks} pipeline ranks")
    owner = owner or pipeline.round_robin(len(ranges), n_ranks)
    chains = partition.stage_chains(chain, ranges)
    return [Stage(s, chains[s], len(ranges)) for s in range(len(ranges)) if owner[s] == rank]


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


def max_inflight(instrs) -> dict:
    """Per stage: the most micro-batches between their F and their B in one rank's list."""
    now, peak = {}, {}
    for ins in instrs:
        if ins.kind in ("F", "B"):
            now[ins.stage] = now.get(ins.stage, 0) + (1 if ins.kind == "F" else -1)
            peak[ins.stage] = max(peak.get(ins.stage, 0), now[ins.stage])
    return peak


def attach_remat(stages, instrs, policy, schedule_name: str) -> None:
    """Give each stage the policy and the number of micro-batches it holds at once in this
    rank's list ``instrs`` (its budget is split over them); refuses lists with W's."""
    if any(i.kind == "W" for i in instrs):
        raise ValueError(f"schedule {schedule_name!r} splits backwards (W); rematerialized "
                         f"stages run whole backwards")
    inflight = max_inflight(instrs)
    for st in stages:
        st.remat, st.inflight = policy, max(1, inflight.get(st.index, 1))
