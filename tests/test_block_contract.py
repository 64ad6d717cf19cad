"""The block contract on every block kind, serial and sharded (on one rank here; on two ranks in
tests/mpi/tp_specs.py): ``spec()`` counts the real cache's bytes exactly as the memory account
does, and ``backward`` accumulates parameter gradients (see tests/cachecheck.py)."""
import numpy as np
import pytest

import hpcnn.nn
import hpcnn.parallel.tensor.linear
from hpcnn.nn.conv import AvgPool2d, Conv2d, Flatten, MaxPool2d
from hpcnn.nn.gcn import GraphConv, GraphOperator, NodeLoss
from hpcnn.nn.layers import GELU, Dropout, LayerNorm, Linear, ReLU, reachable
from hpcnn.nn.loss import SoftmaxCrossEntropy
from hpcnn.nn.residual import halves
from hpcnn.nn.transformer import CausalSelfAttention, Embedding, MLPBlock, TransformerBlock
from hpcnn.parallel.tensor.linear import (ColumnParallelLinear, ParallelMLPBlock,
                                          RowParallelLinear, ShardDropout)
from hpcnn.parallel.tensor.attention import ParallelCausalSelfAttention, ParallelTransformerBlock
from hpcnn.parallel.tensor.channel_conv import ChannelParallelConv2d
from hpcnn.schedule.placement import Cut, Placement
from hpcnn.parallel.layout import LayoutLinear, Redistribute
from hpcnn.parallel.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding

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
           ("pconv", ChannelParallelConv2d(comm, 3, 4, 3, padding=1, **kw), img),
           # per-layer layouts on one rank (multi-rank: tests/mpi/layout_chain.py)
           ("layout-linear", LayoutLinear(C, 8, Cut(), comm, **kw), seq.reshape(-1, C)),
           ("redistribute", Redistribute(Placement.full(1), Placement.full(1), C, comm, **kw),
            seq.reshape(-1, C))]
    # graph convolution on a 16-node ring (serial operator: multi-rank in tests/mpi/gcn_equivalence.py)
    import scipy.sparse as sp
    from hpcnn.graph import normalized_adjacency
    ring = normalized_adjacency(sp.diags([1.0, 1.0], [1, -1], shape=(C, C)).tocsr())
    op = GraphOperator.from_global(ring, dtype=F64)
    nodes = seq.reshape(-1, C)[:C]
    out += [("gcn", GraphConv(op, C, 8, **kw), nodes),
            ("gcn-nobias", GraphConv(op, C, 8, bias=False, **kw), nodes)]
    out = [(name, block, x, None) for name, block, x in out]
    node_targets = np.where(np.arange(C) % 3 == 0, np.arange(C) % V, -1)      # -1: not trained
    out += [("xent", SoftmaxCrossEntropy(), logits, targets),
            ("xent-sum", SoftmaxCrossEntropy(reduction="sum"), logits, targets),
            ("pxent", VocabParallelCrossEntropy(comm), logits, targets),
            ("node-xent", NodeLoss(C, 6), logits.reshape(-1, V)[:C], node_targets)]
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


def _named_tuples(cache) -> list:
    """Every NamedTuple in ``cache`` (nested ones too), outermost first."""
    found = [cache] if hasattr(cache, "_fields") else []
    if isinstance(cache, tuple):
        for v in cache:
            found += _named_tuples(v)
    return found


def _same_structure(a, b) -> None:
    """Same container types all the way down, arrays equal bit for bit."""
    assert type(b) is type(a), (type(a), type(b))
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _same_structure(u, v)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    else:
        assert a == b or a is b


@pytest.mark.parametrize("name,block,x,targets", CASES, ids=[c[0] for c in CASES])
def test_cache_is_a_named_tuple_that_offload_round_trips(name, block, x, targets):
    """The cache is a NamedTuple defined next to its block (its sub-blocks' caches are named
    fields of it), and the offload channel returns it as the same NamedTuple types with the same
    arrays, from which backward gives the same dx."""
    from hpcnn.memory.offload import OffloadChannel
    y, cache = block.forward(x) if targets is None else block.forward(x, targets)
    assert hasattr(cache, "_fields") and isinstance(cache, tuple), (name, type(cache))
    for nt in _named_tuples(cache):          # hpcnn's own, named for what they cache
        assert type(nt).__name__.endswith("Cache"), (name, type(nt))
        assert type(nt).__module__.startswith(("hpcnn.nn.", "hpcnn.parallel.")), (name, type(nt))
    with OffloadChannel("file") as ch:
        ch.offload("c", cache)
        back = ch.fetch("c")
    _same_structure(cache, back)
    dy = 1.0 if targets is not None else np.random.default_rng(1).standard_normal(y.shape)
    dx1 = block.backward(dy, cache)
    dx2 = block.backward(dy, back)
    if dx1 is None:
        assert dx2 is None
    else:
        np.testing.assert_array_equal(dx2, dx1)
    for p in block.params:
        p.zero_grad()


BLOCKS = [c for c in CASES if c[3] is None]


@pytest.mark.parametrize("name,block,x", [c[:3] for c in BLOCKS], ids=[c[0] for c in BLOCKS])
def test_defer_splits_the_backward_into_input_and_weight_halves(name, block, x):
    """``defers_weights`` is set exactly on the blocks with a Linear inside. For those,
    ``backward(dy, cache, defer=pending)`` gives the whole backward's dx, leaves the deferred
    Linears' weight gradients untouched, and running the pending ``backward_weight`` calls then
    gives the whole backward's gradients (what a zero-bubble pipeline's B and W do)."""
    assert block.defers_weights == bool(reachable(block, Linear)), name
    if not block.defers_weights:
        return
    y, cache = block.forward(x)
    dy = np.random.default_rng(2).standard_normal(y.shape)
    block.zero_grad()
    dx_full = block.backward(dy.copy(), cache)
    full = [p.grad.copy() for p in block.params]
    block.zero_grad()
    pending = []
    dx = block.backward(dy.copy(), cache, defer=pending)
    np.testing.assert_array_equal(dx, dx_full)
    assert pending and all(isinstance(lin, Linear) for lin, _, _ in pending), name
    for lin, _, _ in pending:
        assert not lin.weight.grad.any(), (name, lin.name, "weight gradient not deferred")
    for lin, d, c in pending:
        lin.backward_weight(d, c)
    for p, g in zip(block.params, full):
        np.testing.assert_allclose(p.grad, g, rtol=0, atol=1e-12, err_msg=f"{name}: {p.name}")
    block.zero_grad()


def test_no_module_level_switch_in_the_blocks():
    """What a block does depends on its arguments only: the block modules rebind no global
    (no ``global`` statement) and hold no module-level mutable container, but for ``_FILLED``
    (a pure cache of constant vectors: what it returns depends on its key only)."""
    import importlib
    import inspect
    import pkgutil
    import re
    import weakref
    names = [f"hpcnn.nn.{m.name}" for m in pkgutil.iter_modules(hpcnn.nn.__path__)]
    names += [f"hpcnn.parallel.tensor.{m.name}"
              for m in pkgutil.iter_modules(hpcnn.parallel.tensor.__path__)]
    names += ["hpcnn.parallel.layout"]
    allowed = {("hpcnn.nn.layers", "_FILLED")}
    mutable = (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)
    for name in names:
        mod = importlib.import_module(name)
        assert not re.search(r"^\s*global\s+\w", inspect.getsource(mod), re.M), name
        for var, value in vars(mod).items():
            if var.startswith("__") or (name, var) in allowed:
                continue
            assert not isinstance(value, mutable), (name, var)
            assert value is not None, (name, var, "a module-level None is a switch waiting")
