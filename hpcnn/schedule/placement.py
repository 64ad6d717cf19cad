"""Per-layer layouts of a chain of Linear (+ elementwise) blocks over p devices, and the
redistributions between neighbours whose layouts differ.

A layout of one Linear y[b, j] = sum_k x[b, k] W[k, j] is ``Cut(batch=nb, reduce=nk, out=nj)``
(the planner's convention, docs/architecture.md): nb * nk * nj divides p, the remaining factor
r = p / (nb nk nj) replicates. Device d has coordinates ``(r_, b, k, j) =
numpy.unravel_index(d, (r, nb, nk, nj))``; it holds W[k-part, j-part] and the bias j-part, reads
x[b-part, k-part] and computes y[b-part, j-part], the partial products summed over the nk devices
sharing (r_, b, j). Parts are ``numpy.array_split``-style (contiguous, sizes differ by <= 1).
Pure data parallelism is Cut(p, 1, 1), Megatron's column layer Cut(1, 1, p), its row layer
Cut(1, p, 1); every other product is a point of the same space.

Bytes of a redistribution. Each device t fetches the part of its target rectangle ``need_t``
it does not hold itself (from a device that holds it; ties spread over the replicas), in one
``alltoallv`` counted under that name. Summed over the p ranks, one move sends

    itemsize * sum_t (|need_t| - |need_t intersect have_t|)        (elements of rectangles)

whatever replica each piece comes from; rank t *receives* its own term. A backward moves the
gradient with source and target swapped. For a (B, F) activation and parts that divide evenly:
batch rows over p -> every device the whole: each rank receives (B - B/p) F elements forward, 0
backward (a slice; the all-gather's (p-1)/p of the full size); data parallel output Cut(p, 1, 1)
-> Megatron row input Cut(1, p, 1): each rank needs B x F/p and holds B/p x F/p, so receives
(1 - 1/p) B F/p each way (an all-to-all). When the source cuts the batch into parts that the
target does not cut the same way, the full batch size is not known locally: one
``allgather_scalars`` of one float64 per rank (8 (p-1) bytes counted) finds it first.

The MPI side (the blocks that run these moves) is :mod:`hpcnn.parallel.layout`; the planner
(:mod:`hpcnn.plan.cost`) prices the same moves from this module.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy

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



@lru_cache(maxsize=4096)            # pure, and asked again for every plan a search prices
def crosses(src: Placement, dst: Placement, n_rows: int, n_cols: int) -> bool:
    """True if some device needs data it does not hold (the same answer on every rank)."""
    return any(moved_elements(src, dst, n_rows, n_cols))



def part_size(placement: Placement, d: int, features: int) -> int:
    c0, c1 = placement.block(d, 1, features)[1]
    return c1 - c0
