"""Finite-difference checks (float64) of the elementary blocks and the loss, and their specs."""
import numpy as np
import pytest

from gradcheck import check_block_gradients
from hpcnn.nn.layers import GELU, Dropout, LayerNorm, Linear, ReLU, filled
from hpcnn.nn.loss import SoftmaxCrossEntropy

F64 = np.float64


def _x(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradients(shape, bias):
    blk = Linear(7, 4, bias=bias, seed=3, dtype=F64)
    check_block_gradients(blk, _x(shape))


def test_linear_split_backward_equals_whole():
    blk = Linear(6, 5, seed=1, dtype=F64)
    x, dy = _x((4, 6)), _x((4, 5), 2)
    y, c = blk.forward(x)
    dx = blk.backward(dy, c)
    gw = blk.weight.grad.copy()
    blk.zero_grad()
    dx2 = blk.backward_input(dy, c)
    blk.backward_weight(dy, c)
    np.testing.assert_array_equal(dx, dx2)
    np.testing.assert_array_equal(gw, blk.weight.grad)


def test_linear_stacked_input_equals_row_products():
    """A (B, T, in) input runs as one (B*T, in) product: the same as the textbook per-row
    formulas y = x W + b, dx = dy W^T, dW = sum x^T dy, db = sum dy (float64)."""
    blk = Linear(7, 4, seed=3, dtype=F64)
    blk.bias.data[:] = _x((4,), 6)
    x, dy = _x((2, 3, 7)), _x((2, 3, 4), 2)
    W, b = blk.weight.data, blk.bias.data
    y, c = blk.forward(x)
    assert y.shape == (2, 3, 4)
    np.testing.assert_allclose(y, np.einsum("bti,io->bto", x, W) + b, rtol=1e-13, atol=1e-14)
    blk.zero_grad()
    dx = blk.backward(dy, c)
    assert dx.shape == x.shape
    np.testing.assert_allclose(dx, np.einsum("bto,io->bti", dy, W), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(blk.weight.grad, np.einsum("bti,bto->io", x, dy), rtol=1e-13)
    np.testing.assert_allclose(blk.bias.grad, dy.sum((0, 1)), rtol=1e-13)
    xt = _x((3, 2, 7)).transpose(1, 0, 2)               # a non-contiguous input
    np.testing.assert_allclose(blk.forward(xt)[0], xt @ W + b, rtol=1e-13, atol=1e-14)


def test_filled_vectors_are_read_only_views_of_one_memo():
    a = filled(1.0, 5, np.float32)
    assert a.dtype == np.float32 and a.shape == (5,) and (a == 1).all()
    b = filled(1.0, 3, np.float32)
    assert b.shape == (3,) and np.shares_memory(a, b)      # a prefix of the same memo
    c = filled(1.0, 9, np.float32)                          # longer: a new memo, same values
    assert c.shape == (9,) and (c == 1).all() and (a == 1).all()
    d = filled(0.25, 4, np.float64)
    assert d.dtype == np.float64 and (d == 0.25).all() and not np.shares_memory(c, d)
    m = _x((6, 4))
    np.testing.assert_allclose(filled(1.0, 6, F64) @ m, m.sum(0), rtol=1e-14)
    np.testing.assert_allclose(m @ filled(0.25, 4, F64), m.mean(1), rtol=1e-14)


def test_relu_gradients():
    x = _x((6, 5))
    x[np.abs(x) < 1e-3] = 0.5          # keep away from the kink
    check_block_gradients(ReLU(dtype=F64), x)


def _gelu_tanh(x):
    """Reference: the tanh form as written, y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _gelu_tanh_grad(x):
    t = np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.sqrt(2.0 / np.pi) * (1 + 3 * 0.044715 * x * x)


def test_gelu_gradients_and_value():
    x = _x((4, 9))
    check_block_gradients(GELU(dtype=F64), x)
    y, _ = GELU(dtype=F64).forward(np.array([0.0, 1.0, -1.0]))
    # tanh-form GELU reference values
    np.testing.assert_allclose(y, [0.0, 0.8411919906082768, -0.15880800939172324], rtol=1e-12)


@pytest.mark.parametrize("chunk", [7, 1 << 16])
def test_gelu_matches_tanh_form(chunk):
    """Value and cached derivative equal the tanh form (float64, 1e-12), whatever the slicing."""
    g = GELU(dtype=F64)
    g.CHUNK = chunk                                   # 7: many slices and a ragged last one
    x = np.concatenate([np.linspace(-12, 12, 481), _x((50,), seed=4) * 3, [0.0, -30.0, 30.0]])
    x = x.reshape(3, -1)
    y, cache = g.forward(x)
    np.testing.assert_allclose(y, _gelu_tanh(x), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(cache.dgelu, _gelu_tanh_grad(x), rtol=1e-12, atol=1e-15)
    dy = _x(x.shape, seed=5)
    np.testing.assert_allclose(g.backward(dy, cache), dy * _gelu_tanh_grad(x), rtol=1e-12,
                               atol=1e-15)
    x32 = x.astype(np.float32)
    y32, cache32 = GELU(dtype=np.float32).forward(x32)
    d32 = cache32.dgelu
    assert y32.dtype == d32.dtype == np.float32
    np.testing.assert_allclose(y32, _gelu_tanh(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d32, _gelu_tanh_grad(x), rtol=1e-4, atol=1e-5)


def test_gelu_inplace_variants_and_fresh_results():
    g = GELU(dtype=F64)
    g.CHUNK = 8
    x = _x((3, 5, 6))
    y, cache = g.forward(x)
    d = cache.dgelu
    assert not np.shares_memory(y, x) and not np.shares_memory(d, x)
    h = x.copy()
    y2, cache2 = g.forward_inplace(h)
    assert y2 is h                                    # written over its input
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(cache2.dgelu, d)
    dy = _x(x.shape, seed=2)
    dx = g.backward(dy, cache)
    dy2 = dy.copy()
    assert g.backward_inplace(dy2, cache) is dy2
    np.testing.assert_array_equal(dy2, dx)
    # a second call must not touch the first call's results (scratch stays inside the call)
    y_keep, d_keep = y.copy(), d.copy()
    g.forward(_x((3, 5, 6), seed=9))
    np.testing.assert_array_equal(y, y_keep)
    np.testing.assert_array_equal(d, d_keep)
    # non-contiguous input: forward_inplace falls back to a fresh result
    xt = _x((6, 4)).T
    yt, _ = g.forward_inplace(xt)
    np.testing.assert_allclose(yt, _gelu_tanh(xt), rtol=1e-12)


def test_layernorm_gradients():
    ln = LayerNorm(6, dtype=F64)
    rng = np.random.default_rng(0)
    ln.gamma.data[:] = rng.standard_normal(6)
    ln.beta.data[:] = rng.standard_normal(6)
    check_block_gradients(ln, _x((3, 4, 6)))
    y, _ = ln.forward(_x((3, 6)))


def test_layernorm_normalises():
    y, _ = LayerNorm(16, dtype=F64).forward(_x((5, 16)) * 3 + 2)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-4)


def test_layernorm_matches_reference_and_is_stable():
    ln = LayerNorm(16, dtype=F64)
    rng = np.random.default_rng(3)
    ln.gamma.data[:] = rng.standard_normal(16)
    ln.beta.data[:] = rng.standard_normal(16)
    x = _x((2, 5, 16)) * 3 + 2
    mu = x.mean(-1, keepdims=True)
    xhat = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + ln.eps)
    y, cache = ln.forward(x)
    np.testing.assert_allclose(y, xhat * ln.gamma.data + ln.beta.data, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cache.xhat, xhat, rtol=1e-12, atol=1e-12)
    # backward against the textbook formula, with accumulation into existing gradients
    dy = _x(x.shape, seed=7)
    ln.zero_grad()
    ln.backward(dy, cache)
    dx = ln.backward(dy, cache)
    g = dy * ln.gamma.data
    ref = (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) * cache.rstd
    np.testing.assert_allclose(dx, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ln.gamma.grad, 2 * (dy * xhat).sum((0, 1)), rtol=1e-12)
    np.testing.assert_allclose(ln.beta.grad, 2 * dy.sum((0, 1)), rtol=1e-12)
    # float32 with a large offset: two-pass variance keeps the normalisation exact enough
    x32 = (_x((64, 16)) + 1e4).astype(np.float32)
    y32, _ = LayerNorm(16, dtype=np.float32).forward(x32)
    ref32 = (x32.astype(F64) - x32.astype(F64).mean(-1, keepdims=True))
    ref32 /= np.sqrt((ref32 ** 2).mean(-1, keepdims=True) + 1e-5)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, ref32, atol=2e-3)


def test_dropout_mask_reproducible_and_gradients():
    d = Dropout(0.3, seed=5, dtype=F64)
    x = _x((8, 10))
    s = d.rng_state()
    y1, _ = d.forward(x)
    y2, _ = d.forward(x)
    assert not np.array_equal(y1, y2)            # a new mask each call
    d.set_rng_state(s)
    y3, _ = d.forward(x)
    np.testing.assert_array_equal(y1, y3)        # restored state -> same mask
    kept = y1 != 0
    np.testing.assert_allclose(y1[kept], x[kept] / 0.7)
    assert 0.5 < kept.mean() < 0.9
    check_block_gradients(d, x)
    d.eval()
    y, c = d.forward(x)
    assert y is x and c.mask is None


def test_keep_mask_rows_do_not_depend_on_the_split():
    from hpcnn import backend
    key, shape = (3, 7, 2), (11, 3, 5)
    whole = backend.keep_mask(key, 0, shape, 0.4, F64)
    for cuts in ((0, 11), (0, 1, 11), (0, 4, 5, 9, 11), tuple(range(12))):
        parts = [backend.keep_mask(key, a, (b - a,) + shape[1:], 0.4, F64)
                 for a, b in zip(cuts, cuts[1:])]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    later = backend.keep_mask(key, 6, (5, 3, 5), 0.4, np.float32)     # any start, any dtype
    assert later.dtype == np.float32
    np.testing.assert_array_equal(later, whole[6:].astype(np.float32))
    assert set(np.unique(whole)) == {0.0, 1 / 0.6}
    assert not np.array_equal(backend.keep_mask((3, 7, 3), 0, shape, 0.4, F64), whole)  # key
    big = backend.keep_mask((1,), 0, (400, 1000), 0.25, np.float32)
    assert abs((big != 0).mean() - 0.75) < 0.005                  # 4 sigma of 400k draws: 0.0028
    assert (backend.keep_mask((1,), 0, (50, 50), 0.0, F64) == 1).all()


def test_placed_dropout_gives_each_row_its_mask_whatever_the_split():
    from hpcnn.nn.layers import dropouts, place_draws
    from hpcnn.nn.transformer import TransformerBlock
    d = Dropout(0.3, seed=5, index=2, dtype=F64)
    x = _x((10, 4, 6))
    d.place(7, 0)
    whole, _ = d.forward(x)
    pieces = []
    for a, b in ((0, 3), (3, 4), (4, 10)):
        d.place(7, a)
        pieces.append(d.forward(x[a:b])[0])
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    d.place(8, 0)
    assert not np.array_equal(d.forward(x)[0], whole)            # another step, another mask
    d.place(7, 0)
    s = d.rng_state()
    y1 = d.forward(x)[0]
    d.set_rng_state(s)
    np.testing.assert_array_equal(d.forward(x)[0], y1)           # restored: the same mask
    np.testing.assert_array_equal(y1, whole)
    blk = TransformerBlock(8, 2, dropout=0.1, index=4, dtype=F64)  # nested dropouts are found
    found = dropouts([blk, [blk]])
    assert len(found) == 3 and len({id(f) for f in found}) == 3
    place_draws(blk, 5, 9)
    assert all(f.rng_state() == (5, 9) for f in found)


def test_dropout_rejects_bad_p():
    with pytest.raises(ValueError, match="1.5"):
        Dropout(1.5)


def test_cross_entropy_value_gradient_and_ignore():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 7)) * 3
    t = rng.integers(0, 7, size=(2, 5))
    t[0, 1] = t[1, 4] = -100
    ce = SoftmaxCrossEntropy()
    loss, cache = ce.forward(logits, t)
    z = logits.reshape(-1, 7)
    lse = np.log(np.exp(z).sum(1))
    tt = t.reshape(-1)
    keep = tt != -100
    ref = np.mean(lse[keep] - z[keep, tt[keep]])
    assert abs(loss - ref) < 1e-12
    g = ce.backward(1.0, cache)
    eps = 1e-6
    for i in [(0, 0, 3), (1, 2, 0), (0, 1, 2), (1, 4, 6)]:
        lp, lm = logits.copy(), logits.copy()
        lp[i] += eps
        lm[i] -= eps
        num = (ce.forward(lp, t)[0] - ce.forward(lm, t)[0]) / (2 * eps)
        assert abs(num - g[i]) < 1e-8, (i, num, g[i])
    assert np.all(g[0, 1] == 0) and np.all(g[1, 4] == 0)


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4]])
    loss, _ = SoftmaxCrossEntropy().forward(logits, np.array([0]))
    assert loss == 0.0
    loss, _ = SoftmaxCrossEntropy().forward(logits, np.array([1]))
    assert abs(loss - 1e4) < 1e-9


def test_cross_entropy_errors():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        SoftmaxCrossEntropy().forward(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="targets shape"):
        SoftmaxCrossEntropy().forward(np.zeros((2, 3)), np.array([0, 1, 2]))


def test_specs_match_arrays():
    x = _x((4, 3, 8))
    for blk in (Linear(8, 5, dtype=F64), ReLU(dtype=F64), GELU(dtype=F64), LayerNorm(8, dtype=F64)):
        y, cache = blk.forward(x)
        s = blk.spec(x.shape)
        assert s.out_shape == y.shape
        assert s.bytes_x == x.nbytes and s.bytes_y == y.nbytes
        arrays = cache if isinstance(cache, tuple) else (cache,)
        assert s.bytes_cache == sum(a.nbytes for a in arrays), blk
    lin = Linear(8, 5, dtype=F64).spec((4, 3, 8))
    assert lin.flops_fwd == 2 * 12 * 8 * 5 + 12 * 5
    assert lin.bytes_params == (8 * 5 + 5) * 8
