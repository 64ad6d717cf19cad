"""A GEMM's seconds from a roofline: published GEMM rates by shape and the memory bandwidth.

A machine file's ``[device.gemm]`` table (:class:`hpcnn.plan.machine.Device`) lists, per dtype,
published GEMM benchmark figures as points ``[m, n, k, flop_per_s]``: the rate a kernel library
reached on an (m x k) @ (k x n) product, each with its source in the file. A GEMM of another
shape (:func:`roofline`) runs at the rate of the point nearest it in arithmetic intensity
(in log: the figures are few, and intensity is what separates a GEMM the tensor cores can feed
from one its operands starve), and takes no less than its bytes at the memory bandwidth::

    seconds = max(2 m n k / rate(shape), word (m k + k n + m n) / memory_bandwidth)

(each operand read once, the result written once: the roofline's floor on the traffic). The
intensity 2 m n k / (word (m k + k n + m n)) is symmetric in m, n and k, so a GEMM and the two
of its backward (dA = dC B^T: an m x k result, inner n; dB = A^T dC: a k x n result, inner m)
share it and their bytes (:func:`pass_seconds`).

Where the file also gives the device's **waves** (``[device.waves]``: ``processors``, the
streaming multiprocessors, and ``tile``, the output tile one of them computes at a time), the
rate depends on the shape's result as well: a kernel cuts the m x n result into tiles, runs
them in waves of one tile per processor, and a wave takes as long whether it is full or not
(NVIDIA, *Matrix Multiplication Background User's Guide*, "Tile quantization", "Wave
quantization"). The fraction of the processors' work that is useful (:func:`fill`)::

    fill(m, n, batch) = batch m n / (waves x processors x tile_m x tile_n),
    waves = ceil(batch ceil(m / tile_m) ceil(n / tile_n) / processors)

(the better of the tile and its transpose), and a GEMM runs at its point's rate times
fill(shape) / fill(point): a published rate is that of its own shape's waves.

:func:`block_shapes` gives the GEMMs of one GPT block on one of ``tp`` ranks (Megatron's
split: QKV and the MLP's first GEMM by columns, the two output projections by rows), the
attention core's batched ones per head (:func:`core_shapes`), and the LM head's (:func:`head_shapes`).
Without a table for the dtype, nothing here is used: the blocks' FLOPs run at the device's
rate and efficiency, as before (:meth:`hpcnn.plan.machine.Device.pass_seconds`).
"""
from __future__ import annotations

import functools
import math

from hpcnn.plan import tables

# Bytes per element of the dtypes a table may list.
WORD = {"float8": 1, "float16": 2, "bfloat16": 2, "tfloat32": 4, "float32": 4, "float64": 8}


def read_table(table, peaks: dict, where: str) -> dict:
    """A ``[device.gemm]`` table checked: dtype -> tuple of (m, n, k, flop_per_s) points, the
    sizes integers >= 1, each rate > 0 and no more than the dtype's peak in ``peaks`` (the
    device's ``flops``; a dtype without a peak cannot be checked and is refused)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: gemm = {table!r}: expected a table dtype -> "
                         "[[m, n, k, flop_per_s], ...]")
    out = {}
    for dtype, points in table.items():
        at = f"{where}: gemm.{dtype}"
        if dtype not in WORD or dtype not in peaks:
            raise ValueError(f"{at}: expected a dtype of {sorted(WORD)} with a peak in "
                             f"[device.flops] (has {', '.join(peaks)})")
        if isinstance(points, (str, bytes)) or not hasattr(points, "__len__") or not points:
            raise ValueError(f"{at} = {points!r}: expected [[m, n, k, flop_per_s], ...]")
        rows = []
        for i, pt in enumerate(points):
            if isinstance(pt, (str, bytes)) or not hasattr(pt, "__len__") or len(pt) != 4:
                raise ValueError(f"{at}[{i}] = {pt!r}: expected [m, n, k, flop_per_s]")
            sizes = pt[:3]
            if not _counts(sizes):
                raise ValueError(f"{at}[{i}] = {list(pt)!r}: m, n, k must be integers >= 1")
            rate = tables.finite_positive(pt[3], f"{at}[{i}] flop_per_s")
            if rate > peaks[dtype]:
                raise ValueError(f"{at}[{i}] flop_per_s = {pt[3]!r}: above the {dtype} peak "
                                 f"{peaks[dtype]!r}")
            rows.append((*sizes, rate))
        out[str(dtype)] = tuple(rows)
    return out


def read_waves(table, where: str) -> tuple:
    """A ``[device.waves]`` table checked: (processors, tile_m, tile_n), each an integer >= 1;
    () for an empty table (no waves: every shape at its point's rate)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: waves = {table!r}: expected a table with processors = "
                         "<integer> and tile = [rows, columns]")
    if not table:
        return ()
    at = f"{where}: waves"
    if set(table) != {"processors", "tile"}:
        raise ValueError(f"{at} has keys {sorted(table)}: expected processors and tile")
    procs, tile = table["processors"], table["tile"]
    if isinstance(tile, (str, bytes)) or not hasattr(tile, "__len__") or len(tile) != 2:
        raise ValueError(f"{at}.tile = {tile!r}: expected [rows, columns]")
    values = (procs, *tile)
    if not _counts(values):
        raise ValueError(f"{at}: processors = {procs!r}, tile = {list(tile)!r}: expected "
                         "integers >= 1")
    return values


def _counts(values) -> bool:
    """Whether every one of ``values`` is an integer >= 1 (not a bool)."""
    return all(not isinstance(x, bool) and isinstance(x, int) and x >= 1 for x in values)


def fill(m: int, n: int, batch: int, waves: tuple) -> float:
    """The useful fraction of the processors' work on ``batch`` m x n results cut into
    ``waves``' tiles (module docstring), the better of the tile and its transpose; 1 without
    waves or without work."""
    if not waves or min(m, n, batch) <= 0:
        return 1.0
    procs, tm, tn = waves
    best = 0.0
    for a, b in ((tm, tn), (tn, tm)):
        tiles = batch * -(-m // a) * -(-n // b)
        best = max(best, batch * m * n / (-(-tiles // procs) * procs * a * b))
    return best


def intensity(m: float, n: float, k: float, word: int) -> float:
    """FLOPs per byte of an (m x k) @ (k x n) GEMM moving each operand and the result once."""
    return 2.0 * m * n * k / (word * (m * k + k * n + m * n))


@functools.lru_cache(maxsize=1 << 16)
def roofline(points: tuple, m: int, n: int, k: int, word: int, bandwidth: float,
             batch: int = 1, waves: tuple = ()) -> float:
    """Seconds of ``batch`` (m x k) @ (k x n) GEMMs: their FLOPs at the rate of the point of
    ``points`` ((m, n, k, flop_per_s), ...) nearest in log arithmetic intensity (the first on a
    tie), times fill(shape) / fill(point) under ``waves`` (:func:`fill`), or their bytes at
    ``bandwidth``, whichever is longer (module docstring). Cached: a plan prices the same
    shapes in many layouts."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    ai = intensity(m, n, k, word)
    pm, pn, pk, rate = min(points, key=lambda p: abs(math.log(intensity(*p[:3], word) / ai)))
    if waves:
        rate *= fill(m, n, batch, waves) / fill(pm, pn, 1, waves)
    return batch * max(2.0 * m * n * k / rate, word * (m * k + k * n + m * n) / bandwidth)


def block_shapes(dim: int, heads: int, seq: int, rows: int, tp: int = 1) -> tuple:
    """The forward GEMMs (m, n, k, batch) of one GPT block on ``rows`` sequences of ``seq``
    tokens as one of ``tp`` ranks runs it: QKV (rows seq x dim by dim x 3 dim / tp), the
    attention core (:func:`core_shapes`), the attention's output projection (dim / tp rows of
    its weight), the MLP's two (4 dim / tp wide; hpcnn's MLP is 4 dim wide). Under sequence
    parallelism the same: its all-gather gives each GEMM the whole sequence."""
    tokens = rows * seq
    return ((tokens, 3 * dim // tp, dim, 1), *core_shapes(dim, heads, seq, rows, tp),
            (tokens, dim, dim // tp, 1), (tokens, 4 * dim // tp, dim, 1),
            (tokens, dim, 4 * dim // tp, 1))


def core_shapes(dim: int, heads: int, seq: int, rows: int, tp: int = 1) -> tuple:
    """The attention core's batched GEMMs, one per sequence and head of the rank's heads / tp:
    the scores Q K^T (seq x head_dim by head_dim x seq) and att V (seq x seq by seq x head_dim)."""
    hd, batch = dim // heads, rows * max(heads // tp, 1)
    return (seq, seq, hd, batch), (seq, hd, seq, batch)


def head_shapes(dim: int, seq: int, rows: int, vocab: int, tp: int = 1) -> tuple:
    """The LM head's GEMM: rows seq x dim by dim x vocab / tp (rounded up)."""
    return ((rows * seq, -(-vocab // tp), dim, 1),)


def pass_seconds(device, dtype: str, shapes: tuple, forward: bool) -> tuple:
    """(seconds, FLOPs) of the GEMMs ``shapes`` (forward shapes, :func:`block_shapes`) in the
    forward pass, or of their two backward GEMMs each (the m x k and k x n results: module
    docstring; twice the forward's FLOPs), on ``device``'s ``gemm`` table for ``dtype`` and its
    ``waves``; (0, 0) where it has none."""
    if dtype not in device.gemm:
        return 0.0, 0.0
    return _pass(device.gemm[dtype], WORD[dtype], device.memory_bandwidth, shapes,
                 device.waves, forward)


@functools.lru_cache(maxsize=1 << 14)
def _pass(points: tuple, word: int, bandwidth: float, shapes: tuple, waves: tuple,
          forward: bool) -> tuple:
    """(seconds, FLOPs) of the forward GEMMs ``shapes``, or of their backward's, on the
    roofline of ``points`` under ``waves``."""
    run = (shapes if forward else
           [g for m, n, k, b in shapes for g in ((m, k, n, b), (k, n, m, b))])
    return (sum(roofline(points, m, n, k, word, bandwidth, b, waves) for m, n, k, b in run),
            sum(2.0 * m * n * k * b for m, n, k, b in run))


def split(device, dtype: str, shapes: tuple, flops: float, forward: bool) -> tuple:
    """(FLOPs left to the device's rate, seconds of the GEMMs ``shapes`` at their roofline):
    ``flops`` (a pass's, as ``spec()`` counts them: the GEMMs' and the element-wise FLOPs
    around them) less the GEMMs' where the device's table prices them (:func:`pass_seconds`)."""
    seconds, gemm_flops = pass_seconds(device, dtype, shapes, forward)
    return max(flops - gemm_flops, 0.0), seconds
