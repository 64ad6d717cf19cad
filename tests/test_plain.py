"""The plain twins (hpcnn.nn.plain) by finite differences, and the fast blocks against them.

The fast LayerNorm, GELU and CausalSelfAttention must give the plain twins' outputs and input and
parameter gradients to 1e-12 relative (float64), on shapes that make the fast paths take their
slices (GELU over several chunks, attention over several batch slices), with attention dropout on.
"""
import numpy as np
import pytest

from gradcheck import check_block_gradients
from hpcnn.nn.core import Block, Parameter
from hpcnn.nn.layers import GELU, LayerNorm
from hpcnn.nn.plain import (attention_plain, attention_plain_backward, gelu_plain,
                            gelu_plain_backward, layer_norm_plain, layer_norm_plain_backward)
from hpcnn.nn.transformer import CausalSelfAttention

F64 = np.float64
REL = 1e-12


def _x(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


def assert_close(fast, plain, what):
    """max |fast - plain| <= 1e-12 max |plain|: relative to the array's scale."""
    fast, plain = np.asarray(fast), np.asarray(plain)
    assert fast.shape == plain.shape, (what, fast.shape, plain.shape)
    err, scale = float(np.abs(fast - plain).max()), float(np.abs(plain).max())
    assert scale > 0 and err <= REL * scale, f"{what}: max error {err:.3g} at scale {scale:.3g}"


# -- the plain twins as blocks, so that tests/gradcheck.py can check them --------------------------
class PlainLayerNorm(Block):
    def __init__(self, gamma, beta):
        super().__init__()
        self.gamma, self.beta = Parameter(gamma.copy(), "gamma"), Parameter(beta.copy(), "beta")
        self.params = [self.gamma, self.beta]

    def forward(self, x):
        return layer_norm_plain(x, self.gamma.data, self.beta.data)

    def backward(self, dy, cache):
        dx, dgamma, dbeta = layer_norm_plain_backward(dy, cache)
        self.gamma.add_grad(dgamma)
        self.beta.add_grad(dbeta)
        return dx


class PlainGELU(Block):
    def forward(self, x):
        return gelu_plain(x)

    def backward(self, dy, cache):
        return gelu_plain_backward(dy, cache)


class PlainAttention(Block):
    NAMES = ("w_qkv", "b_qkv", "w_proj", "b_proj")

    def __init__(self, arrays, n_heads, drop_mask=None):
        super().__init__()
        self.params = [Parameter(a.copy(), n) for a, n in zip(arrays, self.NAMES)]
        self.n_heads, self.drop_mask = n_heads, drop_mask

    def forward(self, x):
        return attention_plain(x, *(p.data for p in self.params), self.n_heads, self.drop_mask)

    def backward(self, dy, cache):
        g = attention_plain_backward(dy, cache)
        for p in self.params:
            p.add_grad(g[p.name])
        return g["x"]


# -- finite differences ----------------------------------------------------------------------------
def test_plain_layer_norm_gradients():
    rng = np.random.default_rng(2)
    blk = PlainLayerNorm(1 + 0.3 * rng.standard_normal(6), 0.3 * rng.standard_normal(6))
    check_block_gradients(blk, _x((2, 3, 6)) * 2 + 1)


def test_plain_gelu_gradients():
    check_block_gradients(PlainGELU(), _x((4, 9)) * 2)


@pytest.mark.parametrize("dropout", [False, True])
def test_plain_attention_gradients(dropout):
    rng = np.random.default_rng(3)
    C, nh, Bn, T = 8, 2, 2, 5
    arrays = [0.3 * rng.standard_normal(s) for s in ((C, 3 * C), (3 * C,), (C, C), (C,))]
    mask = (rng.random((Bn, nh, T, T)) > 0.3) / 0.7 if dropout else None
    check_block_gradients(PlainAttention(arrays, nh, mask), _x((Bn, T, C)))


def test_plain_attention_is_causal():
    """Changing the last position's input changes no earlier position's output."""
    rng = np.random.default_rng(4)
    C = 8
    arrays = [0.3 * rng.standard_normal(s) for s in ((C, 3 * C), (3 * C,), (C, C), (C,))]
    x = _x((2, 5, C))
    x2 = x.copy()
    x2[:, -1] += 1.0
    y, _ = attention_plain(x, *arrays, 2)
    y2, _ = attention_plain(x2, *arrays, 2)
    np.testing.assert_array_equal(y[:, :-1], y2[:, :-1])
    assert np.abs(y[:, -1] - y2[:, -1]).max() > 1e-3


# -- fast against plain ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7, 16), (3, 5, 16)])
def test_layer_norm_fast_equals_plain(shape):
    rng = np.random.default_rng(5)
    ln = LayerNorm(16, dtype=F64)
    ln.gamma.data[:] = 1 + 0.3 * rng.standard_normal(16)
    ln.beta.data[:] = 0.3 * rng.standard_normal(16)
    x, dy = _x(shape) * 3 + 2, _x(shape, 6)
    y, cache = ln.forward(x)
    dx = ln.backward(dy, cache)
    y_p, cache_p = layer_norm_plain(x, ln.gamma.data, ln.beta.data, ln.eps)
    dx_p, dgamma_p, dbeta_p = layer_norm_plain_backward(dy, cache_p)
    assert_close(y, y_p, "y")
    assert_close(dx, dx_p, "dx")
    assert_close(ln.gamma.grad, dgamma_p, "dgamma")
    assert_close(ln.beta.grad, dbeta_p, "dbeta")


def test_gelu_fast_equals_plain():
    """Over several of the fast block's chunks, and in place."""
    shape = (3, 200, 128)                      # 76,800 elements > GELU.CHUNK
    assert np.prod(shape) > GELU.CHUNK
    x, dy = _x(shape) * 3, _x(shape, 7)
    g = GELU(dtype=F64)
    y, cache = g.forward(x)
    dx = g.backward(dy, cache)
    y_p, cache_p = gelu_plain(x)
    assert_close(y, y_p, "y")
    assert_close(dx, gelu_plain_backward(dy, cache_p), "dx")
    y_in, cache_in = g.forward_inplace(x.copy())
    assert_close(y_in, y_p, "y in place")
    assert_close(g.backward_inplace(dy.copy(), cache_in), dx, "dx in place")


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_attention_fast_equals_plain(dropout):
    """Batch 3 with 4 heads of T = 128: the fast core runs over batch slices of 2 and 1."""
    Bn, T, C, nh = 3, 128, 32, 4
    attn = CausalSelfAttention(C, nh, dropout=dropout, seed=3, index=1, init_std=0.3, dtype=F64)
    assert attn._batch_step(Bn, T) < Bn
    rng = np.random.default_rng(8)
    attn.qkv.bias.data[:] = 0.3 * rng.standard_normal(3 * C)
    attn.proj.bias.data[:] = 0.3 * rng.standard_normal(C)
    x, dy = _x((Bn, T, C)), _x((Bn, T, C), 9)
    attn.zero_grad()
    out, cache = attn.forward(x)
    dx = attn.backward(dy, cache)
    c_drop = cache.c_drop                      # the fast block's DropoutCache (or None)
    assert (c_drop is None) == (dropout == 0.0)
    mask = None if c_drop is None else c_drop.mask.swapaxes(-1, -2)
    fast = [attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias]
    out_p, cache_p = attention_plain(x, *(p.data for p in fast), nh, mask)
    g = attention_plain_backward(dy, cache_p)
    assert_close(out, out_p, "out")
    assert_close(dx, g["x"], "dx")
    for p, name in zip(fast, PlainAttention.NAMES):
        assert_close(p.grad, g[name], name)
