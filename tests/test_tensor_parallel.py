"""Tensor parallelism: tp = 1 against the serial blocks, finite differences, byte formulas and
errors serially; equivalence with the serial blocks and GPT under mpiexec (tp = 2, 4)."""
from types import SimpleNamespace

import numpy as np
import pytest

from gradcheck import check_block_gradients
from hpcnn.nn import models
from hpcnn.nn.loss import SoftmaxCrossEntropy
from hpcnn.nn.transformer import TransformerBlock
from hpcnn.parallel.tensor import mappings as tp_comm
from hpcnn.parallel.tensor.linear import (ColumnParallelLinear, ParallelMLPBlock,
                                          RowParallelLinear, gather_params, shard_array)
from hpcnn.parallel.tensor.attention import ParallelCausalSelfAttention, ParallelTransformerBlock
from hpcnn.parallel.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from hpcnn.parallel.tensor.factories import parallel_gpt
from mpi_util import CaseRuns, single




def sized(p, rank=0):
    """What the sharded blocks read at construction and in ``spec``: no MPI behind it."""
    return SimpleNamespace(size=p, rank=rank)


# -- one rank: the serial model, the collectives bypassed ------------------------------------------
@pytest.mark.parametrize("sp", [False, True])
def test_tp1_gpt_equals_serial(sp):
    c = single()
    ser = models.gpt(16, 8, 2, 16, 4, dropout=0.1, seed=2, dtype=np.float64)
    par = parallel_gpt(c, 16, 8, 2, 16, 4, sequence_parallel=sp, dropout=0.1, seed=2,
                       dtype=np.float64)
    rng = np.random.default_rng(0)
    tok, tgt = rng.integers(0, 16, (3, 8)), rng.integers(0, 16, (3, 8))
    losses = []
    for m in (ser, par):
        m.zero_grad()
        loss, caches = m.forward(tok, tgt)
        m.backward(1.0, caches, need_dx=False)
        losses.append(loss)
    assert losses[0] == losses[1]
    grads = gather_params(par, c, grads=True)
    assert list(grads) == [p.name for p in ser.params]
    for p in ser.params:
        np.testing.assert_array_equal(grads[p.name], p.grad)
    assert c.stats.bytes_sent == 0 and sum(s.comm_bytes for s in par.spec(tok.shape)) == 0


def test_collectives_bypassed_on_one_rank():
    c = single()
    x = np.arange(24.0).reshape(2, 3, 4)
    for op in (tp_comm.Copy, tp_comm.Reduce, tp_comm.GatherLast, tp_comm.SplitLast,
               tp_comm.AllGatherSeq, tp_comm.ReduceScatterSeq):
        y, cache = op(c).forward(x)
        assert y is x and op(c).backward(x, cache) is x
        assert op(c).volume(x.nbytes) == tp_comm.Volume()
    assert tp_comm.allreduce_max(c, x) is x and c.stats.bytes_sent == 0


# -- finite differences of the sharded blocks' backward (tp = 1) -----------------------------------
@pytest.mark.parametrize("make", [
    lambda c: ParallelCausalSelfAttention(c, 8, 2, dropout=0.3, seed=1, dtype=np.float64),
    lambda c: ParallelMLPBlock(c, 8, 12, dropout=0.3, seed=1, dtype=np.float64),
    lambda c: ParallelTransformerBlock(c, 8, 2, sequence_parallel=True, seed=1, dtype=np.float64),
    lambda c: ColumnParallelLinear(c, 8, 6, gather_output=True, seed=1, dtype=np.float64),
    lambda c: RowParallelLinear(c, 8, 6, seed=1, dtype=np.float64),
], ids=["attention", "mlp", "block", "column", "row"])
def test_gradients_finite_differences(make):
    x = np.random.default_rng(3).standard_normal((2, 4, 8))
    check_block_gradients(make(single()), x, max_entries=12)


def test_embedding_gradients_finite_differences():
    emb = VocabParallelEmbedding(single(), 10, 6, 5, seed=1, dtype=np.float64)
    tok = np.array([[1, 3, 3, 9], [0, 3, 7, 1]])
    assert check_block_gradients(emb, tok) is None


def test_vocab_loss_matches_serial_and_finite_differences():
    rng = np.random.default_rng(4)
    z, t = rng.standard_normal((3, 4, 7)) * 5, rng.integers(0, 7, (3, 4))
    t[1, 2] = -100
    par, ser = VocabParallelCrossEntropy(single()), SoftmaxCrossEntropy()
    (lp, cp), (ls, cs) = par.forward(z, t), ser.forward(z, t)
    assert lp == pytest.approx(ls, abs=1e-14)
    d = par.backward(1.0, cp)
    np.testing.assert_allclose(d, ser.backward(1.0, cs), atol=1e-15)
    eps, flat = 1e-6, z.reshape(-1)
    for i in (0, 11, 30, 83):
        old = flat[i]
        flat[i] = old + eps
        up = par.forward(z, t)[0]
        flat[i] = old - eps
        down = par.forward(z, t)[0]
        flat[i] = old
        assert d.reshape(-1)[i] == pytest.approx((up - down) / (2 * eps), abs=1e-8)


# -- layout and cost formulas ----------------------------------------------------------------------
def test_shard_array_keeps_qkv_groups_together():
    w = np.arange(2 * 12).reshape(2, 12)              # [q | k | v], 4 columns each, tp = 2
    np.testing.assert_array_equal(shard_array(w, 1, 1, 2, parts=3)[0], [2, 3, 6, 7, 10, 11])
    np.testing.assert_array_equal(shard_array(w, 0, 1, 2), w[1:])


def test_volume_convention():
    v = tp_comm.Volume(allreduce=800, allreduce_max=8, gather=(96, 96))
    assert v.sent(4) == 2 * 3 * 800 // 4 + 2 * 3 * 8 // 4 + 2 * (3 * 96 // 4)
    assert (v + v).allreduce == 1600 and (v + v).gather == (96,) * 4 and v.sent(1) == 0


def leaves(spec, out=None):
    """name -> the leaf BlockSpecs of a composed spec, in order."""
    out = {} if out is None else out
    if not spec.children:
        out[spec.name] = spec
    for c in spec.children:
        leaves(c, out)
    return out


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_block_spec_four_allreduces(p, sp):
    """Megatron: two allreduces of (B, T, C) forward, two backward, per transformer layer
    (Shoeybi et al. 2019, Sec. 3); sequence parallelism moves the same bytes (Korthikanti et al.
    2022, Sec. 4.2.2) and one allreduce's more: the backward gathers the two column-parallel
    GEMMs' inputs again, whose slices it cached; its flops per rank are 1/p of the serial
    block's matmuls."""
    B, T, C = 2, 8, 16
    blk = ParallelTransformerBlock(sized(p), C, 4, sequence_parallel=sp, dtype=np.float64)
    s = blk.spec((B, T // p, C) if sp else (B, T, C))
    assert s.comm_bytes == (5 if sp else 4) * 2 * (p - 1) * B * T * C * 8 // p
    ser = leaves(TransformerBlock(C, 4, dtype=np.float64).spec((B, T, C)))
    par = leaves(s)
    assert list(par) == list(ser)
    for name in ("block.attn.qkv", "block.mlp.fc"):             # column-parallel: 1/p of all
        assert par[name].flops_fwd == ser[name].flops_fwd / p
        assert par[name].flops_bwd == ser[name].flops_bwd / p
    for name in ("block.attn.proj", "block.mlp.proj"):          # row-parallel: the bias once
        assert par[name].flops_fwd <= ser[name].flops_fwd / p + B * T * C
    emb = VocabParallelEmbedding(sized(p), 32, C, T, sequence_parallel=sp, dtype=np.float64)
    assert emb.spec((B, T)).comm_bytes == 2 * (p - 1) * B * T * C * 8 // p
    xent = VocabParallelCrossEntropy(sized(p)).spec((B, T, 32 // p), np.float64)
    assert xent.comm_bytes == 2 * (p - 1) * 3 * B * T * 8 // p


@pytest.mark.parametrize("make, msg", [
    (lambda c: ColumnParallelLinear(c, 8, 10, name="fc"),
     r"fc: output features \(10\) is not divisible by tp \(3\)"),
    (lambda c: ColumnParallelLinear(c, 8, 12, parts=3, name="qkv"),
     r"qkv: output features per block \(12 / 3\) \(4\) is not divisible by tp \(3\)"),
    (lambda c: RowParallelLinear(c, 8, 6, name="proj"),
     r"proj: input features \(8\) is not divisible by tp \(3\)"),
    (lambda c: ParallelMLPBlock(c, 8), r"mlp: hidden features \(32\) is not divisible by tp \(3\)"),
    (lambda c: ParallelCausalSelfAttention(c, 8, 4),
     r"attn: attention heads \(4\) is not divisible by tp \(3\)"),
    (lambda c: ParallelTransformerBlock(c, 12, 3, hidden=8, name="h0"),
     r"h0.mlp: hidden features \(8\) is not divisible by tp \(3\)"),
    (lambda c: VocabParallelEmbedding(c, 16, 8, 4),
     r"embed: vocabulary size \(16\) is not divisible by tp \(3\)"),
    (lambda c: parallel_gpt(c, 16, 8, 1, 12, 3), r"gpt: vocabulary size \(16\) is not divisible"),
    (lambda c: parallel_gpt(c, 15, 8, 1, 8, 4), r"gpt: attention heads \(4\) is not divisible"),
    (lambda c: VocabParallelEmbedding(c, 15, 8, 8, sequence_parallel=True).spec((2, 8)),
     r"sequence length \(8\) is not divisible by tp \(3\)"),
])
def test_dimensions_tp_does_not_divide(make, msg):
    with pytest.raises(ValueError, match=msg):
        make(sized(3, rank=1))


# -- many ranks ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_runs():
    """tp_blocks and tp_specs on the same number of ranks share one job."""
    return CaseRuns([(n, scenario, ()) for n in (2, 4) for scenario in ("tp_blocks", "tp_specs")])


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long)])
def test_tp_blocks_mpi(n, tp_runs):
    assert f"tp_blocks OK on {n} ranks" in tp_runs.stdout(n, "tp_blocks")


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long)])
def test_tensor_parallel_specs_describe_the_caches(n, tp_runs):
    assert f"tp_specs OK on {n} ranks" in tp_runs.stdout(n, "tp_specs")
