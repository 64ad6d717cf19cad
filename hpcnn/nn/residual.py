"""Half transformer layers: ``x + drop(attn(ln1(x)))`` and ``x + mlp(ln2(x))`` as chain blocks.

A pre-LN :class:`~hpcnn.nn.transformer.TransformerBlock` is two residual halves. As one block it
is one stage of a chain, the finest unit rematerialization (:mod:`hpcnn.memory`) and pipeline
cuts can use; its cache is about 20 times its input on a GPT. :func:`split_layers` turns each
layer of a chain into its two halves, sharing the layer's sub-blocks (the same parameters, in
the same order, and the same dropout keys), so the split chain computes the same values and
gradients as the original, with twice as many, half as large stages.

    chain = split_layers(models.gpt(vocab, 64, 6, 128, 4))    # 1 + 12 + 2 blocks
"""
from __future__ import annotations

from typing import Any, NamedTuple

from hpcnn.nn.chain import Chain
from hpcnn.nn.core import Block, BlockSpec
from hpcnn.nn.transformer import TransformerBlock, _check_btc, _residual_spec


class ResidualHalfCache(NamedTuple):
    """The sub-blocks' caches of :class:`ResidualHalf` (the residual add needs none)."""
    c_ln: Any           # self.ln's LayerNormCache
    c_body: Any         # self.body's cache (attention or MLP)
    c_drop: Any         # self.drop's DropoutCache, or None without a dropout


class ResidualHalf(Block):
    """y = x + drop(body(ln(x))) (``drop`` may be None). Cache: :class:`ResidualHalfCache`.
    ``backward(dy, cache, defer=None)`` passes ``defer`` to the body (built from Linears)."""

    defers_weights = True

    def __init__(self, ln, body, drop=None, *, name="half"):
        super().__init__()
        self.name, self.ln, self.body, self.drop = name, ln, body, drop
        self.dim, self.dtype = body.dim, body.dtype
        self.params = ln.params + body.params

    def _parts(self):
        return (self.ln, self.body) + ((self.drop,) if self.drop is not None else ())

    def rng_state(self):
        return tuple(b.rng_state() for b in self._parts())

    def set_rng_state(self, state):
        for b, s in zip(self._parts(), state):
            b.set_rng_state(s)

    def train(self, mode=True):
        super().train(mode)
        for b in self._parts():
            b.train(mode)
        return self

    def forward(self, x):
        _check_btc(self.name, x, self.dim)
        h, c_ln = self.ln.forward(x)                 # (B, T, C)
        a, c_body = self.body.forward(h)             # (B, T, C), a fresh array
        c_drop = None
        if self.drop is not None:
            a, c_drop = self.drop.forward(a)         # (B, T, C)
        a += x                                       # y = x + drop(body(ln(x))); a is ours
        return a, ResidualHalfCache(c_ln=c_ln, c_body=c_body, c_drop=c_drop)

    def backward(self, dy, cache, defer=None):
        da = dy if self.drop is None else self.drop.backward(dy, cache.c_drop)
        dh = self.body.backward(da, cache.c_body, defer)   # from a = body(h)
        dx = self.ln.backward(dh, cache.c_ln)              # from h = ln(x), a fresh array
        dx += dy                                     # from y = x + ...
        return dx

    def spec(self, x_shape):
        x_shape = tuple(x_shape)
        return BlockSpec.compose(self.name, [b.spec(x_shape) for b in self._parts()]
                                 + [_residual_spec(f"{self.name}.res", x_shape, self.dtype)])


def halves(block: TransformerBlock) -> list:
    """The attention and MLP halves of ``block``, sharing its sub-blocks."""
    return [ResidualHalf(block.ln1, block.attn, block.drop, name=f"{block.name}.attn"),
            ResidualHalf(block.ln2, block.mlp, None, name=f"{block.name}.mlp")]


def split_layers(chain: Chain) -> Chain:
    """``chain`` with each TransformerBlock replaced by its two halves (same parameters)."""
    blocks = []
    for b in chain.blocks:
        blocks += halves(b) if isinstance(b, TransformerBlock) else [b]
    return Chain(blocks, chain.loss, name=f"{chain.name}-halves")
