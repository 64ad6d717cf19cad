"""Per-layer layouts of a chain of Linear (+ elementwise) blocks over p devices, and the
redistributions between neighbours whose layouts differ.

A layout of one Linear y[b, j] = sum_k x[b, k] W[k, j] is ``Cut(batch=nb, reduce=nk, out=nj)``
(the planner's convention, docs/architecture.md): nb * nk * nj divides p, the remaining factor
r = p / (nb nk nj) replicates. Device d has coordinates ``(r_, b, k, j) =
numpy.unravel_index(d, (r, nb, nk, nj))``; it holds W[k-part, j-part] and the bias j-part, reads
x[b-part, k-part] and computes y[b-part, j-part], the partial products summed over the nk devices
sharing (r_, b, j). Parts are ``numpy.array_split``-style. Data parallelism is Cut(p, 1, 1),
Megatron's column layer Cut(1, 1, p), its row layer Cut(1, p, 1). :func:`layout_mlp` builds an
MLP from a list of cuts (or a plan file, :func:`read_plan`).

Gradient convention (that of :mod:`~hpcnn.parallel.tp_comm`): every copy of a replicated
activation, and of its gradient, holds the full value, so each backward is the conjugate of its
forward: :class:`LayoutLinear` allreduces y over nk forward, dx over nj and dW, db over nb
backward; :class:`Redistribute` (A -> B) fetches each device's B part in one ``alltoallv`` and
moves the gradient B -> A the same way; ReLU, GELU are local.

Bytes of a redistribution: each device t fetches the part of its target rectangle ``need_t`` it
does not hold itself (ties spread over the replicas), in one ``alltoallv``. Summed over the p
ranks, one move sends

    itemsize * sum_t (|need_t| - |need_t intersect have_t|)        (elements of rectangles)

and rank t receives its own term; a backward swaps source and target. When the source cuts the
batch into parts that the target does not, one ``allgather_scalars`` of one float64 per rank
(8 (p-1) bytes counted) finds the full batch size first.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.collectives import Communicator; from hpcnn.parallel.layout import \\
        Cut, layout_mlp; c = Communicator(MPI.COMM_WORLD); m = layout_mlp(6, [8], 3, \\
        [Cut(2, 1, 1), Cut(1, 1, 2)], c, seed=0, dtype=np.float64); \\
        x = np.arange(24.).reshape(4, 6) / 10; print(m.forward(x, np.arange(4) % 3)[0])"
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy

from hpcnn import backend
from hpcnn.nn.chain import Chain
from hpcnn.nn.core import Block, BlockSpec, Parameter, is_placeholder, placeholder
from hpcnn.nn.layers import Linear, ReLU
from hpcnn.nn.loss import SoftmaxCrossEntropy

AXES = ("batch", "reduce", "out")


@dataclass(frozen=True)
class Cut:
    """How one Linear is laid out: the batch in ``batch`` parts, the input features (the
    reduction) in ``reduce`` parts, the output features in ``out`` parts (integers >= 1)."""

    batch: int = 1
    reduce: int = 1
    out: int = 1

    def __post_init__(self):
        for name in AXES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, numpy.integer)) or v < 1:
                raise ValueError(f"Cut: {name} must be an integer >= 1, got {v!r}")

    @property
    def parts(self) -> int:
        return int(self.batch * self.reduce * self.out)

    def replicas(self, p: int) -> int:
        """r = p / (batch reduce out), or ValueError naming the values if that is no integer."""
        if p % self.parts:
            raise ValueError(f"{self}: batch * reduce * out = {self.batch} * {self.reduce} * "
                             f"{self.out} = {self.parts} does not divide the {p} devices")
        return p // self.parts

    def coords(self, d: int, p: int) -> tuple:
        """(r_, b, k, j) of device ``d``."""
        return tuple(int(c) for c in numpy.unravel_index(
            d, (self.replicas(p), self.batch, self.reduce, self.out)))

    def __str__(self) -> str:
        return f"Cut(batch={self.batch}, reduce={self.reduce}, out={self.out})"


def write_plan(path, cuts, devices: int) -> None:
    """Write the JSON plan file :func:`read_plan` reads: ``devices`` and one Cut per Linear."""
    with open(path, "w") as f:
        json.dump({"devices": int(devices),
                   "layers": [{axis: getattr(c, axis) for axis in AXES} for c in cuts]}, f)


def read_plan(path, devices: int | None = None) -> list:
    """The list of :class:`Cut` (one per Linear, chain order) of a JSON plan file
    ``{"devices": p, "layers": [{"batch": nb, "reduce": nk, "out": nj}, ...]}``; ValueError
    naming the file and the values on bad input (every cut must fit ``devices``; with
    ``devices`` given, e.g. the communicator's size, the file's must equal it)."""
    with open(path) as f:
        try:
            plan = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(plan, dict) or "devices" not in plan or "layers" not in plan:
        raise ValueError(f"{path}: a plan is {{\"devices\": p, \"layers\": [...]}}, got "
                         f"{plan if not isinstance(plan, dict) else sorted(plan)!r}")
    p = plan["devices"]
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"{path}: devices must be an integer >= 1, got {p!r}")
    if devices is not None and p != devices:
        raise ValueError(f"{path}: a plan for {p} devices, run on {devices}")
    layers = plan["layers"]
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{path}: layers must be a non-empty list, got {layers!r}")
    cuts = []
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict) or set(entry) - set(AXES):
            raise ValueError(f"{path}: layer {i} must be an object with keys among {AXES}, "
                             f"got {entry!r}")
        try:
            cut = Cut(**entry)
            cut.replicas(p)
        except ValueError as e:
            raise ValueError(f"{path}: layer {i}: {e}") from None
        cuts.append(cut)
    return cuts


# -- where each device's part lies ----------------------------------------------------------------
def part_range(n: int, parts: int, i: int) -> tuple:
    """[start, stop) of part ``i`` of ``n`` items cut in ``parts`` (numpy.array_split sizes)."""
    q, m = divmod(int(n), int(parts))
    start = i * q + min(i, m)
    return start, start + q + (1 if i < m else 0)


@dataclass(frozen=True)
class Placement:
    """Which part of a 2-D activation (rows = batch, cols = features) each of p devices holds:
    device d holds row part ``row_of[d]`` of ``rows`` and column part ``col_of[d]`` of ``cols``
    (the devices with the same pair hold copies)."""

    rows: int
    cols: int
    row_of: tuple
    col_of: tuple

    @property
    def p(self) -> int:
        return len(self.row_of)

    @staticmethod
    def full(p: int) -> "Placement":
        """Every device holds the whole activation."""
        return Placement(1, 1, (0,) * p, (0,) * p)

    @staticmethod
    @lru_cache(maxsize=1024)        # pure: the planner asks for the same cuts many times
    def input_of(cut: Cut, p: int) -> "Placement":
        """x[b-part, k-part] of a Linear laid out by ``cut``."""
        c = [cut.coords(d, p) for d in range(p)]
        return Placement(cut.batch, cut.reduce, tuple(x[1] for x in c), tuple(x[2] for x in c))

    @staticmethod
    @lru_cache(maxsize=1024)
    def output_of(cut: Cut, p: int) -> "Placement":
        """y[b-part, j-part] of a Linear laid out by ``cut``."""
        c = [cut.coords(d, p) for d in range(p)]
        return Placement(cut.batch, cut.out, tuple(x[1] for x in c), tuple(x[3] for x in c))

    def block(self, d: int, n_rows: int, n_cols: int) -> tuple:
        """((r0, r1), (c0, c1)): the rectangle device ``d`` holds."""
        return (part_range(n_rows, self.rows, self.row_of[d]),
                part_range(n_cols, self.cols, self.col_of[d]))

    def same_rows(self, other: "Placement") -> bool:
        return self.rows == other.rows and self.row_of == other.row_of


def _overlap(a, b):
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def moved_elements(src: Placement, dst: Placement, n_rows: int, n_cols: int) -> list:
    """Elements each device receives when ``dst`` is made from ``src``: |need_t| minus
    |need_t intersect have_t| (the documented byte formula, before the itemsize)."""
    out = []
    for t in range(src.p):
        (r0, r1), (c0, c1) = dst.block(t, n_rows, n_cols)
        have = src.block(t, n_rows, n_cols)
        ro, co = _overlap((r0, r1), have[0]), _overlap((c0, c1), have[1])
        kept = (ro[1] - ro[0]) * (co[1] - co[0]) if ro and co else 0
        out.append((r1 - r0) * (c1 - c0) - kept)
    return out


class _Move(NamedTuple):
    """One device's part of a redistribution: pieces as (peer, rows, cols) in global indices."""
    sends: list          # per peer q: the rectangles this device sends to q, in order
    recvs: list          # per peer q: the rectangles this device receives from q, in order
    have: tuple          # this device's source rectangle
    need: tuple          # this device's target rectangle


def _pieces(src: Placement, dst: Placement, n_rows: int, n_cols: int):
    """(source device, target device, rows, cols) of every piece of a redistribution, targets
    in rank order: for each source block overlapping a target's need, the piece comes from the
    target itself if it holds that block, else from the holder of least d XOR t, the one
    inside the smallest aligned group of consecutive devices holding both (the machine's
    bisections, :func:`hpcnn.plan.cost._level`), which keeps the devices a move joins few:
    gathering the column halves of a 2 x 2 grid links the pairs (0, 1) and (2, 3) rather
    than all four (:func:`exchange_group`)."""
    holders = {}
    for d in range(src.p):
        holders.setdefault((src.row_of[d], src.col_of[d]), []).append(d)
    for t in range(src.p):
        need = dst.block(t, n_rows, n_cols)
        for (i, j), hs in sorted(holders.items()):
            rows = _overlap(need[0], part_range(n_rows, src.rows, i))
            cols = _overlap(need[1], part_range(n_cols, src.cols, j))
            if rows is not None and cols is not None:
                yield (t if t in hs else min(hs, key=lambda d: d ^ t)), t, rows, cols


def plan_move(src: Placement, dst: Placement, n_rows: int, n_cols: int, me: int) -> _Move:
    """Who sends what to whom so that every device gets its ``dst`` rectangle.

    Every rank computes the same plan from the placements alone (:func:`_pieces`)."""
    sends, recvs = [[] for _ in range(src.p)], [[] for _ in range(src.p)]
    for s, t, rows, cols in _pieces(src, dst, n_rows, n_cols):
        if s == me:
            sends[t].append((rows, cols))
        if t == me:
            recvs[s].append((rows, cols))
    return _Move(sends, recvs, src.block(me, n_rows, n_cols), dst.block(me, n_rows, n_cols))


@lru_cache(maxsize=4096)            # pure, and asked again for every plan a search prices
def exchange_group(src: Placement, dst: Placement, n_rows: int, n_cols: int) -> int:
    """Devices in the largest set that a redistribution's messages join (1 where none
    crosses): the connected components of the graph whose edges are the pieces one device
    sends another. The alltoallv of :func:`run_move` posts no message where a count is zero,
    so a device waits only for the devices of its set (a gather along pairs joins 2, not p)."""
    root = list(range(src.p))

    def find(d):
        while root[d] != d:
            root[d] = root[root[d]]
            d = root[d]
        return d
    for s, t, _, _ in _pieces(src, dst, n_rows, n_cols):
        if s != t:
            root[find(s)] = find(t)
    return max(Counter(find(d) for d in range(src.p)).values())


def _size(rect) -> int:
    (r0, r1), (c0, c1) = rect
    return (r1 - r0) * (c1 - c0)


def _local(rect, origin):
    """Slices of global rectangle ``rect`` inside an array whose [0, 0] is ``origin``."""
    (r0, r1), (c0, c1) = rect
    return slice(r0 - origin[0][0], r1 - origin[0][0]), slice(c0 - origin[1][0], c1 - origin[1][0])


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


@lru_cache(maxsize=4096)            # pure, and asked again for every plan a search prices
def crosses(src: Placement, dst: Placement, n_rows: int, n_cols: int) -> bool:
    """True if some device needs data it does not hold (the same answer on every rank)."""
    return any(moved_elements(src, dst, n_rows, n_cols))


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


def part_size(placement: Placement, d: int, features: int) -> int:
    c0, c1 = placement.block(d, 1, features)[1]
    return c1 - c0


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
