"""Plain twins of the optimised blocks, written for reading: LayerNorm, GELU, causal attention.

The blocks in :mod:`hpcnn.nn.layers` and :mod:`hpcnn.nn.transformer` are tuned for speed: row
means as matrix-vector products with a memoised constant vector, GELU over cache-sized slices
with reused scratch buffers, attention probabilities stored key-major and computed batch slice by
batch slice. The functions here compute the same forward and backward with the textbook formulas,
whole arrays at a time, one named intermediate per line and nothing written in place, so that a
reader can check each line against the formula. ``tests/test_plain.py`` checks the plain twins by
finite differences and the fast blocks against them (float64, 1e-12).

Each forward returns ``(y, cache)``, the cache a NamedTuple whose fields are named as the
forward's values; each backward takes ``(dy, cache)``, reads those names and returns the input
gradient and, for blocks with parameters, the parameter gradients. Nothing is accumulated.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from hpcnn import backend

GELU_A = 0.044715                      # the cubic coefficient of the tanh approximation
GELU_C = math.sqrt(2.0 / math.pi)


# -- LayerNorm -------------------------------------------------------------------------------------
class LayerNormPlainCache(NamedTuple):
    x_hat: Any          # (..., C) the normalised input
    rstd: Any           # (..., 1) 1 / sqrt(var + eps)
    gamma: Any          # (C,) the scale, for dL/dx_hat = dy * gamma


def layer_norm_plain(x, gamma, beta, eps: float = 1e-5):
    """y = gamma * (x - mean) / sqrt(var + eps) + beta, mean and var over the last axis.

    ``x`` (..., C); ``gamma``, ``beta`` (C,). Cache: :class:`LayerNormPlainCache`."""
    xp = backend.xp
    mean = xp.mean(x, axis=-1, keepdims=True)                 # (..., 1)
    centred = x - mean
    var = xp.mean(centred ** 2, axis=-1, keepdims=True)       # (..., 1) biased variance
    rstd = 1.0 / xp.sqrt(var + eps)
    x_hat = centred * rstd
    y = gamma * x_hat + beta
    return y, LayerNormPlainCache(x_hat=x_hat, rstd=rstd, gamma=gamma)


def layer_norm_plain_backward(dy, cache):
    """Returns (dx, dgamma, dbeta).

    With g = dy * gamma = dL/dx_hat, the derivative of x_hat = (x - mean) rstd over the row is
    dx = rstd (g - mean(g) - x_hat mean(g x_hat))."""
    xp = backend.xp
    x_hat, rstd, gamma = cache.x_hat, cache.rstd, cache.gamma
    lead = tuple(range(dy.ndim - 1))                          # every axis but the features
    dgamma = xp.sum(dy * x_hat, axis=lead)
    dbeta = xp.sum(dy, axis=lead)
    g = dy * gamma
    g_mean = xp.mean(g, axis=-1, keepdims=True)
    gx_mean = xp.mean(g * x_hat, axis=-1, keepdims=True)
    dx = rstd * (g - g_mean - x_hat * gx_mean)
    return dx, dgamma, dbeta


# -- GELU ------------------------------------------------------------------------------------------
class GeluPlainCache(NamedTuple):
    x: Any              # the input (the backward recomputes tanh(z) from it)


def gelu_plain(x):
    """y = x/2 (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3) (the tanh form).
    Cache: :class:`GeluPlainCache`, the input x."""
    t = backend.xp.tanh(GELU_C * (x + GELU_A * x ** 3))
    y = 0.5 * x * (1.0 + t)
    return y, GeluPlainCache(x=x)


def gelu_plain_backward(dy, cache):
    """dx = dy gelu'(x), gelu'(x) = (1 + t)/2 + x/2 (1 - t^2) dz/dx, dz/dx = sqrt(2/pi)(1 + 3a x^2)."""
    x = cache.x
    t = backend.xp.tanh(GELU_C * (x + GELU_A * x ** 3))
    dz_dx = GELU_C * (1.0 + 3.0 * GELU_A * x ** 2)
    dgelu = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t ** 2) * dz_dx
    return dy * dgelu


# -- causal self-attention -------------------------------------------------------------------------
def _split_heads(a, n_heads):
    """(B, T, C) -> (B, nh, T, hs)."""
    B, T, C = a.shape
    return a.reshape(B, T, n_heads, C // n_heads).transpose(0, 2, 1, 3)


def _merge_heads(a):
    """(B, nh, T, hs) -> (B, T, C)."""
    B, nh, T, hs = a.shape
    return a.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)


class AttentionPlainCache(NamedTuple):
    x: Any              # (B, T, C) the input
    q: Any              # (B, nh, T, hs) queries, keys, values
    k: Any
    v: Any
    p: Any              # (B, nh, T_query, T_key) softmax probabilities
    drop_mask: Any      # (B, nh, T, T) scaled dropout mask, or None
    p_drop: Any         # p * drop_mask (p without dropout)
    y: Any              # (B, T, C) heads merged, the input of the output projection
    w_qkv: Any
    w_proj: Any
    n_heads: int


def attention_plain(x, w_qkv, b_qkv, w_proj, b_proj, n_heads: int, drop_mask=None):
    """Multi-head causal self-attention, x (B, T, C) -> (B, T, C).

    qkv = x W_qkv + b_qkv, cut into q, k, v (in that order along the last axis, each C wide) and
    each into ``n_heads`` heads of hs = C / n_heads; per head s = q k^T / sqrt(hs) (query i, key
    j), s_ij = -inf for j > i (no attention to the future), p = softmax of each row of s,
    y = (p * drop_mask) v, heads merged, out = y W_proj + b_proj. ``drop_mask`` (B, nh, T, T),
    query-major, is an attention-dropout mask already scaled by 1/(1 - p_drop), or None.
    Cache: :class:`AttentionPlainCache`."""
    xp = backend.xp
    B, T, C = x.shape
    hs = C // n_heads
    qkv = x @ w_qkv + b_qkv                                   # (B, T, 3C)
    q = _split_heads(qkv[..., 0 * C:1 * C], n_heads)          # (B, nh, T, hs)
    k = _split_heads(qkv[..., 1 * C:2 * C], n_heads)
    v = _split_heads(qkv[..., 2 * C:3 * C], n_heads)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(hs)                # (B, nh, T_query, T_key)
    future = xp.triu(xp.ones((T, T), dtype=bool), k=1)        # key j > query i
    s = xp.where(future, -xp.inf, s)
    e = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
    p = e / xp.sum(e, axis=-1, keepdims=True)                 # softmax over the keys
    p_drop = p if drop_mask is None else p * drop_mask
    y_heads = p_drop @ v                                      # (B, nh, T, hs)
    y = _merge_heads(y_heads)                                 # (B, T, C)
    out = y @ w_proj + b_proj
    cache = AttentionPlainCache(x=x, q=q, k=k, v=v, p=p, drop_mask=drop_mask, p_drop=p_drop, y=y,
                                w_qkv=w_qkv, w_proj=w_proj, n_heads=n_heads)
    return out, cache


def attention_plain_backward(dout, cache):
    """Returns a dict of gradients: ``x``, ``w_qkv``, ``b_qkv``, ``w_proj``, ``b_proj``.

    Each step differentiates one line of :func:`attention_plain`, last line first. The softmax
    backward, row by row: ds = p * (dp - sum_j dp_j p_j)."""
    xp = backend.xp
    c = cache
    x, q, k, v, p, y = c.x, c.q, c.k, c.v, c.p, c.y
    B, T, C = x.shape
    hs = C // c.n_heads
    # out = y W_proj + b_proj
    dw_proj = xp.einsum("btc,bto->co", y, dout)
    db_proj = xp.sum(dout, axis=(0, 1))
    dy = dout @ c.w_proj.T                                 # (B, T, C)
    dy_heads = _split_heads(dy, c.n_heads)                 # (B, nh, T, hs)
    # y_heads = p_drop v
    dv = c.p_drop.swapaxes(-1, -2) @ dy_heads
    dp_drop = dy_heads @ v.swapaxes(-1, -2)                   # (B, nh, T, T)
    # p_drop = p * drop_mask
    dp = dp_drop if c.drop_mask is None else dp_drop * c.drop_mask
    # p = softmax(s) over each row (masked entries have p = 0, so they get ds = 0)
    ds = p * (dp - xp.sum(dp * p, axis=-1, keepdims=True))
    # s = q k^T / sqrt(hs)
    dq = ds @ k / math.sqrt(hs)
    dk = ds.swapaxes(-1, -2) @ q / math.sqrt(hs)
    # q, k, v = the three C-wide thirds of qkv, cut into heads
    dqkv = xp.concatenate([_merge_heads(dq), _merge_heads(dk), _merge_heads(dv)], axis=-1)
    # qkv = x W_qkv + b_qkv
    dw_qkv = xp.einsum("btc,bto->co", x, dqkv)
    db_qkv = xp.sum(dqkv, axis=(0, 1))
    dx = dqkv @ c.w_qkv.T
    return dict(x=dx, w_qkv=dw_qkv, b_qkv=db_qkv, w_proj=dw_proj, b_proj=db_proj)
