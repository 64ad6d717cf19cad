"""The tensor-parallel models: the serial builders of :mod:`hpcnn.nn.models` sharded over tp.

A model factory needs every kind of parallel block (:mod:`hpcnn.parallel.tensor.linear`'s linear layers,
:mod:`hpcnn.parallel.tensor.attention`'s attention, :mod:`hpcnn.parallel.tensor.vocab`'s embedding and
loss, :mod:`hpcnn.parallel.tensor.channel_conv`'s convolution), and those modules build on
:mod:`hpcnn.parallel.tensor.linear`; the factories live here, above all of them, so that no block module
imports another one back. Each factory makes the serial model's blocks, names and random keys,
so tp = 1 and tp = k start from identical weights.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; \\
        from hpcnn.parallel.collectives import world; from hpcnn.parallel.tensor.factories import \\
        parallel_cnn; c = world(); m = parallel_cnn(c, 1, 8, (4, 8), \\
        dtype=np.float64); print(m.forward(np.ones((2, 1, 8, 8)), np.array([0, 1]))[0])"
"""
from __future__ import annotations

from hpcnn import backend
from hpcnn.nn import models
from hpcnn.nn.chain import Chain
from hpcnn.nn.conv import Conv2d
from hpcnn.parallel.tensor.linear import ColumnParallelLinear, replicated_layernorm
from hpcnn.parallel.tensor.attention import ParallelTransformerBlock
from hpcnn.parallel.tensor.channel_conv import ChannelParallelConv2d
from hpcnn.parallel.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from hpcnn.parallel.tensor.mappings import check_divides


def parallel_gpt(comm, vocab: int, block_size: int = 64, n_layers: int = 2, dim: int = 64,
                 n_heads: int = 4, *, sequence_parallel: bool = False, dropout: float = 0.0,
                 seed: int = 0, dtype=backend.DEFAULT_DTYPE, keep=None):
    """:func:`hpcnn.nn.models.gpt` sharded over ``comm`` (the tp group): same blocks, names, keys.
    ``keep``: the names of the parameters given storage (None: all; the others are placeholders,
    :mod:`hpcnn.nn.core`).

    VocabParallelEmbedding -> ParallelTransformerBlocks -> LayerNorm (replicated) -> column-
    parallel LM head, output NOT gathered: logits (B, T, vocab/tp) -> VocabParallelCrossEntropy.
    With ``sequence_parallel`` the embedding reduce-scatters along T, the blocks and ``ln_f``
    work on (B, T/tp, C) and the LM head all-gathers its input; call
    ``sync_replicated_grads(chain.params, comm)`` after the backward.
    """
    if dim % n_heads:
        raise ValueError(f"dim ({dim}) is not divisible by n_heads ({n_heads})")
    check_divides("gpt: vocabulary size", vocab, comm.size)
    check_divides("gpt: attention heads", n_heads, comm.size)
    sp = bool(sequence_parallel)
    blocks = [VocabParallelEmbedding(comm, vocab, dim, block_size, sequence_parallel=sp,
                                     seed=seed, index=0, dtype=dtype, keep=keep)]
    for i in range(n_layers):
        blocks.append(ParallelTransformerBlock(comm, dim, n_heads, dropout=dropout,
                                               sequence_parallel=sp, seed=seed,
                                               index=len(blocks), dtype=dtype, name=f"h{i}",
                                               keep=keep))
    blocks.append(replicated_layernorm(dim, sequence_parallel=sp, dtype=dtype, name="ln_f",
                                       keep=keep))
    blocks.append(ColumnParallelLinear(comm, dim, vocab, bias=False, sequence_parallel=sp,
                                       seed=seed, index=len(blocks), init_std=0.02, dtype=dtype,
                                       name="lm_head", keep=keep))
    return Chain(blocks, VocabParallelCrossEntropy(comm), name="gpt")


def parallel_cnn(comm, in_ch: int = 1, image: int = 8, channels=(16, 32), hidden: int = 64,
                 n_out: int = 10, *, pool: str = "max", seed: int = 0, dtype=backend.DEFAULT_DTYPE,
                 keep=None):
    """:func:`hpcnn.nn.models.cnn` with its convolutions channel-parallel over ``comm`` (tp).

    The serial chain is built (same checks, blocks, names and keys), then each Conv2d is replaced
    by its :class:`ChannelParallelConv2d` shard. ReLU, pooling, Flatten and the MLP head stay
    serial and replicated: their input is the all-gathered conv output, identical on every tp
    rank, so their outputs and gradients are identical on every tp rank too and need no sync
    (plain Parameters: the training loop counts them once in the gradient norm). An entry of
    ``channels`` that tp does not divide is a ValueError naming the layer and both numbers.
    ``keep``: as :func:`parallel_gpt`'s.
    """
    chain = models.cnn(in_ch, image, channels, hidden, n_out, pool=pool, seed=seed, dtype=dtype,
                       keep=keep)
    chain.blocks = [ChannelParallelConv2d.from_serial(comm, b) if isinstance(b, Conv2d) else b
                    for b in chain.blocks]
    return chain
