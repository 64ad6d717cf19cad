"""GPT blocks: token + position Embedding, CausalSelfAttention, MLPBlock, pre-LN TransformerBlock.

Each forward returns ``(y, cache)``, the cache a NamedTuple whose fields are named as the
forward's locals (``c_qkv``: the cache of ``self.qkv``); each backward reads those names and
quotes the forward line it differentiates. The blocks built from Linears take
``backward(dy, cache, defer=None)``: with a list, their Linears defer the weight gradients into
it (:class:`~hpcnn.nn.layers.Linear`, zero-bubble pipelines).
Activations are ``(B, T, C)``: batch, time, channels; attention heads are ``(B, nh, T, hs)`` with
``C = nh * hs``. The layout follows karpathy/nanoGPT ``model.py``; the attention backward uses
the FlashAttention identity ``rowsum(dP * P) = rowsum(dO * O)`` (Dao et al. 2022, Alg. 2) so
the softmax backward needs no extra ``(B, nh, T, T)`` temporary.

Initial values depend only on ``(seed, index)`` of the outer block: sub-block ``k`` of the block
keyed ``index`` is keyed :func:`sub_index` ``(index, k)``, so a chain split into pipeline stages
or shards draws the same weights and the same dropout masks.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy  # host-side initial values and dtypes only; array code goes through backend.xp

from hpcnn import backend
from hpcnn.nn.core import Block, BlockSpec, init_rng, param_from_host
from hpcnn.nn.layers import (GELU, Dropout, DropoutCache, GELUCache, LayerNorm, LayerNormCache,
                             Linear)

_SUB = 1 << 62   # sub-block keys live above any top-level chain index


def sub_index(index: int, k: int) -> int:
    """The init/dropout key of sub-block ``k`` (0 <= k < 16) of the block keyed ``index``.

    ``2**62 + 16 * index + k``: injective in ``(index, k)``, and each nesting level lands in its
    own range, so a sub-block never shares a key with a top-level block or another level.
    """
    if not 0 <= k < 16:
        raise ValueError(f"sub-block number must be in [0, 16), got {k}")
    return _SUB + 16 * int(index) + int(k)


def _check_btc(name, x, dim):
    if x.ndim != 3 or x.shape[-1] != dim:
        raise ValueError(f"{name}: expected input (B, T, {dim}), got shape {tuple(x.shape)}")
    return x.shape


def _residual_spec(name, x_shape, dtype):
    """y = x + f(x): one add forward, one add of the skip gradient backward; nothing cached."""
    nb = backend.nbytes(x_shape, dtype)
    n = nb // numpy.dtype(dtype).itemsize
    return BlockSpec(name=name, in_shape=tuple(x_shape), out_shape=tuple(x_shape), flops_fwd=n,
                     flops_bwd=n, bytes_x=nb, bytes_y=nb, bytes_cache=0, bytes_params=0)


def check_tokens(name: str, tokens, max_len: int, vocab: int) -> int:
    """Raise ValueError unless ``tokens`` are integer ids in [0, vocab) of shape (B, T <= max_len);
    returns T. The range is checked on host arrays only: on a device it would be a host
    round-trip per call, so there the batch is checked before it leaves the host
    (:meth:`hpcnn.task.Task.to_device`)."""
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        raise ValueError(f"{name}: tokens must be integers of shape (B, T), got "
                         f"{tokens.dtype} {tuple(tokens.shape)}")
    T = tokens.shape[1]
    if T > max_len:
        raise ValueError(f"{name}: sequence length {T} > max_len {max_len}")
    if tokens.size and isinstance(tokens, numpy.ndarray):
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"{name}: token ids must lie in [0, {vocab}), got range [{lo}, {hi}]")
    return T


class EmbeddingCache(NamedTuple):
    """``tokens`` (B, T): the input ids (the rows of wte that get a gradient)."""
    tokens: Any


class Embedding(Block):
    """y = wte[tokens] + wpe[:T]: learned token and position embeddings.

    Parameters: vocab, dim, max_len; init normal(0, 0.02) keyed (seed, index, 0) for wte and
    (seed, index, 1) for wpe.
    forward(tokens int (B, T)) -> (B, T, dim); cache: :class:`EmbeddingCache`, the tokens.
    backward returns None (the input is discrete) after accumulating into wte.grad and wpe.grad.
    """

    def __init__(self, vocab, dim, max_len, *, seed=0, index=0, dtype=backend.DEFAULT_DTYPE,
                 name="embed", keep=None):
        super().__init__()
        self.name, self.dtype = name, backend.dtype_of(dtype)
        self.vocab, self.dim, self.max_len = int(vocab), int(dim), int(max_len)
        te, pe = (self.vocab, self.dim), (self.max_len, self.dim)
        self.wte = param_from_host(lambda: init_rng(seed, index, 0).standard_normal(te) * 0.02,
                                   self.dtype, f"{name}.wte", shape=te, keep=keep)
        self.wpe = param_from_host(lambda: init_rng(seed, index, 1).standard_normal(pe) * 0.02,
                                   self.dtype, f"{name}.wpe", shape=pe, keep=keep)
        self.params = [self.wte, self.wpe]

    def forward(self, tokens):
        T = check_tokens(self.name, tokens, self.max_len, self.vocab)
        y = self.wte.data[tokens]                        # (B, T, C)
        y += self.wpe.data[:T]                           # (T, C) broadcast over B
        return y, EmbeddingCache(tokens=tokens)

    def backward(self, dy, cache):
        xp = backend.xp
        tokens, dy = cache.tokens, backend.up(dy)        # gradients in the compute dtype
        T, C = tokens.shape[1], self.dim
        # from y += wpe[:T]
        self.wpe.grad[:T] += dy.sum(axis=0)              # (T, C)
        # from y = wte[tokens]: scatter-add rows, repeated tokens accumulate (exact, in order)
        g = self.wte.grad
        if g.flags.c_contiguous:                         # 1-D add.at: numpy's fast path
            idx = (tokens.reshape(-1, 1) * C + xp.arange(C)).reshape(-1)   # (B*T*C,)
            xp.add.at(g.reshape(-1), idx, dy.reshape(-1))
        else:
            xp.add.at(g, tokens, dy)
        return None

    def spec(self, x_shape):
        B, T = x_shape
        out_shape = (B, T, self.dim)
        nb_tok = backend.nbytes(x_shape, numpy.int64)
        ny = B * T * self.dim
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=out_shape, flops_fwd=ny,
                         flops_bwd=2 * ny, bytes_x=nb_tok,
                         bytes_y=backend.nbytes(out_shape, self.dtype), bytes_cache=nb_tok,
                         bytes_params=sum(backend.nbytes(p.shape, self.dtype) for p in self.params),
                         cache_has_x=True)


class AttentionCache(NamedTuple):
    """The cache of :class:`CausalSelfAttention` (and of its tensor-parallel version)."""
    c_qkv: Any          # self.qkv's cache: the block input x
    qkv: Any            # (B, T, 3C) the projection's output, q | k | v
    att: Any            # (B, nh, T_key, T_query) attention probabilities, key-major
    c_drop: Any         # self.attn_drop's DropoutCache, or None when it is the identity
    c_proj: Any         # self.proj's cache: the merged head output y (B, T, C)


class CausalSelfAttention(Block):
    """Multi-head causal self-attention: qkv projection, softmax(q k^T / sqrt(hs)) v, projection.

    forward(x (B, T, C)) -> (B, T, C). Cache: :class:`AttentionCache`: the qkv input (x), the
    qkv output, the attention probabilities, the attention-dropout mask (or None) and the merged
    head output y (the input of ``proj``). ``init_std`` is the std of the qkv weights,
    ``proj_std`` that of the output projection (GPT-2: 0.02 / sqrt(2 n_layers); default
    init_std).

    The probabilities are stored key-major, ``att[b, h, j, i]`` for query i and key j, so the
    softmax reductions run down axis -2, vectorised along the queries. The 1/sqrt(hs) scale is
    applied while copying q^T (forward) and dy^T (backward) into contiguous scratch, which makes
    every batched product a plain or left-transposed BLAS call. On the CPU the core runs over
    slices of the batch whose (nh, T, T) scores stay in cache.
    Plain twin: :func:`hpcnn.nn.plain.attention_plain`.
    """

    CHUNK = 1 << 17      # score elements per cache-resident batch slice on the CPU
    defers_weights = True

    def __init__(self, dim, n_heads, *, dropout=0.0, seed=0, index=0, init_std=0.02,
                 proj_std=None, dtype=backend.DEFAULT_DTYPE, name="attn", keep=None):
        super().__init__()
        dim, n_heads = int(dim), int(n_heads)
        if n_heads <= 0 or dim % n_heads != 0:
            raise ValueError(f"{name}: dim ({dim}) must be a multiple of n_heads ({n_heads})")
        self.name, self.dim, self.n_heads, self.dtype = name, dim, n_heads, backend.dtype_of(dtype)
        self.head_size = dim // n_heads
        self.scale = 1.0 / math.sqrt(self.head_size)
        proj_std = init_std if proj_std is None else proj_std
        self.qkv = Linear(dim, 3 * dim, seed=seed, index=sub_index(index, 0), init_std=init_std,
                          dtype=dtype, name=f"{name}.qkv", keep=keep)
        self.proj = Linear(dim, dim, seed=seed, index=sub_index(index, 1), init_std=proj_std,
                           dtype=dtype, name=f"{name}.proj", keep=keep)
        self.attn_drop = Dropout(dropout, seed=seed, index=sub_index(index, 2), dtype=dtype,
                                 name=f"{name}.drop")
        self.params = self.qkv.params + self.proj.params
        self._consts = {}   # (T, dtype) -> causal bias: a memo, not per-call state
        self._scratch = {}  # (name, dtype) -> reused buffer for temporaries (never returned)

    def _causal(self, T, dtype):
        """(T_key, T_query) additive mask: 0 where key <= query, -inf for the future."""
        key = ("causal", int(T), dtype)
        bias = self._consts.get(key)
        if bias is None or not isinstance(bias, backend.xp.ndarray):
            future = backend.xp.tril(backend.xp.ones((T, T), dtype=bool), k=-1)   # key j > query i
            bias = self._consts[key] = backend.xp.where(future, -backend.xp.inf, 0.0).astype(dtype)
        return bias

    def _buffer(self, name, shape, dtype):
        """A reused scratch array of ``shape`` (temporaries only: never cached or returned)."""
        n = 1
        for d in shape:
            n *= int(d)
        key = (name, dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n or not isinstance(buf, backend.xp.ndarray):
            buf = self._scratch[key] = backend.xp.empty(n, dtype=dtype)
        return buf[:n].reshape(shape)

    def _batch_step(self, B, T):
        """Batch elements per slice of the attention core (the whole batch on a GPU)."""
        if backend.device != "cpu":
            return max(1, B)
        return max(1, min(B, self.CHUNK // max(1, self.n_heads * T * T)))

    def _heads(self, qkv):
        """(B, T, 3C) -> q, k, v views, each (B, nh, T, hs)."""
        B, T, _ = qkv.shape
        return qkv.reshape(B, T, 3, self.n_heads, self.head_size).transpose(2, 0, 3, 1, 4)

    def rng_state(self):
        return self.attn_drop.rng_state()

    def set_rng_state(self, state):
        self.attn_drop.set_rng_state(state)

    def train(self, mode=True):
        super().train(mode)
        self.attn_drop.train(mode)
        return self

    def forward(self, x):
        xp = backend.xp
        B, T, C = _check_btc(self.name, x, self.dim)
        nh, hs = self.n_heads, self.head_size
        qkv, c_qkv = self.qkv.forward(x)                         # (B, T, 3C), stored
        q, k, v = self._heads(backend.up(qkv))                   # (B, nh, T, hs), computed in
        dt = q.dtype                                             # fp32 when stored in 16 bits
        bias = self._causal(T, dt)                               # (T, T)
        dropping = self.attn_drop.training and self.attn_drop.p > 0.0
        att = xp.empty((B, nh, T, T), dtype=dt)                 # (B, nh, T_key, T_query)
        y = xp.empty((B, T, nh, hs), dtype=dt)                  # (B, T, nh, hs)
        yh = y.transpose(0, 2, 1, 3)                             # (B, nh, T, hs) view of y
        bs = self._batch_step(B, T)
        qT_buf = self._buffer("qT", (bs, nh, hs, T), dt)
        for b0 in range(0, B, bs):
            sl = slice(b0, min(B, b0 + bs))
            a = att[sl]                                          # (n, nh, T, T) slice
            qT = xp.multiply(q[sl].swapaxes(-1, -2), self.scale, out=qT_buf[:a.shape[0]])
            xp.matmul(k[sl], qT, out=a)                          # s = k q^T / sqrt(hs)
            a += bias                                            # no attention to the future
            a -= a.max(axis=-2, keepdims=True)                   # (n, nh, 1, T) column max
            xp.exp(a, out=a)
            s = a.sum(axis=-2, keepdims=True)                    # (n, nh, 1, T)
            a *= xp.divide(1.0, s, out=s)                        # softmax over keys, in place
            if not dropping:
                xp.matmul(a.swapaxes(-1, -2), v[sl], out=yh[sl]) # y = att^T v
        c_drop = None
        if dropping:
            att_d, c_drop = self.attn_drop.forward(att)          # (B, nh, T, T)
            xp.matmul(att_d.swapaxes(-1, -2), v, out=yh)
        y = backend.down(y.reshape(B, T, C), self.dtype)        # (B, T, C) heads merged
        out, c_proj = self.proj.forward(y)                       # (B, T, C)
        return out, AttentionCache(c_qkv=c_qkv, qkv=qkv, att=backend.down(att, self.dtype),
                                   c_drop=c_drop, c_proj=c_proj)

    def backward(self, dy, cache, defer=None):
        xp = backend.xp
        att, c_drop = backend.up(cache.att), cache.c_drop         # 16-bit storage: in fp32
        y = backend.up(cache.c_proj.x)                           # (B, T, C) merged heads
        B, T, C = y.shape
        nh, hs = self.n_heads, self.head_size
        q, k, v = self._heads(backend.up(cache.qkv))             # (B, nh, T, hs)
        # from: out, c_proj = self.proj.forward(y)
        dyc = backend.up(self.proj.backward(dy, cache.c_proj, defer))   # (B, T, C)
        dyh = dyc.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)   # (B, nh, T, hs) view
        dqkv = xp.empty((B, T, 3, nh, hs), dtype=dyc.dtype)     # (B, T, 3, nh, hs)
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)               # (B, nh, T, hs) views
        dt = dyc.dtype
        # from: att *= 1/sum after exp:  ds = att * (datt - colsum(datt * att)); the column sum
        # equals dy . y per head (FlashAttention identity; also with dropout): a (B, T, C) product.
        D = xp.einsum("bthd,bthd->bht", dyc.reshape(B, T, nh, hs),
                      y.reshape(B, T, nh, hs))                  # (B, nh, T_query)
        D *= self.scale                                          # all of ds carries 1/sqrt(hs)
        D = D[:, :, None, :]                                     # (B, nh, 1, T_query)
        att_d = att if c_drop is None else att * c_drop.mask     # (B, nh, T, T) recomputed
        bs = self._batch_step(B, T)
        dT_buf = self._buffer("dT", (bs, nh, hs, T), dt)
        datt_buf = self._buffer("datt", (bs, nh, T, T), dt)
        for b0 in range(0, B, bs):
            sl = slice(b0, min(B, b0 + bs))
            n = min(B, b0 + bs) - b0
            # from: y = att_d^T v  ->  dv = att_d dy, datt_d = v dy^T (times 1/sqrt(hs) here)
            xp.matmul(att_d[sl], dyh[sl], out=dv[sl])
            dT = xp.multiply(dyh[sl].swapaxes(-1, -2), self.scale, out=dT_buf[:n])
            datt = xp.matmul(v[sl], dT, out=datt_buf[:n])        # (n, nh, T_key, T_query)
            if c_drop is not None:                               # from: att_d = drop(att)
                datt = self.attn_drop.backward(datt, DropoutCache(mask=c_drop.mask[sl]))
            datt -= D[sl]
            datt *= att[sl]                                      # ds / sqrt(hs); masked: att = 0
            # from: s = k q^T / sqrt(hs)  ->  dq = ds^T k / sqrt(hs), dk = ds q / sqrt(hs)
            xp.matmul(datt.swapaxes(-1, -2), k[sl], out=dq[sl])
            xp.matmul(datt, q[sl], out=dk[sl])
        # from: qkv, c_qkv = self.qkv.forward(x)
        dqkv = backend.down(dqkv.reshape(B, T, 3 * C), dy.dtype)                 # (B, T, 3C)
        return self.qkv.backward(dqkv, cache.c_qkv, defer)                        # (B, T, C)

    def spec(self, x_shape):
        B, T, C = x_shape
        nh, hs, dt = self.n_heads, self.head_size, self.dtype
        att_shape, n_att, nx = (B, nh, T, T), B * nh * T * T, B * T * C
        mm = 2.0 * n_att * hs   # one batched (T x hs)(hs x T) or (T x T)(T x hs) product
        qkv_shape = (B, T, 3 * C)
        # scores + softmax: fwd q^T scale, k q^T, 6 per score (mask, max, sub, exp, sum, mul);
        # bwd dq, dk products, dy^T scale, D = rowsum(dy*y) (2 per element), 2 per score.
        scores = BlockSpec(name=f"{self.name}.scores", in_shape=qkv_shape, out_shape=att_shape,
                           flops_fwd=mm + nx + 6 * n_att, flops_bwd=2 * mm + 3 * nx + 2 * n_att,
                           bytes_x=backend.nbytes(qkv_shape, dt),
                           bytes_y=backend.nbytes(att_shape, dt),
                           bytes_cache=(backend.nbytes(qkv_shape, dt)
                                        + backend.nbytes(att_shape, dt)),
                           bytes_params=0)
        # y = att_d^T v: fwd one product; bwd dv and datt products (+ att * mask recomputed).
        redo = n_att if self.attn_drop.p > 0 else 0
        av = BlockSpec(name=f"{self.name}.av", in_shape=att_shape, out_shape=tuple(x_shape),
                       flops_fwd=mm, flops_bwd=2 * mm + redo, bytes_x=backend.nbytes(att_shape, dt),
                       bytes_y=backend.nbytes(x_shape, dt), bytes_cache=0, bytes_params=0)
        return BlockSpec.compose(self.name, [self.qkv.spec(x_shape), scores,
                                             self.attn_drop.spec(att_shape), av,
                                             self.proj.spec(x_shape)])


class MLPCache(NamedTuple):
    """The cache of :class:`MLPBlock` (and of its tensor-parallel version): its sub-blocks'."""
    c_fc: Any           # self.fc's cache: the block input x
    c_act: GELUCache    # gelu'(h)
    c_proj: Any         # self.proj's cache: the GELU output g
    c_drop: DropoutCache


class MLPBlock(Block):
    """y = Dropout(Linear(GELU(Linear(x)))): (B, T, C) -> (B, T, hidden) -> (B, T, C).

    No residual and no norm inside (the TransformerBlock adds those). Cache: :class:`MLPCache`,
    the caches of fc, GELU, proj and dropout.
    """

    defers_weights = True

    def __init__(self, dim, hidden=None, *, dropout=0.0, seed=0, index=0, init_std=0.02,
                 proj_std=None, dtype=backend.DEFAULT_DTYPE, name="mlp", keep=None):
        super().__init__()
        self.name, self.dim, self.dtype = name, int(dim), backend.dtype_of(dtype)
        self.hidden = 4 * self.dim if hidden is None else int(hidden)
        proj_std = init_std if proj_std is None else proj_std
        self.fc = Linear(dim, self.hidden, seed=seed, index=sub_index(index, 0),
                         init_std=init_std, dtype=dtype, name=f"{name}.fc", keep=keep)
        self.act = GELU(dtype=dtype)
        self.proj = Linear(self.hidden, dim, seed=seed, index=sub_index(index, 1),
                           init_std=proj_std, dtype=dtype, name=f"{name}.proj", keep=keep)
        self.drop = Dropout(dropout, seed=seed, index=sub_index(index, 2), dtype=dtype,
                            name=f"{name}.drop")
        self.params = self.fc.params + self.proj.params

    def rng_state(self):
        return self.drop.rng_state()

    def set_rng_state(self, state):
        self.drop.set_rng_state(state)

    def train(self, mode=True):
        super().train(mode)
        self.drop.train(mode)
        return self

    def forward(self, x):
        h, c_fc = self.fc.forward(x)                 # (B, T, H), a fresh array
        g, c_act = self.act.forward_inplace(h)       # (B, T, H): g written over h
        o, c_proj = self.proj.forward(g)             # (B, T, C)
        o, c_drop = self.drop.forward(o)             # (B, T, C)
        return o, MLPCache(c_fc=c_fc, c_act=c_act, c_proj=c_proj, c_drop=c_drop)

    def backward(self, dy, cache, defer=None):
        do = self.drop.backward(dy, cache.c_drop)          # from o, c_drop = self.drop.forward(o)
        dg = self.proj.backward(do, cache.c_proj, defer)   # from o, c_proj = self.proj.forward(g)
        dh = self.act.backward_inplace(dg, cache.c_act)    # from g, c_act = self.act.forward(h)
        return self.fc.backward(dh, cache.c_fc, defer)     # from h, c_fc = self.fc.forward(x)

    def spec(self, x_shape):
        h_shape = tuple(x_shape[:-1]) + (self.hidden,)
        return BlockSpec.compose(self.name, [self.fc.spec(x_shape), self.act.spec(h_shape),
                                             self.proj.spec(h_shape), self.drop.spec(x_shape)])


class TransformerBlockCache(NamedTuple):
    """The cache of :class:`TransformerBlock` (and of its tensor-parallel version): the
    sub-blocks' caches (the residual stream needs none)."""
    c_ln1: LayerNormCache
    c_attn: AttentionCache
    c_drop: DropoutCache
    c_ln2: LayerNormCache
    c_mlp: MLPCache


class TransformerBlock(Block):
    """Pre-LN GPT block: x = x + Dropout(attn(ln1(x))); x = x + mlp(ln2(x)).

    ``params`` is ln1, attn, ln2, mlp in that order. :meth:`rng_state` is the tuple of the
    attention-dropout, residual-dropout and MLP-dropout states. Cache:
    :class:`TransformerBlockCache`, the sub-blocks' caches.
    """

    defers_weights = True

    def __init__(self, dim, n_heads, *, hidden=None, dropout=0.0, seed=0, index=0,
                 init_std=0.02, proj_std=None, dtype=backend.DEFAULT_DTYPE, name="block",
                 keep=None):
        super().__init__()
        self.name, self.dim, self.dtype = name, int(dim), backend.dtype_of(dtype)
        kw = dict(seed=seed, dtype=dtype)
        self.ln1 = LayerNorm(dim, dtype=dtype, name=f"{name}.ln1", keep=keep)
        self.attn = CausalSelfAttention(dim, n_heads, dropout=dropout, index=sub_index(index, 1),
                                        init_std=init_std, proj_std=proj_std,
                                        name=f"{name}.attn", keep=keep, **kw)
        self.drop = Dropout(dropout, index=sub_index(index, 2), name=f"{name}.drop", **kw)
        self.ln2 = LayerNorm(dim, dtype=dtype, name=f"{name}.ln2", keep=keep)
        self.mlp = MLPBlock(dim, hidden, dropout=dropout, index=sub_index(index, 4),
                            init_std=init_std, proj_std=proj_std, name=f"{name}.mlp", keep=keep,
                            **kw)
        self.params = self.ln1.params + self.attn.params + self.ln2.params + self.mlp.params

    def rng_state(self):
        return (self.attn.rng_state(), self.drop.rng_state(), self.mlp.rng_state())

    def set_rng_state(self, state):
        s_attn, s_drop, s_mlp = state
        self.attn.set_rng_state(s_attn)
        self.drop.set_rng_state(s_drop)
        self.mlp.set_rng_state(s_mlp)

    def train(self, mode=True):
        super().train(mode)
        for b in (self.ln1, self.attn, self.drop, self.ln2, self.mlp):
            b.train(mode)
        return self

    def forward(self, x):
        _check_btc(self.name, x, self.dim)
        h1, c_ln1 = self.ln1.forward(x)              # (B, T, C)
        a, c_attn = self.attn.forward(h1)            # (B, T, C)
        a, c_drop = self.drop.forward(a)             # (B, T, C)
        a += x                                       # x1 = x + drop(attn(ln1(x))); a is ours
        h2, c_ln2 = self.ln2.forward(a)              # (B, T, C)
        y, c_mlp = self.mlp.forward(h2)              # (B, T, C)
        y += a                                       # y = x1 + mlp(ln2(x1)); y is ours
        return y, TransformerBlockCache(c_ln1=c_ln1, c_attn=c_attn, c_drop=c_drop, c_ln2=c_ln2,
                                        c_mlp=c_mlp)

    def backward(self, dy, cache, defer=None):
        # from: y += a  (y = x1 + mlp(ln2(x1)))
        dh2 = self.mlp.backward(dy, cache.c_mlp, defer)
        dx1 = self.ln2.backward(dh2, cache.c_ln2)    # (B, T, C), a fresh array
        dx1 += dy
        # from: a += x  (x1 = x + drop(attn(ln1(x))))
        da = self.drop.backward(dx1, cache.c_drop)
        dh1 = self.attn.backward(da, cache.c_attn, defer)
        dx = self.ln1.backward(dh1, cache.c_ln1)     # (B, T, C), a fresh array
        dx += dx1
        return dx

    def spec(self, x_shape):
        x_shape = tuple(x_shape)
        return BlockSpec.compose(self.name, [
            self.ln1.spec(x_shape), self.attn.spec(x_shape), self.drop.spec(x_shape),
            _residual_spec(f"{self.name}.res1", x_shape, self.dtype),
            self.ln2.spec(x_shape), self.mlp.spec(x_shape),
            _residual_spec(f"{self.name}.res2", x_shape, self.dtype)])
