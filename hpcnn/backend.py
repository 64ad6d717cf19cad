"""Array backend: ``xp`` is NumPy or CuPy, chosen once per process.

The device comes from :func:`set_device` (called by the training loop from the config) or, before
that, from the ``HPCNN_DEVICE`` environment variable (``cpu``, ``gpu`` or ``strict``; default
``cpu``). ``strict`` is NumPy behind a GPU's rules (:mod:`hpcnn.strict`): an implicit copy of a
device array to host memory is refused, naming the call site, and every transfer and
synchronisation is counted (:func:`strict_stats`). Layer
code imports the module and uses ``backend.xp`` so that the choice made at start-up is seen
everywhere::

    from hpcnn import backend
    y = backend.xp.matmul(x, w)

MPI moves host memory unless the library is CUDA-aware; :func:`to_host` / :func:`to_device` stage
arrays across, and :func:`sync` synchronises the CuPy stream before an MPI call reads a buffer.
On a CPU-only machine the tests run the NumPy and the strict paths; the CuPy path is kept correct
by the strict one (the same code, every array operation through ``xp``).
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager

import numpy

from hpcnn import strict as _strict

xp = numpy
device = "cpu"
DEFAULT_DTYPE = numpy.float32   # training dtype; float64 for gradient checks and exactness tests

_DEVICES = ("cpu", "gpu", "strict")


class DeviceBufferError(TypeError):
    """A device array handed to an MPI that cannot read device memory (not staged)."""


def set_device(name: str | None = None) -> str:
    """Select NumPy (``"cpu"``), CuPy (``"gpu"``) or the strict device arrays (``"strict"``,
    :mod:`hpcnn.strict`); ``None`` reads ``HPCNN_DEVICE``."""
    global xp, device
    name = (name or os.environ.get("HPCNN_DEVICE") or "cpu").lower()
    if name not in _DEVICES:
        raise ValueError(f"unknown device {name!r}; expected one of {_DEVICES}")
    if name == "gpu":
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - needs a GPU machine
            raise RuntimeError("device 'gpu' needs CuPy: pip install 'hpcnn[gpu]'") from e
        xp = cupy
    elif name == "strict":
        xp = _strict
    else:
        xp = numpy
    device = name
    return device


def dtype_of(name) -> numpy.dtype:
    """``"float32"``/``"float64"`` (or a dtype; also the 16-bit storage formats ``float16`` and
    ``bfloat16`` of mixed precision, :mod:`hpcnn.nn.precision`) -> a floating NumPy dtype,
    checked."""
    if isinstance(name, str) and name == "bfloat16":
        import ml_dtypes
        name = ml_dtypes.bfloat16
    dt = numpy.dtype(name)
    if dt not in (numpy.float32, numpy.float64) and not is_narrow(dt):
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    return dt


def is_narrow(dtype) -> bool:
    """True for a 16-bit floating storage dtype (float16, or ml_dtypes' bfloat16)."""
    dt = numpy.dtype(dtype)
    return dt.itemsize == 2 and (dt == numpy.float16 or dt.name == "bfloat16")


def bits(a):
    """``a`` as MPI can copy it: a 16-bit array as its bits (uint16: MPI has no bfloat16, nor
    a standard float16), any other array itself. For copies only (broadcasts, gathers)."""
    return a.view(numpy.uint16) if a.dtype.itemsize == 2 else a


def compute_dtype(dtype) -> numpy.dtype:
    """The dtype arithmetic on arrays of ``dtype`` runs in: float32 for a 16-bit storage dtype
    (NumPy has no fast 16-bit GEMM), else ``dtype`` itself. Gradients of parameters are kept
    in it (Megatron's ``main_grad``)."""
    dt = numpy.dtype(dtype)
    return numpy.dtype(numpy.float32) if is_narrow(dt) else dt


def square_sum(a) -> float:
    """The sum of squares of the flat array ``a``: one BLAS pass, no temporary; inf or nan,
    without a warning, where it overflows or ``a`` is not finite."""
    with numpy.errstate(over="ignore", invalid="ignore"):
        return float(to_host(xp.dot(a, a)))         # a device scalar: a counted transfer


def finite(a, sq: float) -> bool:
    """Whether every entry of ``a`` is finite, given ``sq`` = :func:`square_sum` of it: at once
    when ``sq`` is finite, else element by element (the sum may only have overflowed)."""
    return math.isfinite(sq) or bool(to_host(xp.isfinite(a).all()))


def up(a):
    """``a`` in its compute dtype (:func:`compute_dtype`): a float32 copy of a 16-bit array;
    ``a`` itself otherwise (no copy: the float32 and float64 paths are unchanged)."""
    return a.astype(numpy.float32) if is_narrow(a.dtype) else a


def matmul(a, b, out=None):
    """``a @ b`` of 2-D arrays in their compute dtype (:func:`compute_dtype`): on NumPy and the
    strict backend the 16-bit operands upcast (:func:`up`) and a float32 product; on CuPy
    two float16 operands go to cuBLAS as they are, ``cublasGemmEx`` with 16-bit inputs, a
    float32 result and ``CUBLAS_COMPUTE_32F``: tensor cores accumulating in float32, the same
    arithmetic as the upcast product (float16 x float16 is exact in float32) without the
    copies. ``out``: a C-contiguous array of the result's shape and compute dtype."""
    if device == "gpu" and a.dtype == b.dtype == numpy.float16:   # pragma: no cover - CuPy
        return _gemm16(a, b, out)
    a, b = up(a), up(b)
    return xp.matmul(a, b) if out is None else xp.matmul(a, b, out=out)


def gemm_operand(shape, c_contiguous: bool, f_contiguous: bool):
    """How cuBLAS (column-major) reads a 2-D row-major operand of ``shape`` (r, c) as the
    transpose it needs (C^T = B^T A^T): ``("N", c)`` for a C-contiguous array (its memory is
    the column-major (c, r) matrix), ``("T", r)`` for an F-contiguous one (a transposed view),
    None for any other (copy it first). Returns (operation, leading dimension)."""
    r, c = shape
    if c_contiguous:
        return "N", max(c, 1)
    if f_contiguous:
        return "T", max(r, 1)
    return None


def _gemm16(a, b, out=None):  # pragma: no cover - CuPy: not run on the machines it was written on
    """C = A B for float16 A (m, k), B (k, n): ``cublasGemmEx`` with a float32 C and
    ``CUBLAS_COMPUTE_32F`` on CuPy's current stream (see :func:`matmul`)."""
    from cupy.cuda import device as cuda_device
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas
    (m, k), n = a.shape, b.shape[1]
    c = out if out is not None else xp.empty((m, n), numpy.float32)
    ops = []
    for x in (b, a):                                   # C^T (n, m) = B^T (n, k) A^T (k, m)
        plan = gemm_operand(x.shape, x.flags.c_contiguous, x.flags.f_contiguous)
        if plan is None:
            x = xp.ascontiguousarray(x)
            plan = gemm_operand(x.shape, True, False)
        ops.append((x, cublas.CUBLAS_OP_N if plan[0] == "N" else cublas.CUBLAS_OP_T, plan[1]))
    (bx, opb, ldb), (ax, opa, lda) = ops
    one, zero = numpy.array(1.0, numpy.float32), numpy.array(0.0, numpy.float32)
    cublas.gemmEx(cuda_device.get_cublas_handle(), opb, opa, n, m, k, one.ctypes.data,
                  bx.data.ptr, runtime.CUDA_R_16F, ldb, ax.data.ptr, runtime.CUDA_R_16F, lda,
                  zero.ctypes.data, c.data.ptr, runtime.CUDA_R_32F, max(n, 1),
                  cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)
    return c


def down(a, dtype):
    """``a`` stored as ``dtype``: rounded to nearest (even) when ``dtype`` is narrower; ``a``
    itself when it already has that dtype."""
    return a if a.dtype == dtype else a.astype(dtype)


def asarray(a, dtype=None):
    """Host or device array -> an array of the current backend (copies host data to the device)."""
    return xp.asarray(a, dtype=dtype)


def to_host(a):
    """Any backend array -> a NumPy array (no copy on the CPU; a 0-d array for a device
    scalar). A sanctioned transfer: counted under the strict backend."""
    if isinstance(a, numpy.ndarray) or numpy.isscalar(a):
        return a
    return a.get()


def lazy(a, kind=float):
    """A scalar result ``a`` (a 0-d array) as the step keeps it: on NumPy ``kind(a)``, a Python
    number; on a device the 0-d device array itself, read at a sanctioned point (the log flush:
    :func:`to_host`) instead of a host round-trip where it is made."""
    return kind(a) if xp is numpy else a


def to_device(a):
    """NumPy array -> the backend's array (no copy on the CPU)."""
    return xp.asarray(a)


def sync() -> None:
    """Wait for queued device work, so that an MPI call sees finished buffers (no-op on CPU;
    counted under the strict backend)."""
    if xp is _strict:
        _strict.STATS["sync"] += 1
    elif xp is not numpy:  # pragma: no cover - CuPy
        xp.cuda.get_current_stream().synchronize()


@contextmanager
def host_ok():
    """A sanctioned transfer point (the log flush, evaluation results): inside it the strict
    backend lets ``float()``, ``int()``, ``numpy.asarray`` ... copy device arrays to the host,
    counting each; elsewhere it refuses them. No effect on the other devices."""
    _strict._allowed[0] += 1
    try:
        yield
    finally:
        _strict._allowed[0] -= 1


def strict_stats(reset: bool = False) -> dict:
    """The strict backend's counts: ``to_host`` (device-to-host transfers), ``to_host_bytes``,
    ``to_device``, ``to_device_bytes`` (host-to-device), ``sync``, ``host_ok`` (implicit
    conversions allowed inside :func:`host_ok`, also counted under ``to_host``); zeroed after
    reading with ``reset=True``."""
    out = dict(_strict.STATS)
    if reset:
        for k in _strict.STATS:
            _strict.STATS[k] = 0
    return out


def nbytes(shape, dtype) -> int:
    """Bytes of an array of ``shape`` and ``dtype`` (used by ``spec()``)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * numpy.dtype(dtype).itemsize


set_device()


def keep_mask(key, row0: int, shape, p: float, dtype):
    """Dropout's scaled keep mask, ``(u >= p) / (1 - p)`` in ``dtype``: rows ``row0 ..
    row0 + shape[0]`` of an unbounded array of rows of ``shape[1:]`` whose elements are
    independent 64-bit draws of a generator keyed by the integer tuple ``key``.

    Counter-based: the same key gives the same numbers, so a block that keys its draws by (seed,
    call counter) reproduces them when the counter is restored (rematerialization); and a row's
    numbers depend only on its index, so any split of a batch into row ranges (data-parallel
    shards, micro-batches) draws exactly the rows the whole batch would. The generator (PCG64)
    jumps to element ``row0 * prod(shape[1:])`` with ``advance``; an element is kept iff its
    draw is >= round(p * 2**64). Drawn on the host (NumPy), then moved to the device.
    """
    row = 1
    for d in shape[1:]:
        row *= int(d)
    gen = numpy.random.PCG64(numpy.random.SeedSequence([int(k) for k in key]))
    gen.advance(int(row0) * row)
    raw = gen.random_raw(int(shape[0]) * row).reshape(tuple(shape))
    keep = raw >= numpy.uint64(min(int(round(float(p) * 2.0 ** 64)), 2 ** 64 - 1))
    mask = numpy.multiply(keep, numpy.dtype(dtype).type(1.0 / (1.0 - p)), dtype=dtype)
    return mask if xp is numpy else xp.asarray(mask)


def tune_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep freed large host arrays in the heap instead of returning them to the OS (glibc).

    A training step frees and re-allocates the same temporaries every step; with glibc's defaults
    arrays above its dynamic mmap threshold are unmapped when freed and page-fault back in at the
    next step (measured: ~12k faults, ~27 ms of a 160 ms GPT-tiny step). Raising the mmap and trim
    thresholds (32 MiB is glibc's maximum mmap threshold on 64-bit) removes that. Called by the
    training loop, never at import; returns False where there is no glibc (nothing changed).
    """
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, int(mmap_threshold))) and \
            bool(libc.mallopt(m_trim_threshold, int(trim_threshold)))
    except (OSError, AttributeError):
        return False


def axpy(alpha: float, x, y) -> None:
    """y += alpha * x in place, in one pass where a BLAS axpy applies (contiguous NumPy arrays of
    the same float dtype); otherwise through a temporary. Used by the optimizers' updates.
    The strict backend runs NumPy's kernel on the arrays inside (its results are NumPy's)."""
    if xp is _strict:
        x, y = _strict.unwrap(x), _strict.unwrap(y)
    if (isinstance(y, numpy.ndarray) and x.dtype == y.dtype
            and x.dtype in (numpy.float32, numpy.float64)
            and x.flags.c_contiguous and y.flags.c_contiguous and x.size == y.size):
        from scipy.linalg import blas
        fn = blas.saxpy if x.dtype == numpy.float32 else blas.daxpy
        fn(x.reshape(-1), y.reshape(-1), a=alpha)      # writes into y's memory (intent in,out)
        return
    y += alpha * x


def blas_threads() -> int:
    """The threads each BLAS or OpenMP pool loaded in this process may use (the largest):
    threadpoolctl's count if it is installed, else ``OMP_NUM_THREADS``,
    ``OPENBLAS_NUM_THREADS`` or ``MKL_NUM_THREADS`` if set, else this process's cores (what
    OpenBLAS and OpenMP start by default)."""
    try:
        from threadpoolctl import threadpool_info
        counts = [int(p.get("num_threads") or 1) for p in threadpool_info()]
        if counts:
            return max(counts)
    except ImportError:
        pass
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        value = os.environ.get(key, "").split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return len(os.sched_getaffinity(0))
