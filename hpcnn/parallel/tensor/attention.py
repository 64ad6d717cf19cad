"""Tensor-parallel causal self-attention and transformer block (Shoeybi et al. 2019, Fig. 3b).

Attention heads are independent, so tp ranks each take nh/tp heads: the fused qkv projection is
column-parallel with the q, k and v columns of a rank's heads kept together, the attention core
runs on those heads with no communication, and the output projection is row-parallel. With
sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) the block's input and output are the
(B, T/tp, C) slices the LayerNorms, dropouts and residuals work on. See
:mod:`hpcnn.parallel.tensor.linear`.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; \\
        from hpcnn.parallel.collectives import world; \\
        from hpcnn.parallel.tensor.attention import \\
        ParallelTransformerBlock; c = world(); \\
        b = ParallelTransformerBlock(c, 16, 4, dtype=np.float64); \\
        print(b.forward(np.ones((2, 8, 16)))[0].shape, b.spec((2, 8, 16)).comm_bytes)"
"""
from __future__ import annotations

import math

from hpcnn import backend
from hpcnn.nn.core import Block, BlockSpec
from hpcnn.nn.transformer import AttentionCache, CausalSelfAttention, TransformerBlock, sub_index
from hpcnn.parallel.tensor.linear import (ColumnParallelLinear, ParallelMLPBlock,
                                          RowParallelLinear, ShardDropout, replicated_layernorm,
                                          replicated_sync_volume, seq_dropout,
                                          sync_replicated_grads)
from hpcnn.parallel.tensor.mappings import Volume, check_divides


class ParallelCausalSelfAttention(CausalSelfAttention):
    """:class:`~hpcnn.nn.transformer.CausalSelfAttention` with its heads split over tp.

    ``qkv`` is a :class:`ColumnParallelLinear` with ``parts=3`` over the serial [q | k | v]
    weight: rank r holds the columns of heads [r nh/tp, (r+1) nh/tp) of each of q, k and v, so
    its output (B, T, 3C/tp) has the serial head layout for nh/tp heads. ``proj`` is a
    :class:`RowParallelLinear` over the rows of the same heads (output summed, or reduce-scattered
    along T with ``sequence_parallel``: x and y are then (B, T/tp, C)). The attention dropout mask
    is this rank's heads of the serial mask. ``n_heads`` is the local number of heads; the
    backward is the serial one (inherited: it reads the local heads and calls ``proj`` and
    ``qkv``, whose backward run the collectives). Cache: the serial block's
    :class:`~hpcnn.nn.transformer.AttentionCache`.
    """

    def __init__(self, comm, dim, n_heads, *, dropout=0.0, sequence_parallel=False, seed=0,
                 index=0, init_std=0.02, proj_std=None, dtype=backend.DEFAULT_DTYPE, name="attn",
                 keep=None):
        Block.__init__(self)
        dim, n_heads = int(dim), int(n_heads)
        if n_heads <= 0 or dim % n_heads != 0:
            raise ValueError(f"{name}: dim ({dim}) must be a multiple of n_heads ({n_heads})")
        self.n_heads = check_divides(f"{name}: attention heads", n_heads, comm.size)  # local
        self.name, self.dim, self.dtype, self.comm = name, dim, backend.dtype_of(dtype), comm
        self.n_heads_total, self.head_size = n_heads, dim // n_heads
        self.scale = 1.0 / math.sqrt(self.head_size)
        self.sequence_parallel = sp = bool(sequence_parallel)
        proj_std = init_std if proj_std is None else proj_std
        self.qkv = ColumnParallelLinear(comm, dim, 3 * dim, parts=3, sequence_parallel=sp,
                                        seed=seed, index=sub_index(index, 0), init_std=init_std,
                                        dtype=dtype, name=f"{name}.qkv", keep=keep)
        self.proj = RowParallelLinear(comm, dim, dim, sequence_parallel=sp, seed=seed,
                                      index=sub_index(index, 1), init_std=proj_std, dtype=dtype,
                                      name=f"{name}.proj", keep=keep)
        kw = dict(seed=seed, index=sub_index(index, 2), dtype=dtype, name=f"{name}.drop")
        self.attn_drop = (ShardDropout(dropout, axis=1, rank=comm.rank, size=comm.size, **kw)
                          if comm.size > 1 else seq_dropout(comm, dropout, False, **kw))
        self.params = self.qkv.params + self.proj.params
        self._consts, self._scratch = {}, {}

    def forward(self, x):
        xp = backend.xp
        if x.ndim != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{self.name}: expected input (B, T, {self.dim}), got shape "
                             f"{tuple(x.shape)}")
        qkv, c_qkv = self.qkv.forward(x)                         # (B, T, 3C/tp) [x (B, T/tp, C)]
        B, T, _ = qkv.shape
        nh, hs = self.n_heads, self.head_size
        q, k, v = self._heads(qkv)                               # (B, nh/tp, T, hs) views
        dt = qkv.dtype
        bias = self._causal(T, dt)                               # (T, T)
        dropping = self.attn_drop.training and self.attn_drop.p > 0.0
        att = xp.empty((B, nh, T, T), dtype=dt)                 # (B, nh/tp, T_key, T_query)
        y = xp.empty((B, T, nh, hs), dtype=dt)                  # (B, T, nh/tp, hs)
        yh = y.transpose(0, 2, 1, 3)                             # (B, nh/tp, T, hs) view of y
        bs = self._batch_step(B, T)
        qT_buf = self._buffer("qT", (bs, nh, hs, T), dt)
        for b0 in range(0, B, bs):                              # the serial core, local heads
            sl = slice(b0, min(B, b0 + bs))
            a = att[sl]                                          # (n, nh/tp, T, T) slice
            qT = xp.multiply(q[sl].swapaxes(-1, -2), self.scale, out=qT_buf[:a.shape[0]])
            xp.matmul(k[sl], qT, out=a)                          # s = k q^T / sqrt(hs)
            a += bias                                            # no attention to the future
            a -= a.max(axis=-2, keepdims=True)                   # (n, nh/tp, 1, T) column max
            xp.exp(a, out=a)
            s = a.sum(axis=-2, keepdims=True)                    # (n, nh/tp, 1, T)
            a *= xp.divide(1.0, s, out=s)                        # softmax over keys, in place
            if not dropping:
                xp.matmul(a.swapaxes(-1, -2), v[sl], out=yh[sl]) # y = att^T v
        c_drop = None
        if dropping:
            att_d, c_drop = self.attn_drop.forward(att)          # (B, nh/tp, T, T)
            xp.matmul(att_d.swapaxes(-1, -2), v, out=yh)
        y = y.reshape(B, T, nh * hs)                            # (B, T, C/tp) heads merged
        out, c_proj = self.proj.forward(y)                       # (B, T, C) [(B, T/tp, C)]
        return out, AttentionCache(c_qkv=c_qkv, qkv=qkv, att=att, c_drop=c_drop, c_proj=c_proj)

    def spec(self, x_shape):
        qkv = self.qkv.spec(x_shape)                             # (B, T, 3C/tp)
        B, T, _ = qkv.out_shape
        nh, hs, dt = self.n_heads, self.head_size, self.dtype
        att_shape, n_att, ny = (B, nh, T, T), B * nh * T * T, B * T * nh * hs
        y_shape = (B, T, nh * hs)
        mm = 2.0 * n_att * hs
        # as CausalSelfAttention.spec, on this rank's heads
        scores = BlockSpec(name=f"{self.name}.scores", in_shape=qkv.out_shape, out_shape=att_shape,
                           flops_fwd=mm + ny + 6 * n_att, flops_bwd=2 * mm + 3 * ny + 2 * n_att,
                           bytes_x=qkv.bytes_y, bytes_y=backend.nbytes(att_shape, dt),
                           bytes_cache=qkv.bytes_y + backend.nbytes(att_shape, dt), bytes_params=0)
        redo = n_att if self.attn_drop.p > 0 else 0
        av = BlockSpec(name=f"{self.name}.av", in_shape=att_shape, out_shape=y_shape, flops_fwd=mm,
                       flops_bwd=2 * mm + redo, bytes_x=backend.nbytes(att_shape, dt),
                       bytes_y=backend.nbytes(y_shape, dt), bytes_cache=0, bytes_params=0)
        return BlockSpec.compose(self.name, [qkv, scores, self.attn_drop.spec(att_shape), av,
                                             self.proj.spec(y_shape)])


class ParallelTransformerBlock(TransformerBlock):
    """:class:`~hpcnn.nn.transformer.TransformerBlock` with sharded attention and MLP.

    x = x + Dropout(attn(ln1(x))); x = x + mlp(ln2(x)): the LayerNorms are replicated
    (:class:`~hpcnn.parallel.tensor.linear.TPParameter`), the attention and the MLP sharded, so one
    allreduce per sub-block each way. With ``sequence_parallel`` x and y are (B, T/tp, C): the
    norms, the residual dropout and the adds run on this rank's slice, the collectives become
    all-gathers and reduce-scatters, and the LayerNorm parameters and the projection biases get
    partial gradients: call :meth:`sync_replicated_grads` once per step after the backward.
    forward, backward, RNG state and spec are the serial block's (inherited).
    """

    def __init__(self, comm, dim, n_heads, *, hidden=None, dropout=0.0, sequence_parallel=False,
                 seed=0, index=0, init_std=0.02, proj_std=None, dtype=backend.DEFAULT_DTYPE,
                 name="block", keep=None):
        Block.__init__(self)
        self.name, self.dim, self.dtype, self.comm = name, int(dim), backend.dtype_of(dtype), comm
        self.sequence_parallel = sp = bool(sequence_parallel)
        kw = dict(seed=seed, dtype=dtype, sequence_parallel=sp, keep=keep)
        self.ln1 = replicated_layernorm(dim, sequence_parallel=sp, dtype=dtype, name=f"{name}.ln1",
                                        keep=keep)
        self.attn = ParallelCausalSelfAttention(comm, dim, n_heads, dropout=dropout,
                                                index=sub_index(index, 1), init_std=init_std,
                                                proj_std=proj_std, name=f"{name}.attn", **kw)
        self.drop = seq_dropout(comm, dropout, sp, seed=seed, index=sub_index(index, 2),
                                dtype=dtype, name=f"{name}.drop")
        self.ln2 = replicated_layernorm(dim, sequence_parallel=sp, dtype=dtype, name=f"{name}.ln2",
                                        keep=keep)
        self.mlp = ParallelMLPBlock(comm, dim, hidden, dropout=dropout, index=sub_index(index, 4),
                                    init_std=init_std, proj_std=proj_std, name=f"{name}.mlp", **kw)
        self.params = self.ln1.params + self.attn.params + self.ln2.params + self.mlp.params

    def sync_replicated_grads(self) -> None:
        """Sum the partial gradients (sequence parallelism) over tp; nothing to do otherwise."""
        sync_replicated_grads(self.params, self.comm)

    def sync_volume(self) -> Volume:
        """What :meth:`sync_replicated_grads` hands to its allreduce (once per step)."""
        return replicated_sync_volume(self.params) if self.comm.size > 1 else Volume()
