"""Model builders: each returns a :class:`Chain` initialised deterministically from a seed.

Block ``i`` of a chain draws its initial values from keys (seed, i, ...), so the weights do not
depend on how the chain is later split into pipeline stages or tensor-parallel shards.
``keep``: the names of the parameters given storage (None: all; the others are placeholders of
no memory, see :mod:`hpcnn.nn.core`): a pipeline rank passes its own stages' names.
"""
from __future__ import annotations

from hpcnn import backend
from hpcnn.nn.chain import Chain
from hpcnn.nn.conv import AvgPool2d, Conv2d, Flatten, MaxPool2d
from hpcnn.nn.layers import GELU, LayerNorm, Linear, ReLU
from hpcnn.nn.loss import SoftmaxCrossEntropy
from hpcnn.nn.transformer import Embedding, TransformerBlock


def mlp(n_in: int, hidden=(256, 256), n_out: int = 10, *, activation: str = "relu", seed: int = 0,
        dtype=backend.DEFAULT_DTYPE, keep=None) -> Chain:
    """Linear -> act -> ... -> Linear, then softmax cross-entropy. One block per layer and act."""
    act = {"relu": ReLU, "gelu": GELU}
    if activation not in act:
        raise ValueError(f"activation must be one of {sorted(act)}, got {activation!r}")
    dims = [int(n_in), *[int(h) for h in hidden], int(n_out)]
    blocks = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        blocks.append(Linear(a, b, seed=seed, index=len(blocks), dtype=dtype, name=f"fc{i}",
                             init_std=(2.0 / a) ** 0.5 if i < len(dims) - 2 else None,
                             keep=keep))
        if i < len(dims) - 2:
            blocks.append(act[activation](dtype=dtype))
    return Chain(blocks, SoftmaxCrossEntropy(), name="mlp")


def cnn(in_ch: int = 1, image: int = 8, channels=(16, 32), hidden: int = 64, n_out: int = 10, *,
        pool: str = "max", seed: int = 0, dtype=backend.DEFAULT_DTYPE, keep=None) -> Chain:
    """[Conv3x3(pad 1) -> ReLU -> Pool2] per entry of ``channels`` -> Flatten -> MLP head."""
    pools = {"max": MaxPool2d, "avg": AvgPool2d}
    if pool not in pools:
        raise ValueError(f"pool must be one of {sorted(pools)}, got {pool!r}")
    side = int(image)
    if side % (2 ** len(channels)):
        raise ValueError(f"image side {side} is not divisible by 2**{len(channels)} "
                         f"(one 2x2 pooling per conv layer)")
    blocks, c = [], int(in_ch)
    for i, co in enumerate(channels):
        blocks.append(Conv2d(c, int(co), 3, padding=1, seed=seed, index=len(blocks), dtype=dtype,
                             name=f"conv{i}", keep=keep))
        blocks += [ReLU(dtype=dtype), pools[pool](2, dtype=dtype)]
        c, side = int(co), side // 2
    blocks.append(Flatten(dtype=dtype))
    feat = c * side * side
    blocks.append(Linear(feat, hidden, seed=seed, index=len(blocks), dtype=dtype, name="fc0",
                         init_std=(2.0 / feat) ** 0.5, keep=keep))
    blocks.append(ReLU(dtype=dtype))
    blocks.append(Linear(hidden, n_out, seed=seed, index=len(blocks), dtype=dtype, name="fc1",
                         keep=keep))
    return Chain(blocks, SoftmaxCrossEntropy(), name="cnn")


def gpt(vocab: int, block_size: int = 64, n_layers: int = 2, dim: int = 64, n_heads: int = 4, *,
        dropout: float = 0.0, seed: int = 0, dtype=backend.DEFAULT_DTYPE, keep=None) -> Chain:
    """Token+position embedding -> n_layers pre-LN transformer blocks -> LayerNorm -> LM head."""
    if dim % n_heads:
        raise ValueError(f"dim ({dim}) is not divisible by n_heads ({n_heads})")
    blocks = [Embedding(vocab, dim, block_size, seed=seed, index=0, dtype=dtype, keep=keep)]
    for i in range(n_layers):
        blocks.append(TransformerBlock(dim, n_heads, dropout=dropout, seed=seed,
                                       index=len(blocks), dtype=dtype, name=f"h{i}", keep=keep))
    blocks.append(LayerNorm(dim, dtype=dtype, name="ln_f", keep=keep))
    blocks.append(Linear(dim, vocab, bias=False, seed=seed, index=len(blocks), init_std=0.02,
                         dtype=dtype, name="lm_head", keep=keep))
    return Chain(blocks, SoftmaxCrossEntropy(), name="gpt")
