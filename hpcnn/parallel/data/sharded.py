"""ZeRO stages 1 and 2: the optimizer state, and at stage 2 the gradients, sharded over the
data-parallel ranks (Rajbhandari et al., SC'20).

:class:`ShardedDataParallel` reduces the gradients as :class:`~hpcnn.parallel.data.bucketed.
DataParallel` does (buckets allreduced during the backward, the weighted combine unchanged) and
also keeps the parameters in one flat buffer per dtype, laid out as the gradients' (each
parameter's ``data`` a view of it). Each flat buffer is cut into ``dp`` contiguous parts, rank r
owning elements ``[n r / dp, n (r + 1) / dp)`` (uneven sizes for any dp; a parameter may be cut
between two ranks). :class:`ShardedOptimizer` runs SGD or AdamW over this rank's part only, as
:class:`Segment` views of the parameters and gradients (each element's update is the same
element-wise arithmetic as an unsharded step's), so its slots (momentum, AdamW's m and v) take
1/dp of the memory; then every rank's updated part is gathered into every rank's buffer (one
``MPI_Allgatherv`` in place per dtype).

At stage 1 the gradients stay whole on every rank, so clipping sees the global norm as before;
stage 2 (:class:`ShardedGradients`) reduce-scatters them per bucket instead. A checkpoint
holds the whole state: :meth:`ShardedOptimizer.full_state` assembles each slot over the ranks
(collective), and :meth:`ShardedOptimizer.set_slot` keeps this rank's part of a resumed one, so
a checkpoint moves between zero stages, dp sizes and layouts.

    mpiexec -n 2 python -m mpi4py -m hpcnn train --model=mlp --dp=2 --zero=2
"""
from __future__ import annotations

import time

import numpy

from hpcnn import backend
from hpcnn.parallel.data.bucketed import Bucket, DataParallel, non_finite


def bounds(n: int, parts: int) -> list[int]:
    """The ``parts + 1`` offsets cutting ``n`` elements into contiguous, nearly equal parts."""
    return [n * r // parts for r in range(parts + 1)]


class Segment:
    """Elements ``[lo, hi)`` of parameter ``full`` (row-major), as the optimizer sees them: its
    ``data`` and ``grad`` 1-D views, its name and tensor-parallel axis. ``grad`` is taken from
    the parameter at each use (its storage, a shared window during the run, is rebound to
    private memory when the engine is released: no view of the window may outlive it)."""

    __slots__ = ("full", "lo", "hi", "data", "name", "tp_axis", "part")

    def __init__(self, full, lo: int, hi: int, part=None, data=None):
        self.full, self.lo, self.hi, self.name = full, lo, hi, full.name
        self.data = full.data.reshape(-1)[lo:hi] if data is None else data   # ZeRO-3: a shard's
        self.tp_axis = getattr(full, "tp_axis", None)
        self.part = part           # ZeRO-2: the reduced gradient's elements, in the rank's part

    @property
    def grad(self):
        if self.part is not None:
            return self.part
        return self.full.grad.reshape(-1)[self.lo:self.hi]

    @grad.setter
    def grad(self, value):           # (``seg.grad *= s`` assigns the scaled view back)
        g = self.grad
        if value is not g:
            g[...] = value

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def shape(self):
        return self.data.shape


class ShardedDataParallel(DataParallel):
    """:class:`~hpcnn.parallel.data.bucketed.DataParallel` whose parameters also live in flat
    buffers, cut into one contiguous part per rank (see the module docstring)."""

    def __init__(self, model, comm, **kw):
        super().__init__(model, comm, **kw)
        xp = backend.xp
        self.groups, self.pflats, self.bounds = [], [], []
        for dtype in dict.fromkeys(p.grad_dtype for p in self.params):   # as the gradients'
            ps = [p for p in self.params if p.grad_dtype == dtype]
            if len({p.data.dtype for p in ps}) > 1:
                raise ValueError(f"ZeRO: parameters of dtypes {sorted({str(p.data.dtype) for p in ps})} "
                                 f"share {dtype} gradients; one parameter dtype per gradient dtype")
            offs = numpy.cumsum([0] + [p.size for p in ps])
            flat = xp.empty(int(offs[-1]), dtype=ps[0].data.dtype)
            for p, o in zip(ps, offs):
                flat[o:o + p.size] = p.data.reshape(-1)
                p.data = flat[o:o + p.size].reshape(p.shape)
            self.groups.append((ps, offs))
            self.pflats.append(flat)
            self.bounds.append(bounds(int(offs[-1]), comm.size))

    def segments(self) -> list[Segment]:
        """This rank's part of every flat buffer, as one :class:`Segment` per parameter it
        touches (a parameter at most once)."""
        out, r = [], self.comm.rank
        for k, ((ps, offs), cut) in enumerate(zip(self.groups, self.bounds)):
            a, b = cut[r], cut[r + 1]
            for p, o in zip(ps, offs):
                lo, hi = max(a, o) - o, min(b, o + p.size) - o
                if lo < hi:
                    at = o + lo - a                     # where it starts in the rank's part
                    out.append(Segment(p, lo, hi, self._part_view(k, at, hi - lo),
                                       self._data_view(k, at, hi - lo)))
        return out

    def _part_view(self, k: int, at: int, n: int):
        """Stage 1: None (a segment's gradient is a view of the whole one)."""
        return None

    def _data_view(self, k: int, at: int, n: int):
        """Stages 1 and 2: None (a segment's values are a view of the whole parameter)."""
        return None

    def gather_parameters(self) -> None:
        """Every rank's updated part into every rank's parameters (one allgather per dtype)."""
        for flat, cut in zip(self.pflats, self.bounds):
            self.comm.allgather_parts(backend.bits(flat), numpy.diff(cut), self.algorithm)

    def __repr__(self) -> str:
        return "Sharded" + super().__repr__()


class Assembled:
    """A parameter's whole float32 master copy for a checkpoint: its name, tensor-parallel cut
    and ``data`` (what :func:`hpcnn.checkpoint.save` reads of a parameter)."""

    def __init__(self, p, data):
        self.name, self.data = p.name, data
        self.tp_axis, self.tp_parts = getattr(p, "tp_axis", None), getattr(p, "tp_parts", 1)


class ShardedOptimizer:
    """An optimizer (``make(segments)``: SGD or AdamW) over this rank's part of ``engine``'s
    parameters, then the parameters gathered; ``params`` the rank's whole parameters (what the
    run clips, saves and restores), in the order the plain optimizer would have them."""

    def __init__(self, engine: ShardedDataParallel, make, params):
        self.engine, self.params = engine, list(params)
        self.segments = engine.segments()
        self.inner = make(self.segments)        # (decay by each segment's whole parameter)
        self._segment = {s.name: s for s in self.segments}
        # mixed precision: the float32 master copies of this rank's segments (by name)
        self._master = {m.name: m for m in getattr(self.inner, "params", ())
                        if getattr(m, "model", None) is not None}
        # what clipping scales: the whole gradients, or at stage 2 this rank's part of them
        self.clipped = self.segments if engine.shards_gradients else self.params

    @property
    def state(self) -> dict:
        """This rank's state: ``step`` and its parts of the slots (``name/m``, ...)."""
        return self.inner.state

    def step(self, lr: float) -> None:
        """Update this rank's part, then gather every part into every rank's parameters."""
        self.inner.step(lr)
        self.engine.gather_parameters()

    def held_arrays(self) -> list:
        return self.inner.held_arrays()

    def master_arrays(self) -> list:
        return [m.data for m in self._master.values()]

    def saved_params(self, params) -> list:
        """``params``, or with 16-bit parameters their float32 master copies at full shape,
        each assembled over the data-parallel ranks from their parts (collective; exact)."""
        if not self._master:
            return params
        return [Assembled(p, self._assembled(p, self._master[p.name].data
                                             if p.name in self._master else None))
                for p in params]

    def _assembled(self, p, part):
        """Parameter ``p``'s whole array (in its compute dtype: its slots', its master's) from
        every rank's ``part`` of it (None: no part here), summed over dp: every element has
        one non-zero term, so it is exact."""
        full = backend.xp.zeros(p.size, dtype=backend.compute_dtype(p.data.dtype))
        s = self._segment.get(p.name)
        if s is not None and part is not None:
            full[s.lo:s.hi] = part
        return self.engine.comm.reduce_array(full, "sum").reshape(p.shape)

    def set_master(self, name: str, array) -> None:
        """Keep this rank's part of parameter ``name``'s master copy (a whole array)."""
        s, m = self._segment.get(name), self._master.get(name)
        if s is not None and m is not None:
            m.data[...] = array.reshape(-1)[s.lo:s.hi]

    def full_state(self) -> dict:
        """The whole state (collective over the data-parallel ranks): ``step`` and every slot of
        every parameter at its full shape, each assembled from the ranks' parts (a sum in which
        every element has one non-zero term: exact)."""
        comm = self.engine.comm
        slots = sorted({k.rsplit("/", 1)[1] for part in comm.allgather_objects(
            [k for k in self.inner.state if "/" in k]) for k in part})
        out = {k: v for k, v in self.inner.state.items() if "/" not in k}
        state = self.inner.state
        for p in self.params:
            for slot in slots:
                key = f"{p.name}/{slot}"
                out[key] = self._assembled(p, state.get(key))
        return out

    def set_slot(self, name: str, slot: str, array) -> None:
        """Keep this rank's part of slot ``slot`` of parameter ``name`` (a whole array)."""
        s = self._segment.get(name)
        if s is not None:
            self.inner.state[f"{name}/{slot}"] = array.reshape(-1)[s.lo:s.hi].copy()


class ShardedGradients(ShardedDataParallel):
    """ZeRO stage 2: :class:`ShardedDataParallel` whose gradients are sharded too. Buckets hold
    whole parameters (one larger than ``bucket_mb`` alone); a bucket's gradient storage is
    bound when the backward first writes one of its parameters (:meth:`hpcnn.nn.core.Parameter.
    lend_grad`), reduce-scattered over the ranks when it is final (``MPI_Ireduce_scatter``,
    started during the backward as the allreduce is at stage 0; with overlap, during every
    micro-batch's backward, :meth:`hook_for`), each rank receiving the elements of its part
    into ``flats`` (its reduced gradient, 1/dp), and freed once reduced.
    Finite: each rank tests its part; one small allgather names the ranks whose own gradient
    was not. Clipping sums the parts' squares over dp (``shards_gradients``)."""

    shards_gradients = True

    def _layout(self, params, owner) -> None:
        k, dtype = len(self.flats), params[0].grad_dtype
        offs = numpy.cumsum([0] + [p.size for p in params])
        cut = bounds(int(offs[-1]), self.comm.size)
        self.flats.append(backend.xp.zeros(cut[self.comm.rank + 1] - cut[self.comm.rank], dtype))
        step, start = max(1, int(self.bucket_mb * 2 ** 20) // dtype.itemsize), 0
        while start < len(params):
            end = start + 1
            while end < len(params) and offs[end + 1] - offs[start] <= step:
                end += 1
            ps = params[start:end]
            b = Bucket(k, int(offs[start]), int(offs[end]), min(owner[id(p)] for p in ps), ps,
                       last=end == len(params))
            b.counts = [max(0, min(b.hi, cut[q + 1]) - max(b.lo, cut[q]))
                        for q in range(self.comm.size)]
            b.at = max(0, b.lo - cut[self.comm.rank])        # where its part starts in mine
            b.source = lambda _p, b=b: self._bind(b)
            for p in ps:
                p.lend_grad(b.source)
            self.buckets.append(b)
            start = end
        self.live_bytes = self.peak_bytes = 0

    def __init__(self, model, comm, **kw):
        super().__init__(model, comm, **kw)
        self.nbytes = sum((b.hi - b.lo) * self.flats[b.flat].itemsize for b in self.buckets)

    def _part_view(self, k: int, at: int, n: int):
        return self.flats[k][at:at + n]

    def _bind(self, b) -> None:
        """Storage for bucket ``b``'s gradients (read as zero until written)."""
        b.view = backend.xp.empty(b.hi - b.lo, dtype=self.flats[b.flat].dtype)
        o = 0
        for q in b.params:
            q.bind_lent(b.view[o:o + q.size].reshape(q.shape))
            o += q.size
        self.live_bytes += b.view.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, b) -> None:
        if b.view is not None:
            self.live_bytes -= b.view.nbytes
        for q in b.params:
            q.lend_grad(b.source)
        b.view = None

    def _launch(self, b) -> None:
        if b.view is None:
            self._bind(b)                              # nothing written this step: zeros
        for p in b.params:
            p.grad                                     # a lazy zero written now
        if self.check_finite and not self._local_bad:
            self._local_bad = not backend.finite(b.view, backend.square_sum(b.view))
        mine = self.flats[b.flat][b.at:b.at + b.counts[self.comm.rank]]
        into = backend.xp.empty_like(mine) if self._added else mine   # later micro-batches add
        req = self.comm.ireduce_scatter_parts(b.view, into, b.counts, self.algorithm)
        self._reqs.append(req)
        self._inflight.append((req, b, self._at, None if into is mine else (into, mine)))

    def _launch_ready(self, i: int) -> None:
        """As at stage 0, then free the storage of every bucket whose reduction is done, and
        of those launched two blocks ago or earlier once done (waited for): at most the
        buckets of the block computing next and of the two before it stay bound
        (:func:`hpcnn.plan.hybrid.grad_buffer_params`), however slowly the reductions
        progress."""
        self._at = i
        super()._launch_ready(i)
        still, t = [], time.perf_counter()
        for r, b, at, add in self._inflight:
            if at > i + 1 and i >= 0:
                r.wait()
            if r.done:
                self._complete(b, add)
            else:
                still.append((r, b, at, add))
        self._inflight = still
        self.waited_s += time.perf_counter() - t

    def _complete(self, b, add) -> None:
        """Bucket ``b``'s reduction done: a later micro-batch's part added to the rank's
        (``add`` = (received, part)), the bucket's storage freed."""
        if add is not None:
            received, part = add
            part += received
        self._free(b)

    def hook_for(self, mb: int, last: int):
        """With overlap, every micro-batch's buckets are reduce-scattered during its own
        backward, a later micro-batch's parts added to the rank's (the previous micro-batch's
        reductions completed first, so that its buckets may be written again): a step binds
        three blocks' buckets at most, however many micro-batches it accumulates. Without
        overlap (pipelines), as at stage 0: once, at the last micro-batch."""
        if not self.overlap:
            return super().hook_for(mb, last)
        if self._next:                       # an earlier micro-batch of this step was reduced
            t = time.perf_counter()
            self._drain()
            self.waited_s += time.perf_counter() - t
            self._reqs, self._next, self._added = [], 0, True
            self.launched = []               # (the last micro-batch's launches: --show_schedule)
        return self._on_block_done

    def backward(self, dloss, caches, sync: bool = True) -> None:
        """As at stage 0 (:meth:`DataParallel.backward`); with overlap every micro-batch is
        reduced during its backward whatever ``sync`` (:meth:`hook_for`)."""
        if not self.overlap:
            super().backward(dloss, caches, sync)
            return
        self.model.backward(dloss, caches, need_dx=False, on_block_done=self.hook_for(0, 0))

    def _reset(self) -> None:
        super()._reset()
        self._inflight, self._at, self._added = [], -1, False

    def _drain(self) -> None:
        """Every reduction in flight waited for and completed (:meth:`_complete`)."""
        for r, b, _, add in self._inflight:
            r.wait()
            self._complete(b, add)
        self._inflight = []

    def _reduced(self) -> None:
        """Every bucket reduce-scattered: the later micro-batches' parts added, the storage
        of every bucket not freed yet freed."""
        self._drain()
        for b in self.buckets:
            self._free(b)

    def _check(self, step: int) -> None:
        xp = backend.xp                  # one flag per part, read at once: one transfer
        bad = not all(backend.to_host(xp.stack([xp.isfinite(f).all() for f in self.flats]))) \
            if self.flats else False
        flags = self.comm.allgather_scalars([1.0 if bad else 0.0,
                                             1.0 if self._local_bad else 0.0])
        if flags[:, 0].any():
            raise non_finite(step, flags[:, 1])

    def auto_sizes(self) -> list[int]:
        return []

    def release(self) -> None:
        """Private zero gradients again; the parts dropped."""
        for p in self.params:
            p.lend_grad(None)
        self.flats, self.buckets, self.order, self._reqs = [], [], [], []
