"""ZeRO stage 1: the optimizer state sharded over the data-parallel ranks (Rajbhandari et al.,
SC'20).

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

The gradients stay whole on every rank, so clipping sees the global norm as before. A checkpoint
holds the whole state: :meth:`ShardedOptimizer.full_state` assembles each slot over the ranks
(collective), and :meth:`ShardedOptimizer.set_slot` keeps this rank's part of a resumed one, so
a checkpoint moves between zero stages, dp sizes and layouts.

    mpiexec -n 2 python -m mpi4py -m hpcnn train --model=mlp --dp=2 --zero=1
"""
from __future__ import annotations

import numpy

from hpcnn import backend
from hpcnn.nn.optim import decays
from hpcnn.parallel.data.bucketed import DataParallel


def bounds(n: int, parts: int) -> list[int]:
    """The ``parts + 1`` offsets cutting ``n`` elements into contiguous, nearly equal parts."""
    return [n * r // parts for r in range(parts + 1)]


class Segment:
    """Elements ``[lo, hi)`` of parameter ``full`` (row-major), as the optimizer sees them: its
    ``data`` and ``grad`` 1-D views, its name and tensor-parallel axis. ``grad`` is taken from
    the parameter at each use (its storage, a shared window during the run, is rebound to
    private memory when the engine is released: no view of the window may outlive it)."""

    __slots__ = ("full", "lo", "hi", "data", "name", "tp_axis")

    def __init__(self, full, lo: int, hi: int):
        self.full, self.lo, self.hi, self.name = full, lo, hi, full.name
        self.data = full.data.reshape(-1)[lo:hi]
        self.tp_axis = getattr(full, "tp_axis", None)

    @property
    def grad(self):
        return self.full.grad.reshape(-1)[self.lo:self.hi]

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
        for dtype in dict.fromkeys(p.data.dtype for p in self.params):
            ps = [p for p in self.params if p.data.dtype == dtype]
            offs = numpy.cumsum([0] + [p.size for p in ps])
            flat = xp.empty(int(offs[-1]), dtype=dtype)
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
        for (ps, offs), cut in zip(self.groups, self.bounds):
            a, b = cut[r], cut[r + 1]
            for p, o in zip(ps, offs):
                lo, hi = max(a, o) - o, min(b, o + p.size) - o
                if lo < hi:
                    out.append(Segment(p, lo, hi))
        return out

    def gather_parameters(self) -> None:
        """Every rank's updated part into every rank's parameters (one allgather per dtype)."""
        for flat, cut in zip(self.pflats, self.bounds):
            self.comm.allgather_parts(flat, numpy.diff(cut))

    def part_bytes(self) -> int:
        """Bytes of this rank's parts (the parameters its optimizer updates)."""
        r = self.comm.rank
        return sum((c[r + 1] - c[r]) * f.itemsize for f, c in zip(self.pflats, self.bounds))

    def __repr__(self) -> str:
        return "Sharded" + super().__repr__()


class ShardedOptimizer:
    """An optimizer (``make(segments)``: SGD or AdamW) over this rank's part of ``engine``'s
    parameters, then the parameters gathered; ``params`` the rank's whole parameters (what the
    run clips, saves and restores), in the order the plain optimizer would have them."""

    def __init__(self, engine: ShardedDataParallel, make, params):
        self.engine, self.params = engine, list(params)
        self.segments = engine.segments()
        self.inner = make(self.segments)
        self.inner.decay = {s.name: decays(s.full) for s in self.segments}
        self._segment = {s.name: s for s in self.segments}

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

    def full_state(self) -> dict:
        """The whole state (collective over the data-parallel ranks): ``step`` and every slot of
        every parameter at its full shape, each assembled from the ranks' parts (a sum in which
        every element has one non-zero term: exact)."""
        comm = self.engine.comm
        slots = sorted({k.rsplit("/", 1)[1] for part in comm.allgather_objects(
            [k for k in self.inner.state if "/" in k]) for k in part})
        out = {k: v for k, v in self.inner.state.items() if "/" not in k}
        for p in self.params:
            for slot in slots:
                full = backend.xp.zeros(p.size, dtype=p.data.dtype)
                s = self._segment.get(p.name)
                if s is not None and f"{p.name}/{slot}" in self.inner.state:
                    full[s.lo:s.hi] = self.inner.state[f"{p.name}/{slot}"]
                out[f"{p.name}/{slot}"] = comm.reduce_array(full, "sum").reshape(p.shape)
        return out

    def set_slot(self, name: str, slot: str, array) -> None:
        """Keep this rank's part of slot ``slot`` of parameter ``name`` (a whole array)."""
        s = self._segment.get(name)
        if s is not None:
            self.inner.state[f"{name}/{slot}"] = array.reshape(-1)[s.lo:s.hi].copy()
