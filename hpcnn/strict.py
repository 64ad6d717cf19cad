"""The strict device backend (``HPCNN_DEVICE=strict``): NumPy underneath, a GPU's rules on top.

:class:`StrictArray` wraps a NumPy array and behaves as a CuPy array does where a GPU would
differ from the host: an implicit copy to host memory is refused with :class:`StrictError`
naming the call site (``float()``, ``int()``, ``bool()``, ``.item()``, ``.tolist()``,
``numpy.asarray``, NumPy functions and ufuncs given it, pickling, host arrays mixed into its
arithmetic). It has no buffer protocol, so a message library cannot read it either: the
collectives stage it (``parallel/collectives/mpi_base.py``) or refuse it by name. The
sanctioned transfers are counted: ``.get()`` and :func:`hpcnn.backend.to_host` (device to
host), :func:`asarray` of host data (host to device),
:func:`hpcnn.backend.sync`; inside ``with backend.host_ok():`` an implicit conversion is
allowed and counted as a transfer. The module itself is the ``xp`` of the backend: the NumPy
functions hpcnn calls, each unwrapping its arguments, calling NumPy and wrapping the arrays it
returns, so results are bit-identical to the NumPy backend's.

Checked on the CPU only: it finds the host round-trips and unstaged MPI buffers a GPU would
meet, not CuPy's own differences (its kernels, its rounding, its missing functions).
"""
from __future__ import annotations

import operator
import os
import sys

import numpy

ndarray = None            # set below: the array type, for isinstance(a, xp.ndarray)
inf, nan, pi, newaxis = numpy.inf, numpy.nan, numpy.pi, numpy.newaxis

STATS = {"to_host": 0, "to_host_bytes": 0, "to_device": 0, "to_device_bytes": 0, "sync": 0,
         "host_ok": 0}
_allowed = [0]            # depth of backend.host_ok() blocks
_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIP = (os.path.dirname(numpy.__file__), os.path.abspath(__file__))


class StrictError(TypeError):
    """A device array taken to host memory outside a sanctioned transfer point."""


def _where(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    if path.startswith(os.path.dirname(_HERE) + os.sep):
        path = os.path.relpath(path, os.path.dirname(_HERE))
    return f"{code.co_name} ({path}:{frame.f_lineno})"


def _block_of(frame) -> str | None:
    """The class name of the innermost block (an object with forward and backward) whose
    method is on the stack from ``frame`` up, or None."""
    while frame is not None:
        for key in ("self", "block"):
            obj = frame.f_locals.get(key)
            if obj is not None and callable(getattr(obj, "backward", None)) \
                    and callable(getattr(obj, "forward", None)):
                return type(obj).__name__
        frame = frame.f_back
    return None


def call_site() -> str:
    """Where the caller's caller is, outside NumPy, installed libraries and this module:
    ``function (file:line)``, and the block whose forward or backward it runs in, if any."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_SKIP)
                                 or "site-packages" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "an unknown caller"
    block = _block_of(frame)
    return _where(frame) + (f" in block {block}" if block else "")


def refuse(what: str):
    """Raise StrictError: ``what`` would copy a device array to host memory, at the call site."""
    raise StrictError(f"strict device backend: {what} at {call_site()} copies a device array "
                      "to host memory; use backend.to_host (counted) at a sanctioned point")


def _to_host(a, what: str):
    """The host array under ``a``: allowed inside backend.host_ok() (counted), else refused."""
    if not _allowed[0]:
        refuse(what)
    STATS["host_ok"] += 1
    STATS["to_host"] += 1
    STATS["to_host_bytes"] += a._a.nbytes
    return a._a


def unwrap(x):
    """``x`` with every StrictArray replaced by its NumPy array (in lists and tuples too);
    a host NumPy array is refused (a device operation given host memory)."""
    t = type(x)
    if t is StrictArray:
        return x._a
    if t is numpy.ndarray:
        raise StrictError(f"strict device backend: a host array {x.shape} given to a device "
                          f"operation at {call_site()}; move it with backend.to_device")
    if t is tuple or t is list:
        return t(unwrap(v) for v in x)
    return x


def wrap(r, inputs=()):
    """NumPy results as StrictArrays (scalars as 0-d arrays); an input returned as is (a no-op
    conversion) is given back as the same StrictArray object."""
    if isinstance(r, numpy.ndarray):
        for i in inputs:
            if type(i) is StrictArray and i._a is r:
                return i
        return StrictArray(r)
    if isinstance(r, numpy.generic):
        return StrictArray(numpy.asarray(r))
    if type(r) is tuple or type(r) is list:
        return type(r)(wrap(v, inputs) for v in r)
    return r


def _args(args, kwargs):
    return unwrap(args), {k: unwrap(v) for k, v in kwargs.items()}


def _key(k):
    """An index: StrictArrays unwrapped; host index arrays allowed (CuPy copies them over)."""
    t = type(k)
    if t is StrictArray:
        return k._a
    if t is tuple:
        return tuple(_key(v) for v in k)
    return k


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


def _binary(op, name):
    def f(self, other):
        if type(other) is numpy.ndarray:
            unwrap(other)                               # refused: host memory in device math
        return wrap(op(self._a, other._a if type(other) is StrictArray else other))
    f.__name__ = name
    return f


def _reflected(op, name):
    def f(self, other):
        unwrap(other)
        return wrap(op(other, self._a))
    f.__name__ = name
    return f


def _inplace(op, name):
    def f(self, other):
        op(self._a, unwrap(other))
        return self
    f.__name__ = name
    return f


def _method(name):
    def f(self, *args, **kwargs):
        a, k = _args(args, kwargs)
        return wrap(getattr(self._a, name)(*a, **k), (self,))
    f.__name__ = name
    return f


def _refused(what):
    def f(self, *args, **kwargs):
        return getattr(_to_host(self, what), what.split("(")[0].strip("."))(*args, **kwargs)
    return f


class StrictArray:
    """A device array (see the module's docstring): NumPy's array inside, no implicit way out.

    Its attributes are CuPy's: shape, dtype, ndim, size, nbytes, itemsize, strides, T, flags,
    base and ``data.ptr`` (the memory account), the operators and in-place operators, indexing,
    the methods hpcnn calls, and ``get()``: a counted copy to a host NumPy array."""

    __slots__ = ("_a",)
    __hash__ = None

    def __init__(self, a):
        self._a = a

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    base = property(lambda self: self._a.base)          # identity only: the memory account
    T = property(lambda self: StrictArray(self._a.T))
    data = property(lambda self: _Pointer(self._a.__array_interface__["data"][0]))

    def get(self):
        """A host copy (CuPy's ``get``): a counted device-to-host transfer."""
        STATS["to_host"] += 1
        STATS["to_host_bytes"] += self._a.nbytes
        return self._a.copy()

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (StrictArray(r) if isinstance(r, numpy.ndarray) else wrap(r) for r in self._a)

    def __getitem__(self, key):
        return wrap(self._a[_key(key)])

    def __setitem__(self, key, value):
        self._a[_key(key)] = unwrap(value)

    def __repr__(self):
        return f"StrictArray(shape={self._a.shape}, dtype={self._a.dtype})"

    def __copy__(self):
        return StrictArray(self._a.copy())

    def __deepcopy__(self, memo):
        return StrictArray(self._a.copy())

    def __reduce_ex__(self, protocol):
        refuse("pickling a device array")

    def __array__(self, dtype=None, copy=None):
        a = _to_host(self, "numpy.asarray() (__array__)")
        return a if dtype is None else a.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # a NumPy scalar's operator (numpy.float32(2) * a) reaches here: computed, as CuPy does
        if method == "__call__" and not kwargs and len(inputs) == 2 and \
                any(isinstance(i, numpy.generic) for i in inputs) and \
                all(isinstance(i, (numpy.generic, StrictArray)) for i in inputs):
            return wrap(ufunc(*unwrap(inputs)))
        refuse(f"numpy.{ufunc.__name__}{'.' + method if method != '__call__' else ''}()")

    def __array_function__(self, func, types, args, kwargs):
        refuse(f"numpy.{func.__name__}()")

    def __bool__(self):
        return bool(_to_host(self, "bool()"))

    def __float__(self):
        return float(_to_host(self, "float()"))

    def __int__(self):
        return int(_to_host(self, "int()"))

    def __index__(self):
        return operator.index(_to_host(self, "operator.index()"))

    def __complex__(self):
        return complex(_to_host(self, "complex()"))

    def __format__(self, spec):
        return format(_to_host(self, "format()"), spec)

    item = _refused(".item()")
    tolist = _refused(".tolist()")
    tobytes = _refused(".tobytes()")

    def __neg__(self):
        return wrap(-self._a)

    def __pos__(self):
        return wrap(+self._a)

    def __abs__(self):
        return wrap(abs(self._a))

    def __invert__(self):
        return wrap(~self._a)


_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
        "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
        "pow": operator.pow, "matmul": operator.matmul, "and": operator.and_,
        "or": operator.or_, "xor": operator.xor, "lshift": operator.lshift,
        "rshift": operator.rshift}
for _n, _op in _OPS.items():
    setattr(StrictArray, f"__{_n}__", _binary(_op, f"__{_n}__"))
    setattr(StrictArray, f"__r{_n}__", _reflected(_op, f"__r{_n}__"))
    setattr(StrictArray, f"__i{_n}__", _inplace(getattr(operator, f"i{_n}"), f"__i{_n}__"))
for _n in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(StrictArray, f"__{_n}__", _binary(getattr(operator, _n), f"__{_n}__"))
for _n in ("reshape", "astype", "sum", "max", "min", "mean", "copy", "view", "ravel", "fill",
           "transpose", "swapaxes", "any", "all", "argmax", "argmin", "dot", "cumsum", "clip",
           "squeeze", "var", "std", "prod", "repeat", "flatten", "nonzero", "take", "conj",
           "round", "argsort", "sort"):
    setattr(StrictArray, _n, _method(_n))
ndarray = StrictArray


def _function(fn):
    def f(*args, **kwargs):
        a, k = _args(args, kwargs)
        return wrap(fn(*a, **k), args)
    f.__name__ = getattr(fn, "__name__", "function")
    return f


class _Ufunc:
    """A NumPy ufunc on device arrays: called, or ``at`` (unbuffered in place, ``add.at``)."""

    def __init__(self, u):
        self._u, self.__name__ = u, u.__name__

    def __call__(self, *args, **kwargs):
        a, k = _args(args, kwargs)
        return wrap(self._u(*a, **k), args)

    def at(self, a, indices, b=None):
        self._u.at(unwrap(a), _key(indices), *(() if b is None else (unwrap(b),)))

    def reduce(self, *args, **kwargs):
        a, k = _args(args, kwargs)
        return wrap(self._u.reduce(*a, **k), args)


def _creation(fn):
    """``asarray``/``array``: host data copied to a new device array (a counted transfer), a
    device array given back as is (``asarray``) or copied (``array``)."""
    def f(a, dtype=None, **kwargs):
        if type(a) is StrictArray:
            return wrap(fn(a._a, dtype=dtype, **kwargs), (a,))
        host = numpy.array(a, dtype=dtype, copy=True, **kwargs)
        STATS["to_device"] += 1
        STATS["to_device_bytes"] += host.nbytes
        return StrictArray(host)
    f.__name__ = fn.__name__
    return f


asarray, array = _creation(numpy.asarray), _creation(numpy.array)


class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


lib = _Namespace(stride_tricks=_Namespace(
    as_strided=lambda a, *args, **kw: StrictArray(numpy.lib.stride_tricks.as_strided(
        unwrap(a), *args, **kw))))


def _visible() -> list:
    """The strict node's device numbers this process sees: ``HPCNN_STRICT_DEVICES`` devices
    (default 1), restricted as CUDA restricts them to those ``CUDA_VISIBLE_DEVICES`` lists."""
    n = int(os.environ.get("HPCNN_STRICT_DEVICES", "1") or 1)
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(range(n))
    out = []
    for tok in listed.split(","):                 # CUDA stops at the first invalid entry
        if not tok.strip().isdigit() or int(tok) >= n:
            break
        out.append(int(tok))
    return out


class _Runtime:
    """``cupy.cuda.runtime``'s calls hpcnn makes, answered for the strict node's devices."""

    @staticmethod
    def getDeviceCount() -> int:
        return len(_visible())

    @staticmethod
    def getDeviceProperties(i: int) -> dict:
        return {"name": f"strict device {_visible()[i]}".encode(), "totalGlobalMem": 0,
                "major": 0, "minor": 0}

    @staticmethod
    def driverGetVersion() -> int:
        return 0

    runtimeGetVersion = driverGetVersion


class _Device:
    """``cupy.cuda.Device(i)``: ``use()`` makes it current (:data:`CURRENT`); ``pci_bus_id``
    names the physical device (the strict node's number), as CUDA's names a GPU."""

    def __init__(self, i: int = 0):
        self.id = int(i)

    @property
    def pci_bus_id(self) -> str:
        return f"strict:{_visible()[self.id]}"

    def use(self) -> None:
        CURRENT["device"] = self.id


class _Event:
    """``cupy.cuda.Event``: recorded on a stream; ``synchronize()`` is a counted host wait."""

    def __init__(self, *args, **kwargs):
        self.stream = None

    def record(self, stream=None):
        self.stream = stream if stream is not None else _stream_now()

    @property
    def done(self) -> bool:
        return True                      # the strict backend computes at once

    def synchronize(self):
        STATS["sync"] += 1


class _Stream:
    """``cupy.cuda.Stream``: a handle (``ptr``), ``wait_event`` (device-side ordering: nothing
    to count), ``synchronize()`` (a counted host wait), and ``with stream:`` to make it
    current. NumPy underneath runs everything at once, in order: the ordering is recorded
    (``waited``), not needed."""

    _next = [1]

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None):
        if ptr is None:
            ptr, self._next[0] = self._next[0], self._next[0] + 1
        self.ptr, self.waited, self._prev = ptr, [], []

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def record(self, event=None):
        event = event or _Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        STATS["sync"] += 1

    def __enter__(self):
        self._prev.append(CURRENT["stream"])
        CURRENT["stream"] = self
        return self

    def __exit__(self, *exc):
        CURRENT["stream"] = self._prev.pop()


def _stream_now():
    return CURRENT["stream"]


CURRENT = {"device": 0, "stream": _Stream(ptr=0)}   # the current device and stream (0: null)
cuda = _Namespace(runtime=_Runtime, Device=_Device, Stream=_Stream, Event=_Event,
                  get_current_stream=_stream_now, nccl=None)
# ``cuda``: the subset of ``cupy.cuda`` that hpcnn's device code calls
# (hpcnn/parallel/collectives/gpu.py), so that the same code runs under strict: devices counted
# from HPCNN_STRICT_DEVICES and CUDA_VISIBLE_DEVICES, streams and events. ``nccl`` is None (no
# NCCL here): a test installs a test double of ``cupy.cuda.nccl`` there.


def __getattr__(name):
    """Every other NumPy name: functions and ufuncs on device arrays; types and constants as
    NumPy has them (CuPy's dtypes are NumPy's)."""
    obj = getattr(numpy, name)
    if isinstance(obj, numpy.ufunc):
        obj = _Ufunc(obj)
    elif callable(obj) and not isinstance(obj, type):
        obj = _function(obj)
    globals()[name] = obj
    return obj
