"""Convolution blocks in NCHW layout: Conv2d (im2col), MaxPool2d, AvgPool2d, Flatten.

Each forward returns ``(y, cache)``; each backward quotes the forward line it differentiates.
Windows are strided views (``as_strided``) of the input, so im2col is one gather copy and the
convolution one matrix product. The backward scatters window gradients back with ``k*k``
vectorised strided-slice adds (col2im), which also handles overlapping windows (stride < kernel)::

    conv = Conv2d(3, 16, 3, padding=1)
    y, cache = conv.forward(x)          # x: (N, 3, H, W) -> y: (N, 16, H, W)
    dx = conv.backward(dy, cache)       # accumulates conv.weight.grad, conv.bias.grad
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy  # host-side initial values and index dtypes only; array code goes through backend.xp

from hpcnn import backend
from hpcnn.nn.core import Block, BlockSpec, init_rng, param_from_host


def _out_size(name, x_shape, k, s, p):
    """(N, C, H, W) -> (Ho, Wo) for kernel k, stride s, padding p; ValueError if it does not fit."""
    if len(x_shape) != 4:
        raise ValueError(f"{name}: expected an (N, C, H, W) input, got shape {tuple(x_shape)}")
    h, w = int(x_shape[2]) + 2 * p, int(x_shape[3]) + 2 * p
    if h < k or w < k:
        raise ValueError(f"{name}: input {x_shape[2]}x{x_shape[3]} (padding {p}) is smaller "
                         f"than the {k}x{k} kernel")
    return (h - k) // s + 1, (w - k) // s + 1


def _check_geometry(kernel, stride, padding):
    if kernel < 1 or stride < 1 or padding < 0:
        raise ValueError(f"need kernel >= 1, stride >= 1, padding >= 0; got kernel={kernel}, "
                         f"stride={stride}, padding={padding}")


def _windows(x, k, s, ho, wo):
    """Strided view of the k x k windows of a 4-D x: (A0, A1, k, k, Ho, Wo), no copy."""
    s0, s1, sh, sw = x.strides
    return backend.xp.lib.stride_tricks.as_strided(
        x, shape=x.shape[:2] + (k, k, ho, wo), strides=(s0, s1, sh, sw, sh * s, sw * s))


class Conv2dCache(NamedTuple):
    """``cols`` (C*k*k, N*Ho*Wo), the im2col matrix of the padded input (what dW needs), and
    ``x_shape`` (N, C, H, W) (what col2im needs)."""
    cols: Any
    x_shape: tuple


class Conv2d(Block):
    """2-D convolution (cross-correlation), y = W * x + b, by im2col and one matrix product.

    Parameters: ``in_ch``, ``out_ch``, square ``kernel``, ``stride``, zero ``padding``; weight
    (out_ch, in_ch, k, k) drawn He-uniform on the host, U(-sqrt(6/fan_in), +sqrt(6/fan_in)) with
    fan_in = in_ch*k*k, from ``init_rng(seed, index, 0)``; bias zeros. The column matrix is
    channel-major, (C*k*k, N*Ho*Wo), so that forward, dW and dcols are each a single GEMM.
    Cache: :class:`Conv2dCache`, the column matrix (what dW needs; dx needs only W and the input
    shape).
    """

    def __init__(self, in_ch, out_ch, kernel, *, stride=1, padding=0, bias=True, seed=0,
                 index=0, dtype=backend.DEFAULT_DTYPE, name="conv", keep=None):
        super().__init__()
        _check_geometry(kernel, stride, padding)
        self.name, self.dtype = name, backend.dtype_of(dtype)
        self.in_ch, self.out_ch, self.kernel = int(in_ch), int(out_ch), int(kernel)
        self.stride, self.padding = int(stride), int(padding)
        fan_in = self.in_ch * self.kernel ** 2
        bound = math.sqrt(6.0 / fan_in)
        shape = (self.out_ch, self.in_ch, self.kernel, self.kernel)
        self.weight = param_from_host(
            lambda: init_rng(seed, index, 0).uniform(-bound, bound, shape),
            self.dtype, f"{name}.weight", shape=shape, keep=keep)
        self.params = [self.weight]
        self.bias = None
        if bias:
            self.bias = param_from_host(numpy.zeros(out_ch), self.dtype, f"{name}.bias", keep=keep)
            self.params.append(self.bias)

    def _check(self, x_shape):
        ho, wo = _out_size(self.name, x_shape, self.kernel, self.stride, self.padding)
        if int(x_shape[1]) != self.in_ch:
            raise ValueError(f"{self.name}: input has {x_shape[1]} channels, expected {self.in_ch}")
        return ho, wo

    def forward(self, x):
        xp, k, s, p = backend.xp, self.kernel, self.stride, self.padding
        n, c, h, w = x.shape
        ho, wo = self._check(x.shape)
        xpad = xp.zeros((c, n, h + 2 * p, w + 2 * p), dtype=x.dtype)   # (C, N, H+2p, W+2p)
        xpad[:, :, p:p + h, p:p + w] = x.transpose(1, 0, 2, 3)
        win = _windows(xpad, k, s, ho, wo).transpose(0, 2, 3, 1, 4, 5)  # (C, k, k, N, Ho, Wo) view
        cols = win.reshape(c * k * k, n * ho * wo)                    # (C*k*k, N*Ho*Wo) copy
        wmat = self.weight.data.astype(x.dtype, copy=False).reshape(self.out_ch, -1)  # (O, C*k*k)
        y = xp.matmul(wmat, cols)                                     # (O, N*Ho*Wo)
        if self.bias is not None:
            y += self.bias.data.astype(x.dtype, copy=False)[:, None]
        y = xp.ascontiguousarray(y.reshape(self.out_ch, n, ho, wo).transpose(1, 0, 2, 3))
        return y, Conv2dCache(cols=cols, x_shape=tuple(x.shape))      # y: (N, O, Ho, Wo)

    def backward(self, dy, cache):
        """From y = W cols + b: dW += dy cols^T, db += sum(dy), dcols = W^T dy, dx = col2im."""
        xp, k, s, p = backend.xp, self.kernel, self.stride, self.padding
        n, c, h, w = cache.x_shape
        ho, wo = dy.shape[2], dy.shape[3]
        dy2 = dy.transpose(1, 0, 2, 3).reshape(self.out_ch, n * ho * wo)  # (O, N*Ho*Wo)
        self.weight.add_matmul(dy2, cache.cols.T)                           # (O, C, k, k)
        if self.bias is not None:
            self.bias.add_grad(dy2.sum(axis=1))                          # (O,)
        wmat = self.weight.data.astype(dy.dtype, copy=False).reshape(self.out_ch, -1)
        dcols = xp.matmul(wmat.T, dy2).reshape(c, k, k, n, ho, wo)       # (C, k, k, N, Ho, Wo)
        dxpad = xp.zeros((c, n, h + 2 * p, w + 2 * p), dtype=dy.dtype)   # (C, N, H+2p, W+2p)
        for i in range(k):                    # col2im: window offset (i, j) of every output pixel
            for j in range(k):
                dxpad[:, :, i:i + s * ho:s, j:j + s * wo:s] += dcols[:, i, j]
        return xp.ascontiguousarray(dxpad[:, :, p:p + h, p:p + w].transpose(1, 0, 2, 3))

    def spec(self, x_shape):
        ho, wo = self._check(x_shape)
        n, k = int(x_shape[0]), self.kernel
        out_shape = (n, self.out_ch, ho, wo)
        pixels = n * ho * wo
        mm = 2.0 * pixels * self.out_ch * self.in_ch * k * k   # one GEMM; backward does two
        b = pixels * self.out_ch if self.bias is not None else 0
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=out_shape,
                         flops_fwd=mm + b, flops_bwd=2 * mm + b,
                         bytes_x=backend.nbytes(x_shape, self.dtype),
                         bytes_y=backend.nbytes(out_shape, self.dtype),
                         bytes_cache=backend.nbytes((self.in_ch * k * k, pixels), self.dtype),
                         bytes_params=sum(backend.nbytes(q.shape, self.dtype) for q in self.params))


class _Pool2d(Block):
    """Shared geometry of the pooling blocks: square ``kernel``, ``stride`` (default: kernel)."""

    def __init__(self, kernel, stride=None, *, dtype=backend.DEFAULT_DTYPE, name="pool"):
        super().__init__()
        stride = kernel if stride is None else stride
        _check_geometry(kernel, stride, 0)
        self.kernel, self.stride = int(kernel), int(stride)
        self.name, self.dtype = name, backend.dtype_of(dtype)

    def _spec(self, x_shape, flops_bwd, bytes_cache):
        ho, wo = _out_size(self.name, x_shape, self.kernel, self.stride, 0)
        out_shape = tuple(x_shape[:2]) + (ho, wo)
        flops = float(math.prod(out_shape)) * self.kernel ** 2   # one compare or add per tap
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=out_shape,
                         flops_fwd=flops, flops_bwd=flops_bwd * flops,
                         bytes_x=backend.nbytes(x_shape, self.dtype),
                         bytes_y=backend.nbytes(out_shape, self.dtype),
                         bytes_cache=bytes_cache(out_shape), bytes_params=0)


class MaxPoolCache(NamedTuple):
    """``idx`` (N, C, Ho, Wo): the argmax within each window (its tap number, row-major), and
    ``x_shape`` (N, C, H, W)."""
    idx: Any
    x_shape: tuple


class MaxPool2d(_Pool2d):
    """y = max over each k x k window. Cache: :class:`MaxPoolCache`, the argmax within each window.

    Ties go to the first maximum in row-major window order, so the gradient flows to one input
    only and equals the derivative wherever the maximum is unique. Argmax indices are stored in
    the smallest unsigned type that holds k*k - 1 (uint8 up to 16x16 windows).
    """

    def __init__(self, kernel, stride=None, *, dtype=backend.DEFAULT_DTYPE, name="maxpool"):
        super().__init__(kernel, stride, dtype=dtype, name=name)
        self.idx_dtype = numpy.min_scalar_type(self.kernel ** 2 - 1)

    def forward(self, x):
        k, s = self.kernel, self.stride
        n, c = x.shape[:2]
        ho, wo = _out_size(self.name, x.shape, k, s, 0)
        win = _windows(x, k, s, ho, wo).reshape(n, c, k * k, ho, wo)   # (N, C, k*k, Ho, Wo)
        idx = win.argmax(axis=2)                                        # (N, C, Ho, Wo)
        y = backend.xp.take_along_axis(win, idx[:, :, None], axis=2)[:, :, 0]  # (N, C, Ho, Wo)
        return y, MaxPoolCache(idx=idx.astype(self.idx_dtype), x_shape=tuple(x.shape))

    def backward(self, dy, cache):
        """From y = win[argmax]: dx[window tap t] += dy where argmax == t, for each of k*k taps."""
        k, s = self.kernel, self.stride
        ho, wo = dy.shape[2], dy.shape[3]
        dx = backend.xp.zeros(cache.x_shape, dtype=dy.dtype)                   # (N, C, H, W)
        for i in range(k):
            for j in range(k):
                picked = backend.xp.where(cache.idx == i * k + j, dy, 0)
                dx[:, :, i:i + s * ho:s, j:j + s * wo:s] += picked
        return dx

    def spec(self, x_shape):
        return self._spec(x_shape, 1, lambda out: backend.nbytes(out, self.idx_dtype))


class ShapeCache(NamedTuple):
    """Only the input shape ``x_shape`` (no arrays): the cache of AvgPool2d and Flatten."""
    x_shape: tuple


class AvgPool2d(_Pool2d):
    """y = mean over each k x k window. Cache: :class:`ShapeCache`, the input shape (no arrays)."""

    def __init__(self, kernel, stride=None, *, dtype=backend.DEFAULT_DTYPE, name="avgpool"):
        super().__init__(kernel, stride, dtype=dtype, name=name)

    def forward(self, x):
        k, s = self.kernel, self.stride
        ho, wo = _out_size(self.name, x.shape, k, s, 0)
        y = backend.xp.zeros(x.shape[:2] + (ho, wo), dtype=x.dtype)           # (N, C, Ho, Wo)
        for i in range(k):
            for j in range(k):
                y += x[:, :, i:i + s * ho:s, j:j + s * wo:s]
        y *= 1.0 / (k * k)
        return y, ShapeCache(x_shape=tuple(x.shape))

    def backward(self, dy, cache):
        """From y = sum of the k*k taps / k^2: every tap of a window receives dy / k^2."""
        k, s = self.kernel, self.stride
        ho, wo = dy.shape[2], dy.shape[3]
        dx = backend.xp.zeros(cache.x_shape, dtype=dy.dtype)                   # (N, C, H, W)
        g = dy * (1.0 / (k * k))                                         # (N, C, Ho, Wo)
        for i in range(k):
            for j in range(k):
                dx[:, :, i:i + s * ho:s, j:j + s * wo:s] += g
        return dx

    def spec(self, x_shape):
        return self._spec(x_shape, 1, lambda out: 0)


class Flatten(Block):
    """(N, C, H, W) -> (N, C*H*W), a reshape. Cache: :class:`ShapeCache`, the input shape."""

    def __init__(self, *, dtype=backend.DEFAULT_DTYPE, name="flatten"):
        super().__init__()
        self.name, self.dtype = name, backend.dtype_of(dtype)

    def forward(self, x):
        return x.reshape(x.shape[0], -1), ShapeCache(x_shape=tuple(x.shape))   # (N, C*H*W)

    def backward(self, dy, cache):
        return dy.reshape(cache.x_shape)                                 # (N, C, H, W)

    def spec(self, x_shape):
        out_shape = (int(x_shape[0]), math.prod(int(d) for d in x_shape[1:]))
        nb = backend.nbytes(x_shape, self.dtype)
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=out_shape,
                         flops_fwd=0.0, flops_bwd=0.0, bytes_x=nb, bytes_y=nb, bytes_cache=0,
                         bytes_params=0)
