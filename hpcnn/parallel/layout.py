"""Layout blocks: a chain of Linear (+ element-wise) blocks laid out per layer over p devices as the
planner's cuts say, and the redistributions between neighbours whose layouts differ.

The layout algebra (``Cut``, ``Placement``, what a move sends) is :mod:`hpcnn.schedule.placement`;
this module runs it on MPI through the Communicator. :func:`layout_mlp` builds an MLP from a list
of cuts (or a plan file, :func:`~hpcnn.schedule.placement.read_plan`).

Gradient convention (that of :mod:`~hpcnn.parallel.tensor.mappings`): every copy of a replicated
activation, and of its gradient, holds the full value, so each backward is the conjugate of its
forward: :class:`LayoutLinear` allreduces y over nk forward, dx over nj and dW, db over nb
backward; :class:`Redistribute` (A -> B) fetches each device's B part in one ``alltoallv`` and
moves the gradient B -> A the same way; ReLU, GELU are local.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; \\
        from hpcnn.parallel.collectives import world; from hpcnn.parallel.layout import \\
        Cut, layout_mlp; c = world(); m = layout_mlp(6, [8], 3, \\
        [Cut(2, 1, 1), Cut(1, 1, 2)], c, seed=0, dtype=np.float64); \\
        x = np.arange(24.).reshape(4, 6) / 10; print(m.forward(x, np.arange(4) % 3)[0])"
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy

from hpcnn import backend
from hpcnn.nn.chain import Chain
from hpcnn.nn.core import Block, BlockSpec, Parameter, is_placeholder, placeholder
from hpcnn.nn.layers import Linear, ReLU
from hpcnn.nn.loss import SoftmaxCrossEntropy
from hpcnn.schedule.placement import (Cut, Placement, _local, _Move, _size, crosses, moved_elements,
                                      part_range, part_size, plan_move)


def run_move(comm, move: _Move, x):
    """Apply one device's part of a plan: ``x`` (this device's ``have`` rectangle) -> its
    ``need`` rectangle, by local copies and, if any piece crosses devices, one alltoallv."""
    xp = backend.xp
    me = comm.rank
    (r0, r1), (c0, c1) = move.need
    out = xp.empty((r1 - r0, c1 - c0), dtype=x.dtype)
    for rect in move.sends[me]:                      # pieces this device keeps
        out[_local(rect, move.need)] = x[_local(rect, move.have)]
    send_counts = [0 if q == me else sum(map(_size, move.sends[q])) for q in range(comm.size)]
    recv_counts = [0 if q == me else sum(map(_size, move.recvs[q])) for q in range(comm.size)]
    sendbuf = xp.empty(sum(send_counts), dtype=x.dtype)
    o = 0
    for q in range(comm.size):
        for rect in (move.sends[q] if q != me else ()):
            n = _size(rect)
            sendbuf[o:o + n] = x[_local(rect, move.have)].reshape(-1)
            o += n
    recvbuf = xp.empty(sum(recv_counts), dtype=x.dtype)
    comm.alltoallv(sendbuf, send_counts, recvbuf, recv_counts)
    o = 0
    for q in range(comm.size):
        for rect in (move.recvs[q] if q != me else ()):
            n = _size(rect)
            sl = _local(rect, move.need)
            out[sl] = recvbuf[o:o + n].reshape(out[sl].shape)
            o += n
    return out



class RedistributeCache(NamedTuple):
    """The full batch size ``n_rows`` the forward found (the backward moves a gradient of it)."""
    n_rows: int



class Redistribute(Block):
    """The same 2-D activation (batch, ``features``) moved from placement ``src`` to ``dst``.

    forward: this device's ``src`` part -> its ``dst`` part: a local slice where the target is
    a sub-part of what it holds, else one alltoallv (gathering along a group, or exchanging
    pieces where the cut dimension changes). backward: the gradient moved ``dst`` -> ``src``
    the same way (every copy of a replicated activation holds the full gradient, so nothing is
    summed). Cache: :class:`RedistributeCache`, the full batch size.
    """

    def __init__(self, src: Placement, dst: Placement, features: int, comm, *,
                 dtype=backend.DEFAULT_DTYPE, name="redistribute"):
        super().__init__()
        if src.p != comm.size or dst.p != comm.size:
            raise ValueError(f"{name}: placements of {src.p} and {dst.p} devices on a "
                             f"communicator of {comm.size}")
        self.src, self.dst, self.features, self.comm = src, dst, int(features), comm
        self.dtype, self.name = backend.dtype_of(dtype), name
        self._plans = {}                 # (n_rows, forward?) -> _Move: a pure memo of plan_move

    def _exchanges_rows(self) -> bool:
        """True when the full batch size is not known locally (see :meth:`_rows`)."""
        return self.src.rows > 1 and not self.src.same_rows(self.dst)

    def _rows(self, x) -> int:
        """The full batch size, from this device's rows (one scalar all-gather when the source
        cuts the batch differently from the target)."""
        local = int(x.shape[0])
        if not self._exchanges_rows():
            # src.rows == 1: this device holds the whole batch. Same row parts: only devices
            # holding the same row part exchange data, so a batch of equal parts of this size
            # puts every piece at the same local rows
            return local * self.src.rows
        counts = self.comm.allgather_scalars([local])[:, 0]
        first = {}
        for d, i in enumerate(self.src.row_of):
            first.setdefault(i, d)
        return int(sum(counts[d] for d in first.values()))

    def _plan(self, n_rows: int, forward: bool):
        """(whether any piece crosses devices, this device's :class:`_Move`), memoised."""
        key = (n_rows, forward)
        if key not in self._plans:
            a, b = (self.src, self.dst) if forward else (self.dst, self.src)
            # decided on non-empty parts: the same answer on every rank, also where a rank
            # knows only an equal-parts stand-in for the batch size (see _rows)
            rows_seen = max(n_rows, a.rows * b.rows)
            self._plans[key] = (crosses(a, b, rows_seen, self.features),
                                plan_move(a, b, n_rows, self.features, self.comm.rank))
        return self._plans[key]

    def _move(self, x, n_rows, forward: bool):
        comm_needed, move = self._plan(n_rows, forward)
        if not comm_needed:                          # a sub-part of what this device holds
            return backend.xp.ascontiguousarray(x[_local(move.need, move.have)])
        return run_move(self.comm, move, x)

    def forward(self, x):
        if x.ndim != 2 or x.shape[1] != part_size(self.src, self.comm.rank, self.features):
            raise ValueError(f"{self.name}: input of shape {tuple(x.shape)}, expected (rows, "
                             f"{part_size(self.src, self.comm.rank, self.features)})")
        n_rows = self._rows(x)
        return self._move(x, n_rows, True), RedistributeCache(n_rows=n_rows)

    def backward(self, dy, cache):
        return self._move(dy, cache.n_rows, False)

    def bytes_moved(self, n_rows: int) -> int:
        """What one forward+backward sends, summed over the ranks (the documented formula)."""
        f = self.features
        return self.dtype.itemsize * (sum(moved_elements(self.src, self.dst, n_rows, f))
                                      + sum(moved_elements(self.dst, self.src, n_rows, f)))

    def spec(self, x_shape):
        """Shapes for a batch of equal parts (x_shape[0] rows per part); ``comm_bytes``: what
        this rank's alltoallv calls send forward and backward (plus the batch-size all-gather
        where there is one), as counted."""
        n_rows = int(x_shape[0]) * self.src.rows
        me = self.comm.rank
        (r0, r1), (c0, c1) = self.dst.block(me, n_rows, self.features)
        out = (r1 - r0, c1 - c0)
        sent = 0
        for forward in (True, False):
            comm_needed, move = self._plan(n_rows, forward)
            if comm_needed:
                sent += sum(_size(r) for q, rects in enumerate(move.sends) if q != me
                            for r in rects) * self.dtype.itemsize
        if self._exchanges_rows():
            sent += 8 * (self.comm.size - 1)         # allgather_scalars of one float64
        nx, ny = backend.nbytes(x_shape, self.dtype), backend.nbytes(out, self.dtype)
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=out, flops_fwd=0,
                         flops_bwd=0, bytes_x=nx, bytes_y=ny, bytes_cache=0, bytes_params=0,
                         comm_bytes=sent)



# -- the Linear ------------------------------------------------------------------------------------
class LayoutParameter(Parameter):
    """A Parameter holding the block ``rows`` x ``cols`` ([start, stop) pairs; ``cols`` None for
    a vector) of the full array ``full_shape``; ``owner`` marks the one copy of each block that
    :func:`gather_full` counts. It has no ``tp_axis``: the tensor-parallel checkpoint and
    gradient-norm code, which read one cut axis, do not apply to two-axis blocks (``hpcnn train
    --plan`` refuses --clip, --checkpoint and --resume for now)."""

    __slots__ = ("rows", "cols", "full_shape", "owner")

    def __init__(self, data, name, rows, cols, full_shape, owner):
        super().__init__(data, name)
        self.rows, self.cols, self.full_shape = rows, cols, tuple(full_shape)
        self.owner = bool(owner)



class LayoutLinearCache(NamedTuple):
    """The input part x[b-part, k-part] (the weight gradient is x^T dy)."""
    x: Any



class _Groups:
    """The three groups of a device under a cut, as Communicators sharing ``comm``'s stats:
    ``reduce`` (devices varying in k: the partial sums), ``batch`` (varying in b: the weight
    gradients), ``out`` (varying in j: the input gradients). A group of one device is a
    one-rank Communicator; the others are built with ``Comm.Split`` (collective)."""

    def __init__(self, comm, cut: Cut, name: str):
        from hpcnn.parallel.collectives import Communicator
        p = comm.size
        shape = (cut.replicas(p), cut.batch, cut.reduce, cut.out)
        coords = cut.coords(comm.rank, p)
        for label, axis in (("batch", 1), ("reduce", 2), ("out", 3)):
            if shape[axis] == 1:
                g = Communicator.single(f"{name}.{label}", stats=comm.stats)
            else:
                rest = [c for a, c in enumerate(coords) if a != axis]
                color = int(numpy.ravel_multi_index(rest, [s for a, s in enumerate(shape)
                                                           if a != axis]))
                g = Communicator(comm.comm.Split(color=color, key=coords[axis]),
                                 stats=comm.stats, name=f"{name}.{label}")
            setattr(self, label, g)

    def free(self) -> None:
        """Free the MPI sub-communicators (collective over the parent, like their Split)."""
        for label in ("batch", "reduce", "out"):
            g = getattr(self, label)
            if g.size > 1:
                g.comm.Free()



class LayoutLinear(Block):
    """A Linear (n_in -> n_out) laid out by ``cut`` over the ranks of ``comm``.

    Holds W[k-part, j-part] and b[j-part], cut from the serial Linear's initial values (same
    ``seed``/``index`` keys, so every layout starts from the same weights). forward: x[b-part,
    k-part] -> y[b-part, j-part] (partial products allreduced over the reduce group, then + b).
    backward: dW, db allreduced over the batch group (one buffer), dx = dy W^T allreduced over
    the out group. Cache: :class:`LayoutLinearCache`.
    """

    def __init__(self, n_in, n_out, cut: Cut, comm, *, seed=0, index=0, init_std=None,
                 dtype=backend.DEFAULT_DTYPE, name="linear", keep=None):
        super().__init__()
        if not isinstance(cut, Cut):
            raise ValueError(f"{name}: cut must be a Cut, got {cut!r}")
        cut.replicas(comm.size)                          # every rank raises the same, first
        for what, n, parts in (("input", n_in, cut.reduce), ("output", n_out, cut.out)):
            if parts > n:
                raise ValueError(f"{name}: {cut} cuts {n} {what} features in {parts} parts")
        self.name, self.n_in, self.n_out = name, int(n_in), int(n_out)
        self.cut, self.comm, self.dtype = cut, comm, backend.dtype_of(dtype)
        rep, b, k, j = cut.coords(comm.rank, comm.size)
        full = Linear(n_in, n_out, seed=seed, index=index, init_std=init_std, dtype=dtype,
                      name=name, keep=keep)              # the serial initialisation
        self.rows, self.cols = part_range(n_in, cut.reduce, k), part_range(n_out, cut.out, j)
        (r0, r1), (c0, c1) = self.rows, self.cols
        self.weight = LayoutParameter(_block(full.weight.data, (slice(r0, r1), slice(c0, c1))),
                                      full.weight.name, self.rows, self.cols, (n_in, n_out),
                                      owner=rep == 0 and b == 0)
        self.bias = LayoutParameter(_block(full.bias.data, (slice(c0, c1),)), full.bias.name,
                                    self.cols, None, (n_out,), owner=rep == 0 and b == 0 and k == 0)
        self.params = [self.weight, self.bias]
        self.groups = _Groups(comm, cut, name)

    def forward(self, x):
        if x.ndim != 2 or x.shape[1] != self.rows[1] - self.rows[0]:
            raise ValueError(f"{self.name}: input part of shape {tuple(x.shape)}, expected "
                             f"(rows, {self.rows[1] - self.rows[0]}) under {self.cut}")
        y = backend.xp.matmul(x, self.weight.data)           # partial over the reduce group
        self.groups.reduce.allreduce(y)
        y += self.bias.data                                  # once, after the sum
        return y, LayoutLinearCache(x=x)

    def backward(self, dy, cache):
        """From y = x W + b, y summed over the reduce group: dW = x^T dy and db = sum_rows dy,
        summed over the batch group (the batch parts); dx = dy W^T, summed over the out group
        (x was read by every j part)."""
        xp = backend.xp
        nw = self.weight.size
        flat = xp.empty(nw + self.bias.size, dtype=dy.dtype)   # [dW | db] partial over batch
        xp.matmul(cache.x.T, dy, out=flat[:nw].reshape(self.weight.shape))
        flat[nw:] = dy.sum(axis=0)
        self.groups.batch.allreduce(flat)
        self.weight.add_grad(flat[:nw].reshape(self.weight.shape))
        self.bias.add_grad(flat[nw:])
        dx = xp.matmul(dy, self.weight.data.T)               # partial over the out group
        return self.groups.out.allreduce(dx)

    def spec(self, x_shape):
        n = int(x_shape[0])
        kw, jw = self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]
        mm = 2.0 * n * kw * jw
        it = self.dtype.itemsize
        g = self.groups

        def ar(group, nbytes):
            return 2 * (group.size - 1) * nbytes // group.size

        comm = (ar(g.reduce, n * jw * it) + ar(g.batch, (kw * jw + jw) * it)
                + ar(g.out, n * kw * it))
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=(n, jw),
                         flops_fwd=mm + n * jw, flops_bwd=2 * mm + n * jw,
                         bytes_x=n * kw * it, bytes_y=n * jw * it, bytes_cache=n * kw * it,
                         bytes_params=(kw * jw + jw) * it, comm_bytes=comm, cache_has_x=True)



def free_layout(model) -> None:
    """Free the sub-communicators of every :class:`LayoutLinear` of ``model`` (a Chain): call
    on every rank when the model is no longer used."""
    for block in model.blocks:
        if isinstance(block, LayoutLinear):
            block.groups.free()



def _block(full, index):
    """A contiguous copy of ``full[index]`` (a placeholder stays a placeholder)."""
    if is_placeholder(full):
        return placeholder(full[index].shape, full.dtype)
    return backend.xp.ascontiguousarray(full[index])



def gather_full(params, comm, *, grads: bool = False) -> dict:
    """name -> full host array of every :class:`LayoutParameter` (``grads``: their gradients):
    each array's one ``owner`` copy of each block is summed into zeros by one allreduce per
    parameter over ``comm`` (collective: every rank calls it with the same parameters)."""
    out = {}
    for p in params:
        full = numpy.zeros(p.full_shape, dtype=p.data.dtype)
        if p.owner:
            src = backend.to_host(p.grad if grads else p.data)
            idx = (slice(*p.rows),) if p.cols is None else (slice(*p.rows), slice(*p.cols))
            full[idx] = src
        comm.allreduce(full)
        out[p.name] = full
    return out



# -- a whole MLP -----------------------------------------------------------------------------------
def layout_mlp(n_in, hidden, n_out, cuts, comm, *, seed=0, dtype=backend.DEFAULT_DTYPE,
               keep=None) -> Chain:
    """:func:`hpcnn.nn.models.mlp` (ReLU) with Linear i laid out by ``cuts[i]``.

    Blocks: Redistribute(full -> input of cut 0), then per layer LayoutLinear [+ ReLU] and a
    Redistribute to the next layer's input where the placements differ, last a Redistribute
    of the logits to every device (full) and the serial SoftmaxCrossEntropy, computed the same
    on every rank: the simplest exact loss (its cost: an all-gather of the logits, which are
    narrow). ``chain.forward(x, targets)`` takes the full batch on every rank. Same parameters,
    names and initial values as the serial model, so the loss and the gathered gradients
    (:func:`gather_full`) equal the serial ones.
    """
    dims = [int(n_in), *[int(h) for h in hidden], int(n_out)]
    cuts = list(cuts)
    if len(cuts) != len(dims) - 1:
        raise ValueError(f"layout_mlp: {len(cuts)} cuts for {len(dims) - 1} Linear layers "
                         f"({dims})")
    p = comm.size
    for i, c in enumerate(cuts):
        if not isinstance(c, Cut):
            raise ValueError(f"layout_mlp: cut {i} must be a Cut, got {c!r}")
        c.replicas(p)
    blocks, place = [], Placement.full(p)
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        want = Placement.input_of(cuts[i], p)
        if want != place:
            blocks.append(Redistribute(place, want, a, comm, dtype=dtype, name=f"to_fc{i}"))
        last = i == len(dims) - 2
        blocks.append(LayoutLinear(a, b, cuts[i], comm, seed=seed, index=2 * i, dtype=dtype,
                                   init_std=None if last else (2.0 / a) ** 0.5,
                                   name=f"fc{i}", keep=keep))
        if not last:
            blocks.append(ReLU(dtype=dtype))
        place = Placement.output_of(cuts[i], p)
    if place != Placement.full(p):
        blocks.append(Redistribute(place, Placement.full(p), dims[-1], comm, dtype=dtype,
                                   name="to_loss"))
    return Chain(blocks, SoftmaxCrossEntropy(), name="layout_mlp")
