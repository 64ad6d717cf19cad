"""Vocabulary-parallel token embedding and softmax cross-entropy (Shoeybi et al. 2019, Sec. 3).

Rank r of tp holds the rows [r V/tp, (r+1) V/tp) of the token embedding and the same columns of
the LM head's output, so neither the embedding table nor the logits are ever gathered. The loss
reduces three numbers per row instead of V: the row maximum (allreduce MAX), the sum of
exp(z - max) and the target logit (one allreduce SUM of both). See :mod:`hpcnn.parallel.tensor.linear`.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; \\
        from hpcnn.parallel.collectives import world; \\
        from hpcnn.parallel.tensor.vocab import \\
        VocabParallelCrossEntropy; c = world(); \\
        z = np.arange(8.0).reshape(2, 4) + 4 * c.rank; \\
        print(VocabParallelCrossEntropy(c).forward(z, np.array([0, 7]))[0])"
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy

from hpcnn import backend
from hpcnn.nn.core import Block, BlockSpec
from hpcnn.nn.loss import checked_targets, mean_loss
from hpcnn.nn.transformer import Embedding, check_tokens
from hpcnn.parallel.tensor.linear import TPParameter, seq_local, shard_array
from hpcnn.parallel.tensor.mappings import (Reduce, ReduceScatterSeq, Volume, allreduce_max,
                                            check_divides)


class VocabEmbeddingCache(NamedTuple):
    """The cache of :class:`VocabParallelEmbedding`."""
    idx: Any            # (B, T) each token's row in this shard (0 where it is not held here)
    own: Any            # (B, T) bool: the token's row is held here


class VocabParallelEmbedding(Block):
    """y = wte[tokens] + wpe[:T], :class:`~hpcnn.nn.transformer.Embedding` with wte split by rows.

    forward(tokens int (B, T), replicated) -> (B, T, C), summed over tp (:class:`Reduce`: a
    token whose row lives elsewhere contributes zeros here); with ``sequence_parallel``
    reduce-scattered along T to (B, T/tp, C), then this slice's positions added. backward: dy
    (all-gathered along T under sp) is scattered into this rank's rows; wpe gets the full
    gradient on every rank (replicated, not partial). Parameters ``wte`` (V/tp, C), tp_axis 0,
    and ``wpe`` (max_len, C) replicated. Cache: :class:`VocabEmbeddingCache`, the local row of
    each token and whether it is here.
    """

    def __init__(self, comm, vocab, dim, max_len, *, sequence_parallel=False, seed=0, index=0,
                 dtype=backend.DEFAULT_DTYPE, name="embed", keep=None):
        super().__init__()
        self.vocab_local = check_divides(f"{name}: vocabulary size", int(vocab), comm.size)
        full = Embedding(vocab, dim, max_len, seed=seed, index=index, dtype=dtype, name=name,
                         keep=keep)
        self.name, self.dtype, self.comm = name, backend.dtype_of(dtype), comm
        self.vocab, self.dim, self.max_len = int(vocab), int(dim), int(max_len)
        self.lo = comm.rank * self.vocab_local                     # first token id held here
        self.sequence_parallel = bool(sequence_parallel)
        self.wte = TPParameter(shard_array(full.wte.data, 0, comm.rank, comm.size),
                               full.wte.name, tp_axis=0)           # (V/tp, C)
        self.wpe = TPParameter(full.wpe.data, full.wpe.name)       # (max_len, C) replicated
        self.params = [self.wte, self.wpe]
        self.exit = ReduceScatterSeq(comm) if sequence_parallel else Reduce(comm)

    def forward(self, tokens):
        xp = backend.xp
        T = check_tokens(self.name, tokens, self.max_len, self.vocab)
        if self.sequence_parallel:
            check_divides(f"{self.name}: sequence length", T, self.comm.size)
        local = tokens - self.lo                                   # (B, T) ids in this shard
        own = (local >= 0) & (local < self.vocab_local)            # (B, T) rows held here
        idx = xp.where(own, local, 0)                              # (B, T)
        e = self.wte.data[idx]                                     # (B, T, C) fresh
        e *= own[..., None]                                        # others' tokens: zeros
        y, _ = self.exit.forward(e)                                # (B, T, C) [(B, T/tp, C)]
        t0 = self.comm.rank * y.shape[1] if self.sequence_parallel and self.comm.size > 1 else 0
        y += self.wpe.data[t0:t0 + y.shape[1]]                     # this slice's positions
        return y, VocabEmbeddingCache(idx=idx, own=own)

    def backward(self, dy, cache):
        xp = backend.xp
        idx, own = cache.idx, cache.own
        C = self.dim
        dy = self.exit.backward(dy, None)                          # (B, T, C) [all-gathered]
        T = dy.shape[1]
        # from y += wpe[:T] (every position, on every rank)
        self.wpe.grad[:T] += dy.sum(axis=0)                        # (T, C)
        # from e = wte[idx] * own: scatter-add the rows of tokens held here, in token order
        tok = idx[own]                                             # (M,)
        rows = dy[own]                                             # (M, C)
        g = self.wte.grad
        if g.flags.c_contiguous:
            flat = (tok.reshape(-1, 1) * C + xp.arange(C)).reshape(-1)   # (M*C,)
            xp.add.at(g.reshape(-1), flat, rows.reshape(-1))
        else:
            xp.add.at(g, tok, rows)
        return None

    def spec(self, x_shape):
        B, T = x_shape
        p, dt = self.comm.size, self.dtype
        full = (B, T, self.dim)
        out = seq_local(full, p) if self.sequence_parallel else full
        ny, nb_tok = B * T * self.dim, backend.nbytes(x_shape, numpy.int64)
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=out, flops_fwd=2 * ny,
                         flops_bwd=2 * ny, bytes_x=nb_tok, bytes_y=backend.nbytes(out, dt),
                         bytes_cache=nb_tok + B * T,
                         bytes_params=sum(backend.nbytes(q.shape, dt) for q in self.params),
                         comm_bytes=self.exit.volume(backend.nbytes(full, dt)).sent(p))


class VocabCrossEntropyCache(NamedTuple):
    """What :class:`VocabParallelCrossEntropy`'s backward needs (N = rows of the logits)."""
    probs: Any          # (N, V/tp) this shard's softmax probabilities
    col: Any            # (N,) the target's local column (0 where not held here)
    own: Any            # (N,) bool: the target's column is held here
    valid: Any          # (N,) bool: the row counts
    count: Any          # number of counted rows (an int; a device scalar on a device)
    shape: tuple        # the local logits' shape (..., V/tp)


class VocabParallelCrossEntropy:
    """:class:`~hpcnn.nn.loss.SoftmaxCrossEntropy` of logits split by vocabulary, never gathered.

    ``forward(logits (..., V/tp), targets (...)) -> (loss, cache)``, targets replicated. With
    m = max_v z_v (allreduce MAX of the local maxima) and s = sum_v exp(z_v - m) (allreduce SUM of
    local sums, together with z_t - m sent by the rank holding the target t, zeros elsewhere):
    -log p_t = log s - (z_t - m). ``backward(dloss, cache) -> dlogits (..., V/tp)``, local:
    (softmax - onehot(t) on the target's owner) * dloss / count. Mean over the rows whose target
    is not ``ignore_index``, or their sum with ``reduction="sum"``. Cache:
    :class:`VocabCrossEntropyCache`, this shard's softmax, the targets' local columns, where they
    are held, the counted rows and their number.
    """

    name = "xent"

    def __init__(self, comm, ignore_index: int = -100, reduction: str = "mean"):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.comm, self.ignore_index, self.reduction = comm, int(ignore_index), reduction
        self.params = []                     # no parameters (an own list: never shared)
        self.reduce = Reduce(comm)

    def forward(self, logits, targets):
        xp = backend.xp
        Vl = logits.shape[-1]
        V, lo = Vl * self.comm.size, Vl * self.comm.rank
        tt, valid = checked_targets(logits.shape, targets, V, self.ignore_index)   # (N,)
        z = logits.reshape(-1, Vl)                                 # (N, V/tp)
        zmax = z.max(axis=1)                                       # (N,) local maxima
        allreduce_max(self.comm, zmax)                             # (N,) max over V
        probs = xp.exp(z - zmax[:, None])                          # (N, V/tp) exp, then p
        col = tt - lo                                              # (N,) target's local column
        own = (col >= 0) & (col < Vl)                              # (N,) target held here
        col = xp.where(own, col, 0)
        rows = xp.arange(z.shape[0])
        st = xp.empty((2, z.shape[0]), dtype=z.dtype)              # (2, N): sum exp, z_t - m
        probs.sum(axis=1, out=st[0])
        st[1] = xp.where(own, z[rows, col] - zmax, 0.0)
        self.reduce.forward(st)                                    # (2, N) summed over tp
        s = st[0]
        # -log p[t] = log(sum exp(z - zmax)) - (z[t] - zmax)
        nll = xp.log(s) - st[1]
        loss, count = mean_loss(nll, valid, self.reduction)
        probs /= s[:, None]                                        # probabilities, in place
        return loss, VocabCrossEntropyCache(probs=probs, col=col, own=own, valid=valid,
                                            count=count, shape=tuple(logits.shape))

    def backward(self, dloss, cache):
        """dlogits = (softmax - onehot(target)) * dloss / count on counted rows, 0 elsewhere."""
        d = cache.probs.copy()                                     # (N, V/tp)
        r = backend.xp.nonzero(cache.own)[0]
        d[r, cache.col[r]] -= 1.0                                  # from -z[t], on its owner
        scale = dloss if self.reduction == "sum" else dloss / backend.xp.maximum(cache.count, 1)
        d *= (cache.valid * scale).astype(d.dtype)[:, None]
        return d.reshape(cache.shape)

    def spec(self, x_shape, dtype=backend.DEFAULT_DTYPE):
        """The cache is this shard's probabilities and, per row, the target's local column
        (int64 targets assumed), whether it is held here and whether the row counts (bools)."""
        dt, p = backend.dtype_of(dtype), self.comm.size
        nb = backend.nbytes(x_shape, dt)
        n, rows = nb // dt.itemsize, nb // dt.itemsize // int(x_shape[-1])
        vol = Volume(allreduce=2 * rows * dt.itemsize, allreduce_max=rows * dt.itemsize)
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=(), flops_fwd=5 * n,
                         flops_bwd=3 * n, bytes_x=nb, bytes_y=8, bytes_cache=nb + 10 * rows,
                         bytes_params=0, comm_bytes=vol.sent(p) if p > 1 else 0)
