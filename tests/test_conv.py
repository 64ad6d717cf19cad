"""Convolution blocks: finite differences (float64), loop-based references, specs, errors."""
import numpy as np
import pytest

from gradcheck import check_block_gradients
from hpcnn.nn.conv import AvgPool2d, Conv2d, Flatten, MaxPool2d

F64 = np.float64
GEOMETRY = [(1, 0), (1, 1), (2, 1), (2, 0)]      # (stride, padding)


def _x(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


def _distinct(shape, seed=2):
    """Distinct values 0.1 apart in random order: no ties, even after a 1e-6 perturbation."""
    n = int(np.prod(shape))
    return np.random.default_rng(seed).permutation(n).reshape(shape) * 0.1 - 0.05 * n


def _conv(seed=4, **kw):
    blk = Conv2d(3, 4, kw.pop("kernel"), seed=seed, dtype=F64, **kw)
    if blk.bias is not None:                      # non-zero bias, so the forward checks it too
        blk.bias.data[...] = _x(blk.bias.shape, seed=seed + 1)
    return blk


def conv_reference(x, w, b, stride, padding):
    """Direct cross-correlation, one output pixel at a time."""
    n, c, h, wd = x.shape
    o, _, k, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    ho, wo = (h + 2 * padding - k) // stride + 1, (wd + 2 * padding - k) // stride + 1
    y = np.zeros((n, o, ho, wo))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            y[:, :, i, j] = np.tensordot(patch, w, axes=([1, 2, 3], [1, 2, 3]))
    return y if b is None else y + b[None, :, None, None]


def pool_reference(x, k, s, op):
    n, c, h, w = x.shape
    ho, wo = (h - k) // s + 1, (w - k) // s + 1
    y = np.zeros((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            y[:, :, i, j] = op(x[:, :, i * s:i * s + k, j * s:j * s + k], axis=(2, 3))
    return y


@pytest.mark.parametrize("stride,padding", GEOMETRY)
@pytest.mark.parametrize("kernel", [2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_gradients(stride, padding, kernel, bias):
    blk = _conv(kernel=kernel, stride=stride, padding=padding, bias=bias)
    check_block_gradients(blk, _x((2, 3, 7, 6)))


@pytest.mark.parametrize("stride,padding", GEOMETRY)
@pytest.mark.parametrize("kernel", [2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_matches_reference(stride, padding, kernel, bias):
    blk = _conv(kernel=kernel, stride=stride, padding=padding, bias=bias)
    x = _x((2, 3, 7, 6))
    y, _ = blk.forward(x)
    b = None if blk.bias is None else blk.bias.data
    np.testing.assert_allclose(y, conv_reference(x, blk.weight.data, b, stride, padding),
                               rtol=1e-12, atol=1e-12)


POOLS = [(2, None, (2, 3, 6, 8)),                 # the main case: non-overlapping, divisible
         (3, 2, (2, 3, 7, 9)),                    # overlapping windows
         (2, 3, (1, 2, 8, 7))]                    # gaps between windows


@pytest.mark.parametrize("kernel,stride,shape", POOLS)
def test_maxpool_gradients_and_reference(kernel, stride, shape):
    blk = MaxPool2d(kernel, stride, dtype=F64)
    x = _distinct(shape)
    y, _ = blk.forward(x)
    np.testing.assert_array_equal(y, pool_reference(x, kernel, stride or kernel, np.max))
    check_block_gradients(blk, x)


@pytest.mark.parametrize("kernel,stride,shape", POOLS)
def test_avgpool_gradients_and_reference(kernel, stride, shape):
    blk = AvgPool2d(kernel, stride, dtype=F64)
    x = _x(shape)
    y, _ = blk.forward(x)
    np.testing.assert_allclose(y, pool_reference(x, kernel, stride or kernel, np.mean),
                               rtol=1e-12, atol=1e-14)
    check_block_gradients(blk, x)


def test_maxpool_ties_go_to_the_first_maximum():
    blk = MaxPool2d(2, dtype=F64)
    x = np.ones((1, 1, 2, 4))
    x[0, 0, 1, 3] = 2.0                           # right window: unique max at (1, 1) of it
    y, cache = blk.forward(x)
    dx = blk.backward(np.array([[[[3.0, 5.0]]]]), cache)
    np.testing.assert_array_equal(dx[0, 0], [[3, 0, 0, 0], [0, 0, 0, 5]])


def test_flatten_gradients():
    blk = Flatten(dtype=F64)
    x = _x((3, 2, 4, 5))
    y, _ = blk.forward(x)
    assert y.shape == (3, 40)
    np.testing.assert_array_equal(y[1], x[1].ravel())
    check_block_gradients(blk, x)


def _cache_bytes(cache):
    if isinstance(cache, np.ndarray):
        return cache.nbytes
    if isinstance(cache, tuple):
        return sum(_cache_bytes(c) for c in cache)
    return 0


@pytest.mark.parametrize("blk", [
    Conv2d(3, 5, 3, padding=1, dtype=F64), Conv2d(3, 5, 2, stride=2, bias=False),
    MaxPool2d(2), MaxPool2d(3, 2, dtype=F64), AvgPool2d(2), AvgPool2d(3, 2, dtype=F64),
    Flatten()], ids=repr)
def test_spec_matches_forward(blk):
    x = _x((2, 3, 7, 8)).astype(blk.dtype)
    y, cache = blk.forward(x)
    spec = blk.spec(x.shape)
    assert spec.in_shape == x.shape and spec.out_shape == y.shape
    assert spec.bytes_x == x.nbytes and spec.bytes_y == y.nbytes
    assert spec.bytes_cache == _cache_bytes(cache)
    assert spec.bytes_params == sum(p.data.nbytes for p in blk.params)
    assert blk.backward(np.ones_like(y), cache).shape == x.shape


def test_conv_spec_flops():
    blk = Conv2d(3, 5, 3, stride=2, padding=1, dtype=F64)
    spec = blk.spec((4, 3, 9, 9))                 # Ho = Wo = 5
    mm = 2 * 4 * 5 * 5 * 5 * 3 * 3 * 3
    assert spec.out_shape == (4, 5, 5, 5)
    assert spec.flops_fwd == mm + 4 * 5 * 5 * 5 and spec.flops_bwd == 2 * mm + 4 * 5 * 5 * 5


@pytest.mark.parametrize("blk", [Conv2d(3, 4, 3, dtype=F64), MaxPool2d(2, dtype=F64),
                                 AvgPool2d(2, dtype=F64)], ids=repr)
def test_dtype_is_kept(blk):
    for dt in (np.float32, np.float64):
        x = _x((2, 3, 6, 6)).astype(dt)
        y, cache = blk.forward(x)
        assert y.dtype == dt and blk.backward(np.ones_like(y), cache).dtype == dt


def test_conv_init_is_keyed_and_he_uniform():
    a, b = Conv2d(16, 8, 3, seed=7, index=2), Conv2d(16, 8, 3, seed=7, index=2)
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    assert not np.array_equal(a.weight.data, Conv2d(16, 8, 3, seed=7, index=3).weight.data)
    assert a.weight.shape == (8, 16, 3, 3) and a.weight.data.dtype == np.float32
    assert np.abs(a.weight.data).max() <= np.sqrt(6 / (16 * 9))
    assert [p.name for p in a.params] == ["conv.weight", "conv.bias"]


def test_errors_name_the_values():
    conv = Conv2d(3, 4, 5, padding=1)
    with pytest.raises(ValueError, match="2 channels, expected 3"):
        conv.forward(np.zeros((1, 2, 8, 8), np.float32))
    with pytest.raises(ValueError, match=r"input 2x8 \(padding 1\) is smaller than the 5x5"):
        conv.forward(np.zeros((1, 3, 2, 8), np.float32))
    with pytest.raises(ValueError, match=r"\(N, C, H, W\) input, got shape \(3, 8, 8\)"):
        conv.spec((3, 8, 8))
    with pytest.raises(ValueError, match="input 1x4"):
        MaxPool2d(2).forward(np.zeros((1, 1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="stride=0"):
        AvgPool2d(2, 0)
