"""GPT blocks: finite-difference gradients, causality, dropout RNG protocol, spec vs reality."""
import numpy as np
import pytest

from gradcheck import check_block_gradients
from hpcnn.nn.transformer import (CausalSelfAttention, Embedding, MLPBlock, TransformerBlock,
                                  sub_index)

F64 = np.float64
B, T, C, NH, V = 2, 5, 8, 2, 11


def _x(seed=1, shape=(B, T, C)):
    return np.random.default_rng(seed).standard_normal(shape)


def _tokens(seed=2):
    return np.random.default_rng(seed).integers(0, V, size=(B, T)).astype(np.int64)


def _randomize_ln(block, seed=5):
    """LayerNorm starts at gamma=1, beta=0; perturb them so their gradients are exercised."""
    rng = np.random.default_rng(seed)
    for p in block.params:
        if ".ln" in p.name:
            p.data += 0.3 * rng.standard_normal(p.shape)


def _cache_bytes(c):
    if isinstance(c, (tuple, list)):
        return sum(_cache_bytes(e) for e in c)
    return c.nbytes if isinstance(c, np.ndarray) else 0


def _blocks(dropout=0.0):
    return [
        CausalSelfAttention(C, NH, dropout=dropout, seed=3, index=1, init_std=0.3, dtype=F64),
        MLPBlock(C, dropout=dropout, seed=3, index=2, init_std=0.3, dtype=F64),
        TransformerBlock(C, NH, dropout=dropout, seed=3, index=3, init_std=0.3, dtype=F64),
    ]


def test_embedding_gradients():
    emb = Embedding(V, C, max_len=7, seed=3, index=0, dtype=F64)
    tok = _tokens()
    tok[0, :3] = 4                     # repeated tokens: the scatter-add must accumulate
    assert check_block_gradients(emb, tok, max_entries=60) is None
    y, _ = emb.forward(tok)
    np.testing.assert_array_equal(y, emb.wte.data[tok] + emb.wpe.data[:T])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_block_gradients(which, dropout):
    block = _blocks(dropout)[which]
    _randomize_ln(block)
    check_block_gradients(block, _x(), max_entries=25)


def test_embedding_validation():
    emb = Embedding(V, C, max_len=4, dtype=F64)
    with pytest.raises(ValueError, match=r"sequence length 5 > max_len 4"):
        emb.forward(_tokens())
    with pytest.raises(ValueError, match=r"\[0, 11\).*\[0, 11\]"):
        emb.forward(np.array([[0, 11]]))
    with pytest.raises(ValueError, match="integers"):
        emb.forward(np.zeros((2, 3)))


def test_heads_must_divide_dim():
    with pytest.raises(ValueError, match=r"dim \(10\).*n_heads \(4\)"):
        CausalSelfAttention(10, 4, dtype=F64)


def test_causality():
    emb = Embedding(V, C, max_len=T, seed=3, dtype=F64)
    blk = TransformerBlock(C, NH, seed=3, index=1, init_std=0.3, dtype=F64)
    tok = _tokens()
    y0 = blk.forward(emb.forward(tok)[0])[0]
    for t in range(T):
        tok2 = tok.copy()
        tok2[:, t] = (tok2[:, t] + 1) % V
        y1 = blk.forward(emb.forward(tok2)[0])[0]
        np.testing.assert_allclose(y1[:, :t], y0[:, :t], rtol=0, atol=1e-13)
        assert np.all(np.abs(y1[:, t:] - y0[:, t:]).max(axis=-1) > 1e-6)


def test_dropout_rng_state_and_train_eval():
    attn = CausalSelfAttention(C, NH, dropout=0.5, seed=3, index=1, init_std=0.3, dtype=F64)
    x = _x()
    state = attn.rng_state()
    y1, _ = attn.forward(x)
    y2, _ = attn.forward(x)
    assert not np.allclose(y1, y2)                      # a new mask per call
    attn.set_rng_state(state)
    np.testing.assert_array_equal(attn.forward(x)[0], y1)
    ref = CausalSelfAttention(C, NH, dropout=0.0, seed=3, index=1, init_std=0.3, dtype=F64)
    attn.eval()
    np.testing.assert_array_equal(attn.forward(x)[0], ref.forward(x)[0])

    blk = TransformerBlock(C, NH, dropout=0.5, seed=3, index=1, dtype=F64)
    state = blk.rng_state()
    assert isinstance(state, tuple) and len(state) == 3
    y1, _ = blk.forward(x)
    assert not np.allclose(blk.forward(x)[0], y1)
    blk.set_rng_state(state)
    np.testing.assert_array_equal(blk.forward(x)[0], y1)
    blk.eval()
    assert not any(b.training for b in (blk.attn.attn_drop, blk.drop, blk.mlp.drop))
    np.testing.assert_array_equal(blk.forward(x)[0], blk.forward(x)[0])
    blk.train()
    assert all(b.training for b in (blk.attn.attn_drop, blk.drop, blk.mlp.drop))
    assert not np.allclose(blk.forward(x)[0], blk.forward(x)[0])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_spec_matches_forward(dropout):
    x = _x()
    for block in _blocks(dropout):
        s = block.spec(x.shape)
        y, cache = block.forward(x)
        assert s.out_shape == y.shape and s.in_shape == x.shape
        assert s.bytes_x == x.nbytes and s.bytes_y == y.nbytes
        assert s.bytes_cache == _cache_bytes(cache), block
        assert s.bytes_params == sum(p.data.nbytes for p in block.params)
        assert s.flops_fwd > 0 and s.flops_bwd > s.flops_fwd
    emb = Embedding(V, C, max_len=T, dtype=F64)
    tok = _tokens()
    s = emb.spec(tok.shape)
    y, cache = emb.forward(tok)
    assert s.out_shape == y.shape and s.bytes_x == tok.nbytes == s.bytes_cache
    assert s.bytes_y == y.nbytes


def test_attention_flops_formula():
    s = CausalSelfAttention(128, 4, dtype=F64).spec((16, 64, 128))
    nx = 16 * 64 * 128
    matmuls = 2 * nx * (3 * 128 + 128) + 2 * 2 * 16 * 4 * 64 * 64 * 32   # proj + attention core
    assert matmuls < s.flops_fwd < 1.1 * matmuls


def test_init_keys():
    a = TransformerBlock(C, NH, seed=3, index=2, dtype=F64)
    b = TransformerBlock(C, NH, seed=3, index=2, dtype=F64)
    c = TransformerBlock(C, NH, seed=3, index=3, dtype=F64)
    for pa, pb, pc in zip(a.params, b.params, c.params):
        np.testing.assert_array_equal(pa.data, pb.data)
        if "weight" in pa.name and ".ln" not in pa.name:
            assert not np.allclose(pa.data, pc.data), pa.name
    names = [p.name for p in a.params]
    assert names[:2] == ["block.ln1.weight", "block.ln1.bias"] and len(set(names)) == len(names)
    assert sub_index(1, 4) != sub_index(20, 0) and sub_index(sub_index(1, 4), 1) != sub_index(20, 1)


def test_float32_stays_float32():
    blk = TransformerBlock(C, NH, dropout=0.1, dtype=np.float32)
    x = _x().astype(np.float32)
    y, cache = blk.forward(x)
    dx = blk.backward(np.ones_like(y), cache)
    assert y.dtype == dx.dtype == np.float32
    assert all(p.grad.dtype == np.float32 for p in blk.params)
    emb = Embedding(V, C, max_len=T, dtype=np.float32)
    assert emb.forward(_tokens())[0].dtype == np.float32


def test_attention_matches_naive_reference():
    attn = CausalSelfAttention(C, NH, seed=3, index=1, init_std=0.3, dtype=F64)
    x = _x()
    W, b = attn.qkv.weight.data, attn.qkv.bias.data
    hs = C // NH
    ref = np.zeros_like(x)
    for bi in range(B):
        qkv = x[bi] @ W + b                                       # (T, 3C)
        for h in range(NH):
            q, k, v = (qkv[:, j * C + h * hs: j * C + (h + 1) * hs] for j in range(3))
            for i in range(T):
                s = np.array([q[i] @ k[j] / np.sqrt(hs) for j in range(i + 1)])
                p = np.exp(s - s.max())
                ref[bi, i, h * hs:(h + 1) * hs] = (p / p.sum()) @ v[:i + 1]
    ref = ref @ attn.proj.weight.data + attn.proj.bias.data
    np.testing.assert_allclose(attn.forward(x)[0], ref, rtol=1e-12, atol=1e-13)


def _arrays(c):
    if isinstance(c, (tuple, list)):
        return [a for e in c for a in _arrays(e)]
    return [c] if isinstance(c, np.ndarray) else []


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_attention_batch_slices_match_whole(dropout):
    """The CPU core runs over batch slices; any slice size gives the same outputs and grads."""
    x, dy = _x(shape=(5, T, C)), _x(seed=4, shape=(5, T, C))
    results = []
    for chunk in (1, NH * T * T * 2, 1 << 20):           # 1 and 2 batch elements per slice, all
        attn = CausalSelfAttention(C, NH, dropout=dropout, seed=3, index=1, init_std=0.3,
                                   dtype=F64)
        attn.CHUNK = chunk
        y, cache = attn.forward(x)
        dx = attn.backward(dy, cache)
        results.append((y, dx, [p.grad.copy() for p in attn.params]))
    for y, dx, grads in results[1:]:
        np.testing.assert_allclose(y, results[0][0], rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(dx, results[0][1], rtol=1e-12, atol=1e-14)
        for g, g0 in zip(grads, results[0][2]):
            np.testing.assert_allclose(g, g0, rtol=1e-12, atol=1e-14)
    blk = CausalSelfAttention(C, NH, dropout=dropout, seed=3, index=1, init_std=0.3, dtype=F64)
    blk.CHUNK = 1
    check_block_gradients(blk, _x(), max_entries=25)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_caches_are_fresh_and_independent(which):
    """Two forwards in flight (as in a pipeline): no cache or output aliases scratch memory or
    the other call's arrays, and the first backward is unaffected by the second forward."""
    blk = _blocks(0.3)[which]
    _randomize_ln(blk)
    x1, x2, dy = _x(1), _x(2), _x(3)
    state = blk.rng_state()
    y1, c1 = blk.forward(x1)
    y1_ref, c1_ref = y1.copy(), [a.copy() for a in _arrays(c1)]
    y2, c2 = blk.forward(x2)
    for a in _arrays(c1) + [y1]:
        for b in _arrays(c2) + [y2]:
            assert not np.shares_memory(a, b)
    np.testing.assert_array_equal(y1, y1_ref)
    for a, ref in zip(_arrays(c1), c1_ref):
        np.testing.assert_array_equal(a, ref)
    blk.zero_grad()
    dx1 = blk.backward(dy, c1)
    g1 = [p.grad.copy() for p in blk.params]
    blk.set_rng_state(state)                       # a fresh replay of call 1 alone
    blk.zero_grad()
    dx_ref = blk.backward(dy, blk.forward(x1)[1])
    np.testing.assert_array_equal(dx1, dx_ref)
    for g, p in zip(g1, blk.params):
        np.testing.assert_array_equal(g, p.grad)


def test_deferred_weight_gradients_split_a_transformer_block():
    """B (input gradient, Linear weight halves deferred) then W equals the whole backward."""
    from hpcnn.nn.layers import Linear
    rng = np.random.default_rng(3)
    blk = TransformerBlock(8, 2, seed=4, index=1, dtype=np.float64)
    x, dy = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    y, cache = blk.forward(x)
    blk.zero_grad()
    dx_full = blk.backward(dy.copy(), cache)
    full = {p.name: p.grad.copy() for p in blk.params}
    blk.zero_grad()
    pending = []
    dx = blk.backward(dy.copy(), cache, defer=pending)
    np.testing.assert_array_equal(dx, dx_full)
    linears = {id(lin) for lin, _, _ in pending}
    assert len(pending) == 4 and all(isinstance(lin, Linear) for lin, _, _ in pending)
    for p in blk.params:                       # deferred weights untouched so far
        if p.name.endswith((".weight", ".bias")) and any(p is q for lin, _, _ in pending
                                                        for q in lin.params):
            assert not p.grad.any(), p.name
    for lin, d, c in pending:
        lin.backward_weight(d, c)
    assert len(linears) == 4
    for p in blk.params:
        np.testing.assert_allclose(p.grad, full[p.name], rtol=0, atol=1e-12)
