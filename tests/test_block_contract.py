"""The block contract on every block kind, serial and sharded (on one rank here; on two ranks in
tests/mpi/tp_specs.py): ``spec()`` counts the real cache's bytes exactly as the memory account
does, and ``backward`` accumulates parameter gradients (see tests/cachecheck.py)."""
import numpy as np
import pytest

import hpcnn.nn
import hpcnn.parallel
from hpcnn.nn.conv import AvgPool2d, Conv2d, Flatten, MaxPool2d
from hpcnn.nn.layers import GELU, Dropout, LayerNorm, Linear, ReLU
from hpcnn.nn.loss import SoftmaxCrossEntropy
from hpcnn.nn.residual import halves
from hpcnn.nn.transformer import CausalSelfAttention, Embedding, MLPBlock, TransformerBlock
from hpcnn.parallel.tensor import (ColumnParallelLinear, ParallelMLPBlock, RowParallelLinear,
                                   ShardDropout)
from hpcnn.parallel.tensor_attn import ParallelCausalSelfAttention, ParallelTransformerBlock
from hpcnn.parallel.tensor_conv import ChannelParallelConv2d
from hpcnn.parallel.tensor_vocab import VocabParallelCrossEntropy, VocabParallelEmbedding

from cachecheck import block_kinds, grads_accumulate, spec_matches_cache
from mpi_util import single

F64 = np.float64
B, T, C, NH, V = 2, 8, 16, 4, 20


def _inputs():
    rng = np.random.default_rng(0)
    seq = rng.standard_normal((B, T, C))
    img = rng.standard_normal((2, 3, 8, 8))
    tok = rng.integers(0, V, (B, T))
    logits = rng.standard_normal((B, T, V))
    targets = rng.integers(0, V, (B, T))
    targets[0, :3] = -100                                    # ignored rows
    return seq, img, tok, logits, targets


def cases():
    """(id, block, input, targets or None): every kind, with the variants whose caches differ."""
    seq, img, tok, logits, targets = _inputs()
    comm = single("tp")
    kw = dict(dtype=F64)
    out = [("linear", Linear(C, 8, **kw), seq), ("linear-nobias", Linear(C, 8, bias=False, **kw), seq),
           ("relu", ReLU(**kw), seq), ("gelu", GELU(**kw), seq), ("layernorm", LayerNorm(C, **kw), seq),
           ("dropout", Dropout(0.3, **kw), seq), ("dropout-p0", Dropout(0.0, **kw), seq),
           ("dropout-eval", Dropout(0.3, **kw).eval(), seq),
           ("embedding", Embedding(V, C, T, **kw), tok),
           ("attention", CausalSelfAttention(C, NH, dropout=0.1, **kw), seq),
           ("attention-p0", CausalSelfAttention(C, NH, **kw), seq),
           ("mlp", MLPBlock(C, dropout=0.1, **kw), seq), ("mlp-p0", MLPBlock(C, **kw), seq),
           ("transformer", TransformerBlock(C, NH, dropout=0.1, **kw), seq),
           ("transformer-p0", TransformerBlock(C, NH, **kw), seq),
           *[(f"half-{h.name}", h, seq)
             for h in halves(TransformerBlock(C, NH, dropout=0.1, **kw))],
           ("conv", Conv2d(3, 4, 3, padding=1, **kw), img),
           ("conv-stride-nobias", Conv2d(3, 4, 2, stride=2, bias=False, **kw), img),
           ("maxpool", MaxPool2d(2, **kw), img), ("maxpool-3s2", MaxPool2d(3, 2, **kw), img),
           ("avgpool", AvgPool2d(2, **kw), img), ("flatten", Flatten(**kw), img),
           # sharded blocks on one rank (tp = 1): the same code paths, collectives of one
           ("col", ColumnParallelLinear(comm, C, 24, **kw), seq),
           ("col-gather", ColumnParallelLinear(comm, C, 24, gather_output=True, **kw), seq),
           ("col-sp", ColumnParallelLinear(comm, C, 24, sequence_parallel=True, **kw), seq),
           ("row", RowParallelLinear(comm, C, 8, **kw), seq),
           ("row-sp", RowParallelLinear(comm, C, 8, sequence_parallel=True, **kw), seq),
           ("pmlp-sp", ParallelMLPBlock(comm, C, dropout=0.1, sequence_parallel=True, **kw), seq),
           ("pattention", ParallelCausalSelfAttention(comm, C, NH, dropout=0.1, **kw), seq),
           ("ptransformer-sp", ParallelTransformerBlock(comm, C, NH, dropout=0.1,
                                                        sequence_parallel=True, **kw), seq),
           ("pembedding", VocabParallelEmbedding(comm, V, C, T, **kw), tok),
           ("pembedding-sp", VocabParallelEmbedding(comm, V, C, T, sequence_parallel=True, **kw),
            tok),
           ("shard-dropout", ShardDropout(0.3, axis=1, rank=0, size=1, **kw), seq),
           ("pconv", ChannelParallelConv2d(comm, 3, 4, 3, padding=1, **kw), img)]
    out = [(name, block, x, None) for name, block, x in out]
    out += [("xent", SoftmaxCrossEntropy(), logits, targets),
            ("xent-sum", SoftmaxCrossEntropy(reduction="sum"), logits, targets),
            ("pxent", VocabParallelCrossEntropy(comm), logits, targets)]
    return out


CASES = cases()


def test_every_block_kind_is_covered():
    """A new block or loss class must join the cases (and tests/mpi/tp_specs.py if sharded)."""
    covered = {type(block) for _, block, _, _ in CASES}
    missing = block_kinds(hpcnn.nn, hpcnn.parallel) - covered
    assert not missing, sorted(k.__name__ for k in missing)


@pytest.mark.parametrize("name,block,x,targets", CASES, ids=[c[0] for c in CASES])
def test_spec_counts_the_cache_exactly(name, block, x, targets):
    spec_matches_cache(block, x, targets)


WITH_PARAMS = [c for c in CASES if getattr(c[1], "params", None)]


@pytest.mark.parametrize("name,block,x", [c[:3] for c in WITH_PARAMS],
                         ids=[c[0] for c in WITH_PARAMS])
def test_backward_accumulates_gradients(name, block, x):
    grads_accumulate(block, x)


def test_spec_check_sees_a_miscounted_cache():
    """The check itself fails on a spec a few bytes off, and on a cache that holds a slice of a
    buffer of its own (the rest of the buffer would be held but not counted)."""
    from dataclasses import replace

    class Off(ReLU):
        def spec(self, x_shape):
            s = super().spec(x_shape)
            return replace(s, bytes_cache=s.bytes_cache + 1)

    class Slice(ReLU):
        def forward(self, x):
            y = np.maximum(x, 0)
            return y, (np.ones((2,) + x.shape)[0],)

        def spec(self, x_shape):
            s = super().spec(x_shape)
            return replace(s, cache_has_y=False)

    seq = _inputs()[0]
    with pytest.raises(AssertionError, match="bytes_cache_own"):
        spec_matches_cache(Off(dtype=F64), seq)
    with pytest.raises(AssertionError, match="larger buffer"):
        spec_matches_cache(Slice(dtype=F64), seq)


def test_block_spec_is_built_by_keyword_only():
    """Nine counts in a row could be put in the wrong order unnoticed: positional use fails."""
    counts = dict(flops_fwd=1.0, flops_bwd=2.0, bytes_x=8, bytes_y=8, bytes_cache=0, bytes_params=0)
    spec = hpcnn.nn.BlockSpec(name="b", in_shape=(1,), out_shape=(1,), **counts)
    assert (spec.flops_bwd, spec.bytes_cache, spec.comm_bytes) == (2.0, 0, 0)
    with pytest.raises(TypeError):
        hpcnn.nn.BlockSpec("b", (1,), (1,), *counts.values())
