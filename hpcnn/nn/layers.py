"""Elementary blocks: Linear, ReLU, GELU, LayerNorm, Dropout.

Each forward returns ``(y, cache)`` with the cache a NamedTuple defined above its block (fields
named as the forward's values, read by the backward under the same names); each backward quotes
the forward line it differentiates. Inputs may have any number of leading dimensions: ``(..., C)``.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy  # host-side initial values only; array code goes through backend.xp

from hpcnn import backend
from hpcnn.nn.core import Block, BlockSpec, init_rng, param_from_host

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _rows(shape) -> int:
    n = 1
    for d in shape[:-1]:
        n *= int(d)
    return n


# (value, dtype) -> the longest constant vector made so far. A pure cache of constants: what
# filled() returns depends only on its arguments, never on what was asked before.
_FILLED = {}


def filled(value: float, n: int, dtype):
    """A vector of ``n`` elements all equal to ``value``: a view of a memoised vector, which
    callers only read. Sums along either axis of a 2-D array as BLAS matrix-vector products,
    ``filled(1, N) @ a`` (column sums) and ``a @ filled(1/C, C)`` (row means), are 1.5-6x faster
    than ``a.sum(axis)`` on the CPU at the shapes of a step, and need no temporary (LayerNorm).

    Linear's bias gradient and the attention softmax keep ``a.sum(axis)``: their tensor-parallel
    counterparts (:mod:`hpcnn.parallel.tensor.linear`, :mod:`hpcnn.parallel.tensor.attention`) sum that
    way, and one tensor-parallel rank must reproduce the serial gradients bit for bit."""
    key = (float(value), numpy.dtype(dtype).str)
    v = _FILLED.get(key)
    if v is None or not isinstance(v, backend.xp.ndarray) or v.shape[0] < n:
        v = _FILLED[key] = backend.xp.full(int(n), value, dtype=dtype)
    return v[:n]


class LinearCache(NamedTuple):
    """What :meth:`Linear.backward_weight` needs: the input ``x`` (..., in)."""
    x: Any


class Linear(Block):
    """y = x W + b, with W of shape (in, out).

    The backward is split in two halves, :meth:`backward_input` (dx) and :meth:`backward_weight`
    (dW, db), so that zero-bubble pipeline schedules can run them at different times:
    ``backward(dy, cache, defer=pending)`` runs the first and appends ``(self, dy, cache)`` to the
    list ``pending`` for a later ``backward_weight`` (the caller must not modify that ``dy``).
    Cache: :class:`LinearCache`.
    """

    defers_weights = True

    def __init__(self, n_in, n_out, *, bias=True, seed=0, index=0, init_std=None,
                 dtype=backend.DEFAULT_DTYPE, name="linear", keep=None):
        super().__init__()
        self.name, self.n_in, self.n_out = name, int(n_in), int(n_out)
        self.dtype = backend.dtype_of(dtype)
        std = init_std if init_std is not None else 1.0 / math.sqrt(n_in)
        self.weight = param_from_host(
            lambda: init_rng(seed, index, 0).standard_normal((n_in, n_out)) * std,
            self.dtype, f"{name}.weight", shape=(n_in, n_out), keep=keep)
        self.params = [self.weight]
        self.bias = None
        if bias:
            self.bias = param_from_host(numpy.zeros(n_out), self.dtype, f"{name}.bias", keep=keep)
            self.params.append(self.bias)

    def forward(self, x):
        if x.shape[-1] != self.n_in:
            raise ValueError(f"{self.name}: input has {x.shape[-1]} features, expected {self.n_in}")
        # one 2-D product over all rows: a stacked (B, T, in) operand would be B small products;
        # in the compute dtype: 16-bit operands upcast on NumPy, tensor cores on CuPy
        y = backend.matmul(x.reshape(-1, self.n_in), self.weight.data)      # (N, out)
        if self.bias is not None:
            y += self.bias.data
        y = backend.down(y, self.dtype)                                      # stored 16-bit
        return y.reshape(tuple(x.shape[:-1]) + (self.n_out,)), LinearCache(x=x)

    def backward(self, dy, cache, defer=None):
        if defer is not None:                       # zero-bubble split: W comes later
            defer.append((self, dy, cache))
        else:
            self.backward_weight(dy, cache)
        return self.backward_input(dy, cache)

    def backward_input(self, dy, cache):
        """dx = dy W^T  (from y = x W), as one 2-D product over all rows."""
        dx = backend.matmul(dy.reshape(-1, self.n_out), self.weight.data.T)  # (N, in)
        return backend.down(dx, dy.dtype).reshape(tuple(dy.shape[:-1]) + (self.n_in,))

    def backward_weight(self, dy, cache):
        """dW += x^T dy, db += sum(dy)  (from y = x W + b)."""
        x2 = cache.x.reshape(-1, self.n_in)                # (N, in)
        dy2 = dy.reshape(-1, self.n_out)                   # (N, out)
        self.weight.add_matmul(x2.T, dy2)                  # (in, out), in the gradient's dtype
        if self.bias is not None:
            self.bias.add_grad(backend.up(dy2).sum(axis=0))

    def spec(self, x_shape):
        n = _rows(x_shape)
        out_shape = tuple(x_shape[:-1]) + (self.n_out,)
        mm = 2.0 * n * self.n_in * self.n_out
        nb = backend.nbytes(x_shape, self.dtype)
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=out_shape,
                         flops_fwd=mm + (n * self.n_out if self.bias else 0),
                         flops_bwd=2 * mm + (n * self.n_out if self.bias else 0), bytes_x=nb,
                         bytes_y=backend.nbytes(out_shape, self.dtype), bytes_cache=nb,
                         bytes_params=sum(backend.nbytes(p.shape, self.dtype) for p in self.params),
                         cache_has_x=True)


class ReLUCache(NamedTuple):
    """The output ``y``, whose sign is the derivative."""
    y: Any


class ReLU(Block):
    """y = max(x, 0). Cache: :class:`ReLUCache`, the output y (whose sign is the derivative)."""

    name = "relu"

    def __init__(self, dtype=backend.DEFAULT_DTYPE):
        super().__init__()
        self.dtype = backend.dtype_of(dtype)

    def forward(self, x):
        y = backend.xp.maximum(x, 0)
        return y, ReLUCache(y=y)

    def backward(self, dy, cache):
        return backend.xp.multiply(dy, cache.y > 0)            # dy * 1[y > 0]

    def spec(self, x_shape):
        nb = backend.nbytes(x_shape, self.dtype)
        n = nb // self.dtype.itemsize
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=tuple(x_shape),
                         flops_fwd=n, flops_bwd=2 * n, bytes_x=nb, bytes_y=nb, bytes_cache=nb,
                         bytes_params=0, cache_has_y=True)


class GELUCache(NamedTuple):
    """``dgelu`` = gelu'(x), the derivative at the input (the whole backward is dy * dgelu)."""
    dgelu: Any


class GELU(Block):
    """GELU, tanh form: y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Cache:
    :class:`GELUCache`, gelu'(x).

    The forward computes the derivative as well and caches only it (one array, not two), so the
    backward is a single product. With z = sqrt(2/pi) (x + a x^3), a = 0.044715, t = tanh(z),
    p = (1 + t)/2 and y = x p:

        gelu'(x) = (1 + t)/2 + x/2 (1 - t^2) dz/dx = p + (1 - p) y k(x),
        k(x) = 2 dz/dx = sqrt(2/pi) (2 + 6 a x^2)            (using 1 - t^2 = 4 p (1 - p)).

    On the CPU the elementwise chain runs over slices of :attr:`CHUNK` elements that stay in
    cache, with two scratch buffers kept on ``self`` (temporaries only: never part of a result).
    Plain twin: :func:`hpcnn.nn.plain.gelu_plain`.
    """

    name = "gelu"
    CHUNK = 1 << 16      # elements per cache-resident slice on the CPU (whole array on a GPU)

    def __init__(self, dtype=backend.DEFAULT_DTYPE):
        super().__init__()
        self.dtype = backend.dtype_of(dtype)
        self._scratch = None

    def forward(self, x):
        if backend.is_narrow(x.dtype):      # 16-bit: computed in a float32 copy, x untouched
            return self.forward_inplace(x)
        x = backend.xp.ascontiguousarray(x)
        y = backend.xp.empty_like(x)
        return y, GELUCache(dgelu=self._forward_into(x, y))

    def forward_inplace(self, x):
        """:meth:`forward` writing y over ``x`` (a caller's own, spent array)."""
        if backend.is_narrow(x.dtype):       # 16-bit storage: a float32 copy to compute in
            y = backend.up(x)
            d = self._forward_into(y, y)
            return backend.down(y, x.dtype), GELUCache(dgelu=backend.down(d, x.dtype))
        if not x.flags.c_contiguous:
            return self.forward(x)
        return x, GELUCache(dgelu=self._forward_into(x, x))

    def backward(self, dy, cache):
        return backend.xp.multiply(dy, cache.dgelu)      # from y = gelu(x): dx = dy gelu'(x)

    def backward_inplace(self, dy, cache):
        """:meth:`backward` overwriting ``dy`` (owned by the caller) with dx."""
        return backend.xp.multiply(dy, cache.dgelu, out=dy)

    def _buffers(self, n, dtype):
        """Two reused scratch vectors of n elements (temporaries of one call only)."""
        buf = self._scratch
        if (buf is None or not isinstance(buf, backend.xp.ndarray) or buf.dtype != dtype
                or buf.shape[1] < n):
            buf = self._scratch = backend.xp.empty((2, n), dtype=dtype)
        return buf[0, :n], buf[1, :n]

    def _forward_into(self, x, y):
        """y = gelu(x) (y may be x itself); returns a fresh array holding gelu'(x)."""
        xp = backend.xp
        c, a = _SQRT_2_OVER_PI, 0.044715
        d = xp.empty_like(x)
        xf, yf, df = x.reshape(-1), y.reshape(-1), d.reshape(-1)
        n = xf.size
        step = max(1, n if backend.device != "cpu" else min(n, self.CHUNK))
        ub, wb = self._buffers(step, x.dtype)
        for s in range(0, n, step):
            e = min(n, s + step)
            xc, yc, dc = xf[s:e], yf[s:e], df[s:e]
            u, w = ub[:e - s], wb[:e - s]
            xp.multiply(xc, xc, out=u)                   # x^2
            xp.multiply(u, c * a, out=w)
            w += c
            w *= xc                                      # z = c (x + a x^3)
            xp.tanh(w, out=w)
            w *= 0.5
            w += 0.5                                     # p = (1 + tanh z)/2
            xp.multiply(xc, w, out=yc)                   # y = x p  (x is not read after this)
            xp.subtract(1.0, w, out=dc)
            dc *= yc                                     # (1 - p) y
            u *= 6.0 * a * c
            u += 2.0 * c                                 # k = c (2 + 6 a x^2)
            dc *= u
            dc += w                                      # gelu'(x) = p + (1 - p) y k
        return d

    def spec(self, x_shape):
        nb = backend.nbytes(x_shape, self.dtype)
        n = nb // self.dtype.itemsize
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=tuple(x_shape),
                         flops_fwd=14 * n, flops_bwd=n, bytes_x=nb, bytes_y=nb, bytes_cache=nb,
                         bytes_params=0)


class LayerNormCache(NamedTuple):
    """``xhat`` (..., C), the normalised input, and ``rstd`` (..., 1) = 1/sqrt(var + eps)."""
    xhat: Any
    rstd: Any


class LayerNorm(Block):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last dimension.

    Cache: :class:`LayerNormCache`, x_hat (the normalised input) and rstd = 1/sqrt(var + eps).
    The variance is the two-pass mean((x - mean)^2). Row means are matrix-vector products and
    row/column sums of products are ``einsum`` contractions: both avoid reductions along a
    short last axis and the temporaries of a product followed by a sum.
    Plain twin: :func:`hpcnn.nn.plain.layer_norm_plain`.
    """

    def __init__(self, dim, *, eps=1e-5, dtype=backend.DEFAULT_DTYPE, name="ln", keep=None):
        super().__init__()
        self.name, self.dim, self.eps = name, int(dim), float(eps)
        self.dtype = backend.dtype_of(dtype)
        self.gamma = param_from_host(numpy.ones(dim), self.dtype, f"{name}.weight", keep=keep)
        self.beta = param_from_host(numpy.zeros(dim), self.dtype, f"{name}.bias", keep=keep)
        self.params = [self.gamma, self.beta]

    def forward(self, x):
        if x.shape[-1] != self.dim:
            raise ValueError(f"{self.name}: input has {x.shape[-1]} features, expected {self.dim}")
        xp = backend.xp
        C = self.dim
        x2 = backend.up(x.reshape(-1, C))                    # (N, C); statistics in fp32
        mean = xp.matmul(x2, filled(1.0 / C, C, x2.dtype))  # (N,) row means
        xhat = xp.subtract(x2, mean[:, None])                # x - mean (becomes x_hat below)
        var = xp.einsum("ij,ij->i", xhat, xhat)              # (N,) C * var
        var *= 1.0 / C
        var += self.eps
        xp.sqrt(var, out=var)
        rstd = xp.divide(1.0, var, out=var)                  # (N,) 1/sqrt(var + eps)
        xhat *= rstd[:, None]                                # x_hat = (x - mean) rstd
        y = xp.multiply(xhat, self.gamma.data)
        y += self.beta.data                                  # y = x_hat gamma + beta
        shape, dt = tuple(x.shape), x.dtype                  # y and x_hat stored as x
        return backend.down(y, dt).reshape(shape), LayerNormCache(
            xhat=backend.down(xhat, dt).reshape(shape), rstd=rstd.reshape(shape[:-1] + (1,)))

    def backward(self, dy, cache):
        xp = backend.xp
        C = self.dim
        dy2, xh2 = backend.up(dy.reshape(-1, C)), backend.up(cache.xhat.reshape(-1, C))
        r = cache.rstd.reshape(-1)                                 # (N,); dy2, xh2 (N, C)
        # from y = x_hat*gamma + beta
        self.gamma.add_grad(xp.einsum("ij,ij->j", dy2, xh2))
        self.beta.add_grad(xp.matmul(filled(1.0, dy2.shape[0], dy2.dtype), dy2))
        # from x_hat = (x - mean) rstd, with g = dy*gamma = dL/dx_hat:
        # dx = rstd (g - mean(g) - x_hat mean(g x_hat))
        dx = xp.multiply(dy2, self.gamma.data)               # g
        a = xp.matmul(dx, filled(1.0 / C, C, dy2.dtype))     # (N,) mean(g)
        b = xp.einsum("ij,ij->i", dx, xh2)                   # (N,) C mean(g x_hat)
        b *= r
        b *= 1.0 / C                                         # rstd mean(g x_hat)
        t = xp.multiply(xh2, b[:, None])
        dx -= a[:, None]
        dx *= r[:, None]
        dx -= t
        return backend.down(dx, dy.dtype).reshape(dy.shape)

    def spec(self, x_shape):
        nb = backend.nbytes(x_shape, self.dtype)
        n = nb // self.dtype.itemsize
        rows = _rows(x_shape)
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=tuple(x_shape),
                         flops_fwd=8 * n, flops_bwd=14 * n, bytes_x=nb, bytes_y=nb,
                         bytes_cache=nb + rows * backend.compute_dtype(self.dtype).itemsize,
                         bytes_params=2 * self.dim * self.dtype.itemsize)


def reachable(block, kind) -> list:
    """Every instance of ``kind`` reachable from ``block`` (itself included) through attributes,
    lists and tuples, each once, in a fixed order (the memo ``_dropouts`` is not followed)."""
    found, seen, stack = [], set(), [block]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, kind):
            found.append(obj)
        if isinstance(obj, (list, tuple)):
            stack.extend(reversed(obj))
        elif isinstance(obj, Block) or hasattr(obj, "blocks"):
            stack.extend(v for k, v in reversed(list(vars(obj).items()))
                         if k != "_dropouts"
                         and (isinstance(v, (Block, list, tuple)) or hasattr(v, "blocks")))
    return found


def dropouts(root) -> list:
    """Every :class:`Dropout` reachable from ``root`` (a block, a chain, or a list of them),
    each once, in a fixed order. A block's are found once and kept on the block itself
    (``block._dropouts``: its structure does not change after construction), so the training
    loop's call before every forward costs an attribute read per block."""
    if isinstance(root, Block):
        found = getattr(root, "_dropouts", None)
        if found is None:
            found = root._dropouts = reachable(root, Dropout)
        return found
    out, seen = [], set()
    for part in (root.blocks if hasattr(root, "blocks") else root):
        for d in dropouts(part):
            if id(d) not in seen:
                seen.add(id(d))
                out.append(d)
    return out


def place_draws(root, draw: int, row: int) -> None:
    """Before a forward of a batch whose first row is row ``row`` of the global batch of step
    ``draw``: every dropout under ``root`` draws that step's mask from that row on."""
    for d in dropouts(root):
        d.place(draw, row)


class DropoutCache(NamedTuple):
    """``mask``: the scaled keep mask, mask / (1 - p); None when the block is the identity
    (eval mode or p = 0)."""
    mask: Any


class Dropout(Block):
    """y = x * mask / (1 - p) in training, identity in eval. Cache: :class:`DropoutCache`.

    Masks come from :func:`hpcnn.backend.keep_mask`, keyed by (seed, index, draw) and positioned
    at row ``row`` of that draw's unbounded array of rows (axis 0 is the batch). The state is
    ``(draw, row)``: :meth:`rng_state` / :meth:`set_rng_state` save and restore it, so a
    recomputed forward reproduces its mask; each forward advances ``draw``. The training loop
    calls :meth:`place` (through :func:`place_draws`) before every forward with (step, the global
    index of the first row): sample g of step s then gets the same mask whatever the layout
    (serial, data-parallel shards of any sizes, micro-batches, pipeline stages).
    """

    def __init__(self, p=0.0, *, seed=0, index=0, dtype=backend.DEFAULT_DTYPE, name="dropout"):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name}: dropout probability must be in [0, 1), got {p}")
        self.name, self.p, self.dtype = name, float(p), backend.dtype_of(dtype)
        self.seed, self.index, self.calls, self.row = int(seed), int(index), 0, 0

    def rng_state(self):
        return (self.calls, self.row)

    def set_rng_state(self, state):
        self.calls, self.row = (int(v) for v in state)

    def place(self, draw: int, row: int) -> None:
        """The next forward draws mask ``draw`` from global row ``row`` on."""
        self.calls, self.row = int(draw), int(row)

    def _mask(self, shape):
        """The scaled keep mask of this forward for a tensor of ``shape``; advances the draw."""
        mask = backend.keep_mask((self.seed, self.index, self.calls), self.row, shape, self.p,
                           self.dtype)
        self.calls += 1
        return mask

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x, DropoutCache(mask=None)
        mask = self._mask(x.shape)                                   # (..., C)
        return x * mask, DropoutCache(mask=mask)

    def backward(self, dy, cache):
        return dy if cache.mask is None else dy * cache.mask         # from y = x * mask

    def spec(self, x_shape):
        nb = backend.nbytes(x_shape, self.dtype)
        n = nb // self.dtype.itemsize
        active = self.training and self.p > 0.0        # in eval mode: the identity, no mask
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=tuple(x_shape),
                         flops_fwd=n if active else 0, flops_bwd=n if active else 0, bytes_x=nb,
                         bytes_y=nb, bytes_cache=nb if active else 0, bytes_params=0)
