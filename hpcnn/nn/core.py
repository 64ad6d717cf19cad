"""The block contract every method in hpcnn schedules: forward/backward with a caller-owned cache.

::

    y, cache = block.forward(x)      # cache: exactly what backward needs, owned by the caller
    dx = block.backward(dy, cache)   # accumulates into p.grad for p in block.params; returns dL/dx
    block.spec(x_shape)              # BlockSpec from shapes alone (never measured)

The cache is a NamedTuple defined next to its block (``LinearCache(x)``, ...): ``forward`` builds
it by field name and ``backward`` reads the same names, so a reader sees what a backward uses; a
composite block's cache holds its sub-blocks' caches, named after its forward's locals. Being
tuples, caches are counted by :func:`hpcnn.memory.executor.live_bytes` and moved by
:mod:`hpcnn.memory.offload` as the same type. A block keeps no per-call state on ``self``: a
pipeline holds one cache per micro-batch, rematerialization drops a cache and runs ``forward``
again. Stochastic blocks (dropout) own a generator whose state the caller can save and restore
(:meth:`Block.rng_state`), so a recomputed forward draws the same mask.

Deferred weight gradients (zero-bubble pipelines). A block with ``defers_weights = True``
(:class:`~hpcnn.nn.layers.Linear` and the blocks built from Linears) takes an optional list::

    pending = []
    dx = block.backward(dy, cache, defer=pending)   # input gradient only
    for linear, dy_l, cache_l in pending:           # later: the weight halves (W)
        linear.backward_weight(dy_l, cache_l)

``defer=None`` (the default) runs the whole backward.

Which parameters get storage: a constructor that creates parameters takes ``keep=None`` (all) or a
set of parameter names; the others are :func:`placeholder` arrays of no memory (a pipeline rank
keeps its own stages' parameters). It is passed down to :func:`param_from_host`; initial values
are drawn per tensor from their own key, so kept ones are bit-identical to a full build. (An
argument rather than lazy parameters: a tensor-parallel block cuts its shard from the serial
initial values while it is built.)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy

from hpcnn import backend


class Parameter:
    """A trainable array and its gradient (same shape, accumulated by ``backward``). The
    gradient's dtype is :attr:`grad_dtype`: the data's, or float32 for 16-bit data (mixed
    precision, :mod:`hpcnn.nn.precision`: Megatron's ``main_grad``).

    ``zero_grad()`` is lazy: it marks the gradient as zero and the next accumulation *writes*
    instead of adding (:meth:`add_matmul` puts the product straight into the gradient array), which
    saves a pass over memory and a temporary per step. Reading ``grad`` always gives true values.
    """

    __slots__ = ("data", "_grad", "_zero", "name", "_source")

    def __init__(self, data, name: str):
        self.data = data
        # a placeholder (another pipeline rank's parameter) has no storage, nor its gradient
        self._grad = data if is_placeholder(data) else self._zeros()
        self._zero = False
        self.name = name
        self._source = None

    def lend_grad(self, source) -> None:
        """Give up the gradient's storage: from now on ``source(self)`` binds it (and sets it
        to read as zero) just before the gradient is first read or written (ZeRO-2's buckets,
        :mod:`hpcnn.parallel.data.sharded`, bind storage only while a bucket is in use);
        ``source=None`` gives the parameter a private zero gradient again."""
        self._source = source
        self._grad = None if source is not None else self._zeros()
        self._zero = source is None

    @property
    def grad_dtype(self):
        """The gradient's dtype: :func:`hpcnn.backend.compute_dtype` of the data's."""
        return backend.compute_dtype(self.data.dtype)

    def _zeros(self):
        return backend.xp.zeros(self.data.shape, dtype=self.grad_dtype)

    def bind_lent(self, array) -> None:
        """Bind ``array`` (the parameter's shape) as the lent gradient's storage, read as zero
        until written (its ``source`` calls this)."""
        self._grad, self._zero = array, True

    def grad_storage(self):
        """The gradient's storage as it is (None while lent and unbound), binding nothing."""
        return self._grad

    def _claim(self) -> None:
        self._source(self)

    @property
    def grad(self):
        if self._grad is None:
            self._claim()
        if self._zero:
            self._grad[...] = 0
            self._zero = False
        return self._grad

    @grad.setter
    def grad(self, value):
        """Assigning copies into the gradient storage (which may be a view of a flat buffer)."""
        if self._grad is None:
            self._claim()
        if value is not self._grad:
            self._grad[...] = value
        self._zero = False

    def bind_grad(self, array) -> None:
        """Use ``array`` (same shape, e.g. a view into a flat buffer) as the gradient storage."""
        if tuple(array.shape) != tuple(self.data.shape):
            raise ValueError(f"{self.name}: gradient view of shape {array.shape} != {self.data.shape}")
        array[...] = self.grad
        self._grad = array

    def zero_grad(self) -> None:
        self._zero = True

    def add_grad(self, value) -> None:
        """grad += value (written, not added, after zero_grad)."""
        if self._grad is None:
            self._claim()
        if self._zero:
            self._grad[...] = value
            self._zero = False
        else:
            self._grad += value

    def add_matmul(self, a, b) -> None:
        """grad += a @ b for 2-D a, b whose product has grad's size (reshaped to grad's shape),
        computed in the compute dtype (:func:`hpcnn.backend.matmul`: 16-bit operands on the
        tensor cores on CuPy, upcast on NumPy)."""
        if self._grad is None:
            self._claim()
        if self._zero:
            backend.matmul(a, b, out=self._grad.reshape(a.shape[0], b.shape[1]))
            self._zero = False
        else:
            self._grad += backend.matmul(a, b).reshape(self._grad.shape)

    @property
    def shape(self):
        return self.data.shape

    @property
    def size(self) -> int:
        return int(self.data.size)

    def __repr__(self) -> str:
        return f"Parameter({self.name}, shape={tuple(self.data.shape)}, dtype={self.data.dtype})"


@dataclass(frozen=True, kw_only=True)
class BlockSpec:
    """What a block costs for an input shape, from shapes alone.

    flops_fwd/flops_bwd count multiply-adds as 2 FLOPs (backward includes both the input and the
    weight gradient). bytes_x is the input, bytes_y the output, bytes_cache what ``forward`` keeps
    for ``backward`` (arrays shared with x are counted too: it is what must stay alive),
    bytes_params the parameters (the gradients are as large again). comm_bytes is what one
    forward+backward sends per rank (zero for serial blocks). ``cache_has_x``/``cache_has_y``: the
    cache holds the input/output array itself (counted in bytes_cache too): memory accounting
    (:mod:`hpcnn.memory`) counts such an array once. The fields are keyword-only: nine numbers
    in a row are too easy to put in the wrong order.
    """

    name: str
    in_shape: tuple
    out_shape: tuple
    flops_fwd: float
    flops_bwd: float
    bytes_x: int
    bytes_y: int
    bytes_cache: int
    bytes_params: int
    comm_bytes: int = 0
    cache_has_x: bool = False
    cache_has_y: bool = False
    children: tuple = field(default=(), compare=False)

    def __add__(self, other: "BlockSpec") -> "BlockSpec":
        """Sequential composition: self then other."""
        return BlockSpec(
            name=f"{self.name}+{other.name}", in_shape=self.in_shape, out_shape=other.out_shape,
            flops_fwd=self.flops_fwd + other.flops_fwd, flops_bwd=self.flops_bwd + other.flops_bwd,
            bytes_x=self.bytes_x, bytes_y=other.bytes_y,
            bytes_cache=self.bytes_cache + other.bytes_cache,
            bytes_params=self.bytes_params + other.bytes_params,
            comm_bytes=self.comm_bytes + other.comm_bytes,
            cache_has_x=self.cache_has_x, cache_has_y=other.cache_has_y,
            children=self.children + other.children)

    @property
    def bytes_cache_own(self) -> int:
        """Bytes of the cache that are neither the input nor the output array."""
        return (self.bytes_cache - (self.bytes_x if self.cache_has_x else 0)
                - (self.bytes_y if self.cache_has_y else 0))

    @staticmethod
    def compose(name: str, specs) -> "BlockSpec":
        """The spec of running ``specs`` one after the other, named ``name``, children kept."""
        specs = list(specs)
        total = specs[0]
        for s in specs[1:]:
            total = total + s
        return replace(total, name=name, children=tuple(specs))


class Block:
    """Base class: subclasses set ``self.params`` and implement forward/backward/spec."""

    name = "block"
    training = True
    defers_weights = False      # True: backward(dy, cache, defer=None) can defer Linear W halves

    def __init__(self):
        self.params: list[Parameter] = []

    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy, cache):
        raise NotImplementedError

    def spec(self, x_shape) -> BlockSpec:
        raise NotImplementedError

    # Stochastic blocks override these three; deterministic blocks have no RNG state.
    def rng_state(self):
        return None

    def set_rng_state(self, state) -> None:
        return None

    def train(self, mode: bool = True) -> "Block":
        self.training = mode
        return self

    def eval(self) -> "Block":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def init_rng(seed: int, *key) -> numpy.random.Generator:
    """A NumPy generator for one parameter tensor, keyed by (seed, block index, ...).

    Initial values are drawn on the host from a key that names the tensor, so they are the same
    whatever device runs the model and however the chain is later split into stages or shards.
    """
    return numpy.random.default_rng([int(seed), *[int(k) for k in key]])


def placeholder(shape, dtype):
    """A read-only NaN array of ``shape`` with no storage (all strides 0): stands for a
    parameter this rank does not hold. Writing to it raises; computing with it gives NaN, which
    the training loop's finiteness checks report."""
    return backend.xp.broadcast_to(backend.xp.asarray(float("nan"), dtype=dtype), tuple(shape))


def is_placeholder(a) -> bool:
    """True for an array made by :func:`placeholder` (non-empty, every stride 0)."""
    return a.size >= 1 and a.ndim > 0 and not any(a.strides)


def param_from_host(values, dtype, name: str, shape=None, *, keep=None) -> Parameter:
    """Host values -> a Parameter of the backend's array type in ``dtype``, or a placeholder
    (:func:`placeholder`) if ``keep`` is a set of names without ``name`` (None: every parameter
    gets storage). ``values``: a NumPy array, or a function of no argument returning one of
    ``shape`` (only called for a parameter that gets storage, so a pipeline rank draws its own
    stages' initial values only)."""
    if callable(values):
        if shape is None:
            raise ValueError(f"{name}: initial values given as a function need their shape")
        shape = tuple(int(d) for d in shape)
    else:
        shape = tuple(values.shape)
    if keep is not None and name not in keep:
        return Parameter(placeholder(shape, dtype), name)
    host = values() if callable(values) else values
    if tuple(host.shape) != shape:
        raise ValueError(f"{name}: initial values of shape {tuple(host.shape)}, expected {shape}")
    return Parameter(backend.asarray(host.astype(dtype, copy=False)), name)
