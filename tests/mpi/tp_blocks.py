"""Tensor parallelism against the serial blocks (float64, 1e-10), tp = the world size.

    mpiexec -n 2 python -m mpi4py tests/mpi/tp_blocks.py

Covers the conjugate collectives (closed forms, both directions), every sharded block with and
without sequence parallelism and with dropout (output, input gradient and gathered parameter
gradients equal to the serial block's; bytes counted during one forward+backward equal
``spec().comm_bytes``), the vocabulary-parallel loss, a few SGD steps of ``parallel_gpt`` against
``models.gpt`` (sequence parallelism on and off), dp x tp = 2 x 2 on 4 ranks, and dimensions that
tp does not divide.
"""
import numpy as np
from mpi4py import MPI

from hpcnn.nn import models
from hpcnn.nn.layers import Linear
from hpcnn.nn.loss import SoftmaxCrossEntropy
from hpcnn.nn.transformer import CausalSelfAttention, Embedding, MLPBlock, TransformerBlock
from hpcnn.parallel.tensor import mappings as tp_comm
from hpcnn.parallel.collectives import CommStats, Communicator
from hpcnn.parallel.tensor.linear import (ColumnParallelLinear, ParallelMLPBlock,
                                          RowParallelLinear, gather_params, replicated_sync_volume,
                                          sync_replicated_grads)
from hpcnn.parallel.tensor.attention import ParallelCausalSelfAttention, ParallelTransformerBlock
from hpcnn.parallel.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from hpcnn.parallel.tensor.factories import parallel_gpt

import sgd_loop  # noqa: E402 - tests/mpi/sgd_loop.py, beside this script

world = MPI.COMM_WORLD
r, P = world.Get_rank(), world.Get_size()
stats = CommStats()
comm = Communicator(world, stats, name="tp")
TOL = 1e-10
B, T, C, NH, V, H = 2, 8, 16, 4, 32, 24      # T, NH, V, H divisible by 2 and 4
F64 = np.float64


def rand(shape, *key):
    """The same numbers on every rank (keyed), or rank k's with k in the key."""
    return np.random.default_rng([7, *key]).standard_normal(shape)


def close(a, b, what, tol=TOL):
    d = float(np.abs(np.asarray(a) - np.asarray(b)).max()) if np.size(a) else 0.0
    assert np.shape(a) == np.shape(b) and d < tol, (what, np.shape(a), np.shape(b), d)


def part(a, axis, k=None):
    """Rank k's (default: this rank's) 1/P part of ``a`` along ``axis``."""
    k = r if k is None else k
    n = a.shape[axis] // P
    return np.take(a, np.arange(k * n, (k + 1) * n), axis=axis)


def last(a):
    return part(a, -1)


def seq(a):
    return part(a, 1)


def full(a):
    return a


# -- conjugate collectives: closed forms, bytes ----------------------------------------------------
def counted(op, x, dy, nbytes):
    stats.reset()
    y, c = op.forward(x.copy())
    dx = op.backward(dy.copy(), c)
    assert stats.bytes_sent == op.volume(nbytes).sent(P), (op, dict(stats.bytes), nbytes)
    return y, dx


xs = [rand((2, 3, 4), 1, k) for k in range(P)]          # rank k's local array
X = rand((2, 3, 4 * P), 2)                              # replicated
Xs = rand((2, 3 * P, 4), 3)                             # replicated, full sequence
dys = [rand((2, 3, 4 * P), 4, k) for k in range(P)]
dys_seq = [rand((2, 3 * P, 4), 5, k) for k in range(P)]
nb_last, nb_seq = X.nbytes, Xs.nbytes
y, dx = counted(tp_comm.Copy(comm), xs[r], dys[r], nb_last)
close(y, xs[r], "copy fwd"), close(dx, sum(dys), "copy bwd")
y, dx = counted(tp_comm.Reduce(comm), dys[r], X, nb_last)
close(y, sum(dys), "reduce fwd"), close(dx, X, "reduce bwd")
y, dx = counted(tp_comm.GatherLast(comm), xs[r], X, nb_last)
close(y, np.concatenate(xs, axis=-1), "gather-last fwd"), close(dx, last(X), "gather-last bwd")
y, dx = counted(tp_comm.SplitLast(comm), X, xs[r], nb_last)
close(y, last(X), "split-last fwd"), close(dx, np.concatenate(xs, -1), "split-last bwd")
y, dx = counted(tp_comm.AllGatherSeq(comm), xs[r], dys_seq[r], nb_seq)
close(y, np.concatenate(xs, axis=1), "all-gather-seq fwd")
close(dx, seq(sum(dys_seq)), "all-gather-seq bwd")
y, dx = counted(tp_comm.ReduceScatterSeq(comm), dys_seq[r], xs[r], nb_seq)
close(y, seq(sum(dys_seq)), "reduce-scatter-seq fwd")
close(dx, np.concatenate(xs, axis=1), "reduce-scatter-seq bwd")
m = xs[r].copy()
stats.reset()
tp_comm.allreduce_max(comm, m)
close(m, np.max(xs, axis=0), "allreduce_max")
sent = tp_comm.Volume(allreduce_max=m.nbytes).sent(P)
assert stats.bytes_sent == sent == 2 * (P - 1) * m.nbytes // P


# -- every block against its serial twin -----------------------------------------------------------
def compare(par, ser, x, dy, x_in, y_out, what):
    """Output, input gradient and gathered parameter gradients of ``par`` on this rank's part of
    x, against ``ser`` on x; bytes of one forward+backward against ``par.spec``, then of the
    sync of partial gradients (sequence parallelism) against their volume."""
    ser.zero_grad()
    y_s, c_s = ser.forward(x.copy())
    dx_s = ser.backward(dy.copy(), c_s)
    par.zero_grad()
    xl = x_in(x).copy()
    stats.reset()
    y_p, c_p = par.forward(xl)
    dx_p = par.backward(y_out(dy).copy(), c_p)
    sent = stats.bytes_sent
    assert sent == par.spec(xl.shape).comm_bytes, (what, sent, par.spec(xl.shape).comm_bytes)
    stats.reset()
    if hasattr(par, "sync_replicated_grads"):
        par.sync_replicated_grads()
        assert stats.bytes_sent == par.sync_volume().sent(P), (what, stats.bytes_sent)
    else:
        sync_replicated_grads(par.params, comm)
    assert stats.bytes_sent == replicated_sync_volume(par.params).sent(P), (what, stats.bytes_sent)
    assert (stats.bytes_sent > 0) == (what.endswith("sp=True") and P > 1
                                      and not what.startswith(("column", "embedding"))), what
    close(y_p, y_out(y_s), f"{what}: output")
    if dx_s is None:
        assert dx_p is None, what
    else:
        close(dx_p, x_in(dx_s), f"{what}: input gradient")
    g = gather_params(par, comm, grads=True)
    assert list(g) == [p.name for p in ser.params], (what, list(g))
    for p in ser.params:
        close(g[p.name], p.grad, f"{what}: d{p.name}")
    d = gather_params(par, comm)
    for p in ser.params:                              # cut from the same initialisation
        assert np.array_equal(d[p.name], p.data), f"{what}: {p.name} (initial value)"
    assert par.rng_state() == ser.rng_state(), (what, par.rng_state(), ser.rng_state())
    return sent


x = rand((B, T, C), 10)
dyC = rand((B, T, C), 11)
dyH = rand((B, T, H), 12)
xH = rand((B, T, H), 13)
kw = dict(seed=4, dtype=F64)
for sp in (False, True):
    x_in = seq if sp else full
    compare(ColumnParallelLinear(comm, C, H, sequence_parallel=sp, index=1, name="lin", **kw),
            Linear(C, H, index=1, name="lin", **kw), x, dyH, x_in, last, f"column sp={sp}")
    compare(RowParallelLinear(comm, H, C, sequence_parallel=sp, index=2, name="lin", **kw),
            Linear(H, C, index=2, name="lin", **kw), xH, dyC, last, x_in, f"row sp={sp}")
    compare(ParallelMLPBlock(comm, C, H, dropout=0.2, sequence_parallel=sp, index=3, **kw),
            MLPBlock(C, H, dropout=0.2, index=3, **kw), x, dyC, x_in, x_in, f"mlp sp={sp}")
    compare(ParallelCausalSelfAttention(comm, C, NH, dropout=0.2, sequence_parallel=sp,
                                        index=4, proj_std=0.1, **kw),
            CausalSelfAttention(C, NH, dropout=0.2, index=4, proj_std=0.1, **kw),
            x, dyC, x_in, x_in, f"attention sp={sp}")
    sent = compare(ParallelTransformerBlock(comm, C, NH, dropout=0.2, sequence_parallel=sp,
                                            index=5, name="h", **kw),
                   TransformerBlock(C, NH, dropout=0.2, index=5, name="h", **kw),
                   x, dyC, x_in, x_in, f"transformer block sp={sp}")
    nb = x.nbytes       # two allreduces of (B, T, C) each way; under sp one more: the
    assert sent == ((5 if sp else 4) * 2 * (P - 1) * nb // P), (sp, sent)  # inputs re-gathered
    tokens = np.random.default_rng([8, 1]).integers(0, V, (B, T))
    compare(VocabParallelEmbedding(comm, V, C, T, sequence_parallel=sp, index=6, **kw),
            Embedding(V, C, T, index=6, **kw), tokens, dyC, full, x_in, f"embedding sp={sp}")
compare(ColumnParallelLinear(comm, C, H, gather_output=True, index=1, name="lin", **kw),
        Linear(C, H, index=1, name="lin", **kw), x, dyH, full, full, "column gather_output")

# -- the loss: never gathered, equal to the serial one ---------------------------------------------
z = rand((B, T, V), 20) * 30.0                       # large logits: the max matters
tgt = np.random.default_rng([8, 2]).integers(0, V, (B, T))
tgt[0, :3] = -100
for reduction in ("mean", "sum"):
    ser = SoftmaxCrossEntropy(reduction=reduction)
    par = VocabParallelCrossEntropy(comm, reduction=reduction)
    l_s, c_s = ser.forward(z.copy(), tgt)
    stats.reset()
    l_p, c_p = par.forward(last(z).copy(), tgt)
    d_p = par.backward(0.7, c_p)
    assert stats.bytes_sent == par.spec(last(z).shape, F64).comm_bytes, stats.bytes_sent
    assert abs(l_p - l_s) < TOL, (reduction, l_p, l_s)
    close(d_p, last(ser.backward(0.7, c_s)), f"xent {reduction}: dlogits")
    assert np.all(d_p[0, :3] == 0)


# -- parallel_gpt: SGD steps against the serial gpt ------------------------------------------------
def batch(step, n=4):
    g = np.random.default_rng([9, step])
    return g.integers(0, V, (n, T)), g.integers(0, V, (n, T))


def sgd(model, steps, tp=None, dp=None):
    return sgd_loop.sgd(model, steps, batch, lr=0.3, tp=tp, dp=dp)


STEPS, gkw = 3, dict(dropout=0.1, seed=5, dtype=F64)
serial = models.gpt(V, T, 2, C, NH, **gkw)
ref_losses = sgd(serial, STEPS)
ref = {p.name: p.data for p in serial.params}
init = {p.name: p.data for p in models.gpt(V, T, 2, C, NH, **gkw).params}
assert all(np.abs(ref[k] - init[k]).max() > 1e-4 for k in ref if "ln" not in k)   # not vacuous
runs = {}
for sp in (False, True):
    model = parallel_gpt(comm, V, T, 2, C, NH, sequence_parallel=sp, **gkw)
    losses = sgd(model, STEPS, tp=comm)
    close(losses, ref_losses, f"gpt sp={sp}: losses")
    got = gather_params(model, comm)
    assert list(got) == list(ref), list(got)
    for name in ref:
        close(got[name], ref[name], f"gpt sp={sp}: {name}")
    for p in model.params:                            # replicated parameters stay equal
        if p.tp_axis is None:
            every = np.asarray(world.allgather(p.data))
            assert np.all(every == every[0]), (sp, p.name)
    # one step's bytes: the chain's spec plus the once-per-step sync of partial gradients
    tok, tgt = batch(0)
    stats.reset()
    model.zero_grad()
    model.backward(1.0, model.forward(tok, tgt)[1], need_dx=False)
    sync_replicated_grads(model.params, comm)
    want = sum(s.comm_bytes for s in model.spec(tok.shape)) + \
        replicated_sync_volume(model.params).sent(P)
    assert stats.bytes_sent == want, (sp, stats.bytes_sent, want)
    runs[sp] = got
for name in ref:
    close(runs[True][name], runs[False][name], f"gpt sp on/off: {name}", tol=1e-12)

# -- dp x tp = 2 x 2 -------------------------------------------------------------------------------
if P == 4:
    from hpcnn.parallel.data.bucketed import DataParallel
    from hpcnn.parallel.collectives.grid import ProcessGrid
    grid = ProcessGrid(world, dp=2, tp=2)
    tp2 = Communicator(grid.tp_comm, CommStats(), name="tp")
    serial = models.gpt(V, T, 2, C, NH, **gkw)
    sgd(serial, STEPS)
    ref = {p.name: p.data for p in serial.params}
    for sp in (False, True):
        model = parallel_gpt(tp2, V, T, 2, C, NH, sequence_parallel=sp, **gkw)
        dp = DataParallel(model, Communicator(grid.dp_comm, CommStats(), name="dp"),
                          bucket_mb=0.01, overlap=True)
        sgd(model, STEPS, tp=tp2, dp=dp)
        got = gather_params(model, tp2)
        assert list(got) == list(ref)
        for name in ref:
            close(got[name], ref[name], f"dp x tp sp={sp}: {name}")
    grid.free()

# -- dimensions tp does not divide: rejected with the numbers, on every rank -----------------------
if P > 1:
    bad = [
        (lambda: ColumnParallelLinear(comm, C, 4 * P + 1, name="fc"),
         f"fc: output features ({4 * P + 1}) is not divisible by tp ({P})"),
        (lambda: RowParallelLinear(comm, 4 * P + 2 - (P == 2), C, name="proj"),
         f"proj: input features ({4 * P + 2 - (P == 2)}) is not divisible by tp ({P})"),
        (lambda: ParallelMLPBlock(comm, C, 4 * P + 1),
         f"mlp: hidden features ({4 * P + 1}) is not divisible by tp ({P})"),
        (lambda: ParallelCausalSelfAttention(comm, 6 * (P + 1), P + 1),
         f"attn: attention heads ({P + 1}) is not divisible by tp ({P})"),
        (lambda: VocabParallelEmbedding(comm, 4 * P + 1, C, T),
         f"embed: vocabulary size ({4 * P + 1}) is not divisible by tp ({P})"),
        (lambda: parallel_gpt(comm, V, T, 1, 6 * (P + 1), P + 1),
         f"gpt: attention heads ({P + 1}) is not divisible by tp ({P})"),
        (lambda: VocabParallelEmbedding(comm, V, C, T, sequence_parallel=True).forward(
            np.zeros((1, P + 1), dtype=int)),
         f"embed: sequence length ({P + 1}) is not divisible by tp ({P})"),
        (lambda: tp_comm.ReduceScatterSeq(comm).forward(rand((1, P + 1, 2), 0)),
         f"reduce-scatter: size of dimension 1 in (1, {P + 1}, 2) ({P + 1}) is not divisible "
         f"by tp ({P})"),
        (lambda: tp_comm.SplitLast(comm).forward(rand((2, 2 * P + 1), 0)),
         f"split: size of dimension 1 in (2, {2 * P + 1}) ({2 * P + 1}) is not divisible "
         f"by tp ({P})"),
    ]
    for make, msg in bad:
        try:
            make()
            raise AssertionError(f"not rejected: {msg}")
        except ValueError as e:
            assert msg in str(e), (str(e), msg)

if r == 0:
    print(f"tp_blocks OK on {P} ranks")
