"""ZeRO stage 3: the parameters sharded too (Rajbhandari et al., SC'20), on top of stage 2.

Each data-parallel rank keeps only its part of every flat parameter buffer (``shards``, the
elements ``[n r / dp, n (r + 1) / dp)`` its optimizer updates, as at stages 1 and 2); between
uses a parameter's ``data`` is a :func:`~hpcnn.nn.core.placeholder` (no storage, NaN if read).
Every block of the chain that has parameters is wrapped in a :class:`GatheredBlock`: before its
forward, and again before its backward, its parameters are gathered from the ranks' parts into
one buffer (``MPI_Iallgatherv`` in place over the block's elements), and the buffer is dropped
after. While block i computes, the gather of the next block is already started (i + 1 in a
forward, i - 1 in a backward): at most two blocks' buffers live at once (a prefetch that a
recomputation left unused is dropped). The last block stays gathered from its forward to its
backward, which follows at once. Gradients are reduce-scattered per bucket as at stage 2.

The optimizer updates the shards in place (its segments are views of them), so nothing is
gathered after the step. Whatever needs the whole parameters (an evaluation, a checkpoint
saved or restored, the end of the run) asks :meth:`ShardedParameters.whole`: one gather of every
flat buffer, the blocks then run without gathering.

Every data-parallel rank must run the same blocks in the same order (the gathers are collective):
the run refuses the combinations where they may not (a pipeline; rematerialization with unequal
shares, whose sequences differ between ranks).

    mpiexec -n 2 python -m mpi4py -m hpcnn train --model=mlp --dp=2 --zero=3
"""
from __future__ import annotations

import contextlib
import time

import numpy

from hpcnn import backend
from hpcnn.nn.core import Block, placeholder
from hpcnn.parallel.data.sharded import ShardedGradients


class Span:
    """The elements ``[lo, hi)`` of flat buffer ``k`` that a block's parameters fill (each
    parameter at its offset), and each rank's share of them (``counts``: the rank's part
    intersected with the span; their sum is the span)."""

    __slots__ = ("k", "lo", "hi", "items", "counts")

    def __init__(self, k: int, items: list, cut: list[int]):
        self.k, self.items = k, items
        self.lo = min(o for _, o in items)
        self.hi = max(o + p.size for p, o in items)
        if self.hi - self.lo != sum(p.size for p, _ in items):
            raise ValueError("ZeRO-3: a block's parameters are not contiguous in the flat buffer")
        self.counts = [max(0, min(self.hi, cut[q + 1]) - max(self.lo, cut[q]))
                       for q in range(len(cut) - 1)]


class GatheredBlock(Block):
    """A block whose parameters are gathered before its forward and backward (and the halves of
    a split backward) and dropped after; any other attribute is the block's own (a Block, so
    that what walks blocks, e.g. to find the dropouts, walks into it)."""

    name = property(lambda self: self.inner.name)
    training = property(lambda self: self.inner.training)
    defers_weights = property(lambda self: self.inner.defers_weights)

    def __init__(self, inner, engine: "ShardedParameters", j: int):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_j", j)

    def _run(self, fn, step: int, *args, keep: bool = False, **kw):
        e, j = self._engine, self._j
        e.acquire(j, j + step)
        try:
            return fn(*args, **kw)
        finally:
            if not keep:
                e.drop(j)

    def forward(self, x):
        """The last block's parameters stay gathered after a training forward: its backward
        comes next (they are dropped then, or by the next block's gather). A forward between
        two backwards of a micro-batch is a recomputation (rematerialization), its own
        backward or the segment's next recomputed block next: it keeps its parameters and
        prefetches nothing, so a backward finds them gathered."""
        if self._engine.recomputing:
            return self._run(self.inner.forward, 0, x, keep=True)
        last = self._j == len(self._engine.spans) - 1
        return self._run(self.inner.forward, 1, x, keep=last and self.inner.training)

    def backward(self, dy, cache, **kw):
        return self._backward(self.inner.backward, dy, cache, **kw)

    def spec(self, x_shape):
        return self.inner.spec(x_shape)

    def rng_state(self):
        return self.inner.rng_state()

    def set_rng_state(self, state) -> None:
        self.inner.set_rng_state(state)

    def train(self, mode: bool = True) -> "GatheredBlock":
        self.inner.train(mode)
        return self

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in ("backward_input", "backward_weight"):
            return lambda dy, cache: self._backward(attr, dy, cache)
        return attr

    def _backward(self, fn, dy, cache, **kw):
        """A backward (or half of one) of the block, the previous block's gather started;
        until the first block's backward ends, a forward is a recomputation."""
        self._engine.recomputing = self._j > 0
        return self._run(fn, -1, dy, cache, **kw)

    def __setattr__(self, name, value):       # (a GCN's evaluation swaps its blocks' operator)
        setattr(self.inner, name, value)

    def __repr__(self) -> str:
        return f"Gathered({self.inner!r})"


class ShardedParameters(ShardedGradients):
    """ZeRO stage 3 (see the module docstring): :class:`~hpcnn.parallel.data.sharded.
    ShardedGradients` whose parameters live only as this rank's ``shards`` once
    :meth:`broadcast_parameters` has given every rank the same values; ``gather_bytes`` the
    gather buffers alive now, ``gather_peak`` their peak, ``gathers`` the blocks' gathers
    started so far."""

    shards_parameters = True

    def __init__(self, model, comm, **kw):
        super().__init__(model, comm, **kw)
        where = {id(p): (k, int(o)) for k, (ps, offs) in enumerate(self.groups)
                 for p, o in zip(ps, offs)}
        self.wrapped, self.spans, seen = [], [], {}
        for i, b in enumerate(model.blocks):
            per: dict = {}
            for p in {id(p): p for p in b.params}.values():
                if seen.setdefault(id(p), i) != i:
                    raise ValueError(f"ZeRO-3: parameter {p.name} is shared by blocks "
                                     f"{seen[id(p)]} and {i}; each block gathers its own")
                k, o = where[id(p)]
                per.setdefault(k, []).append((p, o))
            if per:
                self.wrapped.append(i)
                self.spans.append([Span(k, items, self.bounds[k]) for k, items in per.items()])
        self.shards, self._held, self._whole = None, {}, False
        self.gather_bytes = self.gather_peak = self.gathers = 0
        self.recomputing = False     # between a micro-batch's first and last block backwards

    def broadcast_parameters(self, root: int = 0) -> None:
        """Rank ``root``'s values everywhere (as at every stage), then keep only this rank's
        part of each flat buffer and wrap the blocks: from now on parameters are gathered."""
        super().broadcast_parameters(root)
        r = self.comm.rank
        self.shards = [flat[cut[r]:cut[r + 1]].copy() for flat, cut in zip(self.pflats, self.bounds)]
        self.pflats = None
        self._drop_all()
        for j, i in enumerate(self.wrapped):
            self.model.blocks[i] = GatheredBlock(self.model.blocks[i], self, j)

    def _data_view(self, k: int, at: int, n: int):
        return self.shards[k][at:at + n]

    def gather_parameters(self) -> None:
        """Nothing: the optimizer updated the shards in place."""

    # -- per block ---------------------------------------------------------------------------------
    def prefetch(self, j: int) -> None:
        """Start gathering block ``j``'s parameters (if it exists and is not held already)."""
        if self._whole or not 0 <= j < len(self.spans) or j in self._held:
            return
        r, reqs, bufs = self.comm.rank, [], []
        for s in self.spans[j]:
            buf = backend.xp.empty(s.hi - s.lo, dtype=self.shards[s.k].dtype)
            cut = self.bounds[s.k]
            a, b = max(s.lo, cut[r]), min(s.hi, cut[r + 1])
            if a < b:
                buf[a - s.lo:b - s.lo] = self.shards[s.k][a - cut[r]:b - cut[r]]
            reqs.append(self.comm.iallgather_parts(backend.bits(buf), s.counts, self.algorithm))
            for p, o in s.items:
                p.data = buf[o - s.lo:o - s.lo + p.size].reshape(p.shape)
            bufs.append(buf)
            self.gather_bytes += buf.nbytes
        self.gather_peak = max(self.gather_peak, self.gather_bytes)
        self.gathers += 1
        self._held[j] = (reqs, bufs)

    def acquire(self, j: int, then: int) -> None:
        """Block ``j``'s parameters whole (gathered now unless prefetched), block ``then``'s
        gather started; any other block's dropped (a prefetch a recomputation left unused)."""
        if self._whole:
            return
        for k in list(self._held):
            if k not in (j, then):
                self.drop(k)
        self.prefetch(j)
        self.prefetch(then)
        t = time.perf_counter()
        for req in self._held[j][0]:
            req.wait()
        self.waited_s += time.perf_counter() - t

    def drop(self, j: int) -> None:
        """Free block ``j``'s gathered parameters."""
        if self._whole or j not in self._held:
            return
        reqs, bufs = self._held.pop(j)
        for req in reqs:
            req.wait()
        for s in self.spans[j]:
            for p, _ in s.items:
                p.data = placeholder(p.shape, p.data.dtype)
        self.gather_bytes -= sum(b.nbytes for b in bufs)

    def _drop_all(self) -> None:
        for j in list(self._held):
            self.drop(j)
        for ps, _ in self.groups:
            for p in ps:
                p.data = placeholder(p.shape, p.data.dtype)

    def _reduced(self) -> None:
        """The step's end: also drop a gather started but not used."""
        super()._reduced()
        self.recomputing = False
        for j in list(self._held):
            self.drop(j)

    # -- the whole model ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def whole(self, gather: bool = True, write_back: bool = False):
        """Every parameter whole for the ``with`` body (collective when ``gather``: one
        allgather per flat buffer; without it the values are undefined until written, as for
        a restore); ``write_back``: this rank's part of them copied into its shards after."""
        if self._whole:
            yield
            return
        for j in list(self._held):
            self.drop(j)
        flats = self._bind_whole(gather)
        self._whole = True
        try:
            yield
            if write_back:
                r = self.comm.rank
                for flat, cut, shard in zip(flats, self.bounds, self.shards):
                    shard[...] = flat[cut[r]:cut[r + 1]]
        finally:
            self._whole = False
            self._drop_all()

    def _bind_whole(self, gather: bool) -> list:
        """One new flat buffer per dtype, every parameter a view of it; with ``gather`` filled
        from every rank's part (one allgather each)."""
        r, flats = self.comm.rank, []
        for (ps, offs), cut, shard in zip(self.groups, self.bounds, self.shards):
            flat = backend.xp.empty(int(offs[-1]), dtype=shard.dtype)
            if gather:
                flat[cut[r]:cut[r + 1]] = shard
                self.comm.allgather_parts(backend.bits(flat), numpy.diff(cut), self.algorithm)
            for p, o in zip(ps, offs):
                p.data = flat[o:o + p.size].reshape(p.shape)
            flats.append(flat)
        return flats

    def release(self) -> None:
        """The parameters whole again on every rank (views of private flat buffers), the blocks
        unwrapped, then stage 2's release."""
        if self.shards is not None:
            for j in list(self._held):
                self.drop(j)
            self._bind_whole(gather=True)      # (the flat buffers become the parameters')
            for i in self.wrapped:
                self.model.blocks[i] = self.model.blocks[i].inner
            self.shards = None
        super().release()
