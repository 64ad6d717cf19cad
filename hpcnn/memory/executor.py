"""Run an op sequence (:mod:`.sequence`) on a real chain, with an exact account of live bytes.

::

    ex = Executor(chain, seq)                 # seq from rotor.Solver(...).solve(budget).sequence
    res = ex.run(x, targets)                  # loss, dx; parameter gradients accumulated
    res.peak                                  # peak live bytes of activations, caches, gradients

The executor owns the stored values: checkpoints x[i], the x̄[i] = (x[i], cache of stage i-1) and
the current gradient δ. A recomputed forward restores the block's RNG state of its first forward
(dropout draws the same mask). For pipelines the run splits in two: :meth:`Executor.forward` runs
the ops before the first backward or the first recomputation and returns the stage output (or the
loss) and a state;
:meth:`Executor.backward` finishes from the output gradient.

**The account** is the number of distinct bytes the arrays reachable from the stored values
address (:func:`live_bytes`: an array and its views count once, a view of part of a buffer its
own part), taken after each op with its results and before its frees: the peak in the model of
:mod:`.simulate`, measured on the real arrays (a pipeline's micro-batch, a slice of the rank's
batch, counts its own bytes, as a spec counts it). A block never keeps part of a larger buffer of
its own in its cache or output (checked by ``tests/cachecheck.py``). Left out: what a block
allocates and frees inside one call (its transient) and the parameters and their gradients, the
constants to add when comparing with ``tracemalloc``.

**Offloading** (OFF/PRE ops) goes through an :class:`~.offload.OffloadChannel`: an offloaded value
is counted until the channel reports its copy done, a prefetched one from the PRE on. With a
``budget`` and the profile, an op that would not fit waits for the oldest offloads to finish (the
rule :func:`.simulate.simulate` models), so the account never exceeds the budget by waiting less
than the simulator does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hpcnn import backend
from hpcnn.schedule.ops import CHANNEL
from hpcnn.nn.chain import backward_block


def _root(a):
    """The array that owns the memory ``a`` views (``a`` itself if it owns its memory)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def _arrays(obj, out):
    """The arrays in ``obj`` (an array, or tuples, lists and dicts of them), appended to ``out``."""
    if isinstance(obj, (tuple, list)):      # caches (NamedTuples), lists of them: the common case
        for o in obj:
            _arrays(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _arrays(o, out)
    elif hasattr(obj, "nbytes") and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        out.append(obj)
    return out


def extent(a) -> tuple:
    """(first byte, one past the last byte) of the memory ``a`` addresses, as addresses; a
    strided view spans from its lowest to its highest element (NumPy or CuPy arrays)."""
    iface = getattr(a, "__array_interface__", None)
    lo = iface["data"][0] if iface is not None else a.data.ptr
    if a.size == 0:
        return lo, lo
    hi = lo
    for n, stride in zip(a.shape, a.strides):
        if stride < 0:
            lo += stride * (n - 1)
        else:
            hi += stride * (n - 1)
    return lo, hi + a.itemsize


def live_bytes(*objs) -> int:
    """Distinct bytes addressed by the arrays reachable from ``objs``: per buffer, the union of
    its arrays' extents (:func:`extent`). An array and its whole views count once; a slice of a
    buffer counts the slice, two overlapping slices their union."""
    spans = {}
    for a in _arrays(objs, []):
        spans.setdefault(id(_root(a)), []).append(extent(a))
    total = 0
    for intervals in spans.values():
        intervals.sort()
        start, end = intervals[0]
        for lo, hi in intervals[1:]:
            if lo > end:                     # a gap: close the current run
                total += end - start
                start, end = lo, hi
            else:
                end = max(end, hi)
        total += end - start
    return total


@dataclass
class RunResult:
    loss: float | None
    dx: object
    peak: int                                  # bytes, the account's peak
    trace: list = field(default_factory=list)  # (op, live bytes) per op


class _State:
    """One forward+backward in progress: stored values, position in the sequence, RNG states."""

    def __init__(self, x, targets=None, executor=None):
        self.targets = targets     # the loss's targets (a chain with a loss)
        self.executor = executor   # who runs the rest (a pipeline keeps the state as the cache)
        self.xs = {0: x}           # checkpoints and values in flight: i -> x[i]
        self.bars = {}             # i -> (x[i], cache of stage i-1)
        self.delta = None          # current gradient
        self.pos = 0
        self.rng = {}              # stage -> RNG state before its first forward
        self.outgoing = {}         # channel key -> bytes, copy out not yet seen done
        self.incoming = {}         # channel key -> bytes, prefetched, not yet fetched
        self.peak = 0
        self.trace = []
        self.loss = None
        self.hook = None
        self.out_at_start = 0      # bytes in flight out when the current compute op started
        self.done = set()          # stages whose forward has run once in this pass


def _first_recompute(seq) -> int:
    """The index of the first forward op of ``seq`` that runs a block again (len if none): a
    pipeline stage's backward may start by recomputing its last block
    (:func:`hpcnn.schedule.sequences.segments` without the loss)."""
    seen = set()
    for k, op in enumerate(seq):
        if op.kind.startswith("F_"):
            if op.block in seen:
                return k
            seen.add(op.block)
    return len(seq)


class Executor:
    """Runs ``seq`` on ``chain`` (its blocks, then its loss as the last stage if it has one)."""

    def __init__(self, chain, seq, *, channel=None, need_dx: bool = True, prof=None,
                 budget: float | None = None):
        self.chain, self.seq = chain, list(seq)
        self.stages = list(chain.blocks) + ([chain.loss] if chain.loss is not None else [])
        self.n = len(self.stages)
        self.channel, self.need_dx = channel, need_dx
        self.prof, self.budget = prof, budget
        if any(op.kind in CHANNEL for op in self.seq) and channel is None:
            raise ValueError("the sequence has OFF/PRE ops: pass an OffloadChannel")
        firsts = [k for k, op in enumerate(self.seq) if op.kind == "B"]
        if not firsts or self.seq[firsts[0]].block != self.n - 1:
            raise ValueError(f"the sequence's first backward must be B{self.n - 1} "
                             f"(the chain has {self.n} stages)")
        self.split = min(firsts[0], _first_recompute(self.seq))
        self.recompute_seconds = 0.0   # wall time of forwards run again (what store-all saves)

    # -- the two halves ---------------------------------------------------------------------------
    def forward(self, x, targets=None):
        """Ops before the first backward. Returns (output or loss, state)."""
        st = _State(x, targets, self)
        self._account(st, "start")
        while st.pos < self.split:
            self._step(st, self.seq[st.pos])
            st.pos += 1
        y = self._value(st, self.n)
        return (st.loss if self.chain.loss is not None else y), st

    def backward(self, dy, st, on_block_done=None):
        """The remaining ops from the output gradient ``dy`` (the dloss factor with a loss) and
        the state :meth:`forward` returned.

        ``on_block_done(i)`` is called after block i's backward, as in
        :meth:`hpcnn.nn.chain.Chain.backward_blocks` (data parallelism launches buckets from it).
        """
        st.delta = dy
        st.hook = on_block_done
        while st.pos < len(self.seq):
            self._step(st, self.seq[st.pos])
            st.pos += 1
        if st.xs or st.bars or st.outgoing or st.incoming:
            raise RuntimeError(f"sequence left stored values: x{sorted(st.xs)}, "
                               f"x̄{sorted(st.bars)}, channel {sorted(st.outgoing)}")
        return st.delta

    def run(self, x, targets=None, dy=1.0) -> RunResult:
        """Forward and backward in one go; parameter gradients accumulate into the blocks."""
        out, st = self.forward(x, targets)
        dx = self.backward(dy, st)
        return RunResult(st.loss, dx, st.peak, st.trace)

    # -- ops ----------------------------------------------------------------------------------------
    def _value(self, st, i):
        if i in st.xs:
            return st.xs[i]
        if i in st.bars:
            return st.bars[i][0]
        raise RuntimeError(f"x{i} is not stored")

    def _forward(self, st, i, x):
        stage = self.stages[i]
        saved = st.rng.get(i)
        if saved is None:
            st.rng[i] = stage.rng_state() if hasattr(stage, "rng_state") else None
            return self._call(st, i, stage, x)
        now = stage.rng_state()
        stage.set_rng_state(saved)                       # recompute: the first forward's draws
        try:
            return self._call(st, i, stage, x)
        finally:
            stage.set_rng_state(now)

    def _call(self, st, i, stage, x):
        if i == self.n - 1 and self.chain.loss is not None:
            loss, cache = stage.forward(x, st.targets)
            st.loss = loss
            return None, cache                          # the loss value is a float, not stored
        return stage.forward(x)

    def _step(self, st, op):
        kind, i = op.kind, op.block
        if kind in CHANNEL:
            return self._channel(st, op)
        self._fetch_needed(st, op)
        self._wait_room(st, op)
        if self.channel is not None:        # copies still out at the start count for the op
            self._retire(st)
            st.out_at_start = sum(st.outgoing.values())
        if kind == "B":
            y, cache = st.bars[i + 1]
            stage = self.stages[i]
            if i == self.n - 1 and self.chain.loss is not None:
                new = stage.backward(st.delta, cache)
            else:                            # the chain's own per-block step
                new = backward_block(stage, st.delta, cache, need_dx=self.need_dx or i > 0)
            self._account(st, op, new)
            del st.bars[i + 1]
            st.xs.pop(i, None)
            st.delta = new
            if st.hook is not None and i < len(self.chain.blocks):
                st.hook(i)
            return
        again = i in st.done                 # a recomputation: store-all would not run it
        if again:                            # (on a GPU, time the kernels, not their launch)
            backend.sync()
            t0 = time.perf_counter()
        y, cache = self._forward(st, i, self._value(st, i))
        if again:
            backend.sync()
            self.recompute_seconds += time.perf_counter() - t0
        st.done.add(i)
        if kind == "F_all":
            st.xs.pop(i + 1, None)          # a stage's stored output, recomputed with its cache
            st.bars[i + 1] = (y, cache)
        else:
            cache = None
            st.xs[i + 1] = y
        self._account(st, op)
        if kind == "F_n":
            st.xs.pop(i, None)

    # -- channel -----------------------------------------------------------------------------------
    def _channel(self, st, op):
        key = (id(st), op.item, op.block)
        store = st.xs if op.item == "x" else st.bars
        if op.kind == "OFF":
            obj = store.pop(op.block)
            st.outgoing[key] = live_bytes(obj)
            self.channel.offload(key, obj)
            del obj
        else:
            self._wait_room(st, op, st.outgoing.get(key) or self._sizes(op))
            nb = st.outgoing.pop(key, None)
            st.incoming[key] = nb if nb is not None else self._sizes(op)
            self.channel.prefetch(key)
        self._account(st, op)

    def _sizes(self, op):
        if self.prof is None:
            return 0
        return int(self.prof.wx[op.block] if op.item == "x" else self.prof.wbar[op.block])

    def _fetch_needed(self, st, op):
        i = op.block
        keys = [(id(st), "x", i), (id(st), "bar", i)]
        if op.kind == "B":
            keys.append((id(st), "bar", i + 1))
        for key in keys:
            if key in st.incoming:
                obj = self.channel.fetch(key)
                del st.incoming[key]
                (st.xs if key[1] == "x" else st.bars)[key[2]] = obj

    def _retire(self, st):
        for key in [k for k in st.outgoing if self.channel.offloaded(k)]:
            del st.outgoing[key]

    def _need(self, op):
        p, i = self.prof, op.block
        if op.kind == "B":
            return int(p.wd[i] + p.ob[i])
        return int((p.wbar[i + 1] if op.kind == "F_all" else p.wx[i + 1]) + p.of[i])

    def _wait_room(self, st, op, need=None):
        if self.budget is None or self.prof is None or self.channel is None:
            return
        need = self._need(op) if need is None else need
        while True:
            live = self._live(st)            # retires the copies done meanwhile: count first,
            if not st.outgoing or live + need <= self.budget:   # then look at what is still out
                return
            key = next(iter(st.outgoing))
            self.channel.wait_offload(key)
            del st.outgoing[key]

    # -- account -----------------------------------------------------------------------------------
    def _live(self, st, *extra) -> int:
        if self.channel is not None:
            self._retire(st)
        return (live_bytes(st.xs, st.bars, st.delta, *extra) + sum(st.outgoing.values())
                + sum(st.incoming.values()))

    def _account(self, st, op, *extra):
        live = self._live(st, *extra)
        if op not in ("start",) and op.kind not in CHANNEL and st.out_at_start:
            live += st.out_at_start - sum(st.outgoing.values())
            st.out_at_start = 0
        st.peak = max(st.peak, live)
        st.trace.append((op, live))
        return live


def store_all_reference(chain, x, targets=None):
    """The plain forward and backward (every cache kept): loss and dx, for comparisons."""
    loss, caches = chain.forward(x, targets)
    dx = chain.backward(1.0, caches)
    return loss, dx


__all__ = ["Executor", "RunResult", "extent", "live_bytes", "store_all_reference"]
