"""Operator (tensor) parallelism: blocks whose weights are split over the tp ranks.

Megatron-LM's layout (Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3): a linear layer is split
on its output columns (:class:`ColumnParallelLinear`: replicated input, no communication forward,
allreduce of dx backward) or on its input rows (:class:`RowParallelLinear`: parallel input, partial
outputs summed forward); an MLP is column -> GELU -> row, one allreduce each way
(:class:`ParallelMLPBlock`); attention splits its heads (:mod:`hpcnn.parallel.tensor.attention`); the
embedding and the loss split the vocabulary (:mod:`hpcnn.parallel.tensor.vocab`). With sequence
parallelism (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2) the LayerNorm, dropout and
residual regions hold a T/tp slice of the sequence: the allreduce becomes an all-gather before the
column-parallel layer and a reduce-scatter after the row-parallel one (same bytes, 1/tp of the
activations), and the replicated parameters used there get partial gradients, summed over tp by
:func:`sync_replicated_grads` once per step.

Every block is cut from the serial block's own initialisation (the serial block is built with the
same keys, then this rank keeps its shard), so tp = 1 and tp = k start from identical weights.
Shards are :class:`TPParameter` with the serial names; :func:`gather_params` rebuilds the full
arrays. ``spec(x_shape)`` takes this rank's input shape and reports in ``comm_bytes`` what one
forward+backward sends under :mod:`~hpcnn.parallel.collectives.comm`'s counting convention.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; \\
        from hpcnn.parallel.collectives import world; from hpcnn.parallel.tensor.factories import \\
        parallel_gpt; c = world(); m = parallel_gpt(c, 32, 8, 1, 16, 4, \\
        seed=0, dtype=np.float64); t = np.arange(16).reshape(2, 8) % 32; \\
        print(m.forward(t, t)[0], c.stats.bytes_sent)"
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import numpy

from hpcnn import backend
from hpcnn.nn.core import Block, BlockSpec, Parameter, is_placeholder, placeholder
from hpcnn.nn.layers import GELU, Dropout, DropoutCache, LayerNorm, Linear, LinearCache
from hpcnn.nn.transformer import MLPBlock, sub_index
from hpcnn.parallel.tensor.mappings import (AllGatherSeq, Copy, GatherLast, Reduce,
                                            ReduceScatterSeq, Volume, check_divides)


class TPParameter(Parameter):
    """A Parameter that knows how it lies over the tp ranks.

    ``tp_axis``: the axis of the full array this shard is cut along (None: replicated, the full
    array on every rank). ``tp_parts``: that axis is ``tp_parts`` equal blocks, each cut in tp
    pieces (3 for the fused [q | k | v] weight: rank r holds q_r | k_r | v_r). ``tp_partial``:
    the gradient is this rank's partial sum (a replicated parameter used on a sequence slice),
    summed over tp by :func:`sync_replicated_grads`.
    """

    __slots__ = ("tp_axis", "tp_parts", "tp_partial")

    def __init__(self, data, name, tp_axis=None, tp_parts=1, tp_partial=False):
        super().__init__(data, name)
        self.tp_axis, self.tp_parts, self.tp_partial = tp_axis, int(tp_parts), bool(tp_partial)


def shard_array(full, axis: int, rank: int, size: int, parts: int = 1):
    """This rank's shard of ``full``: along ``axis``, part ``rank`` of ``size`` of each of
    ``parts`` equal blocks, concatenated (a contiguous copy)."""
    xp = backend.xp
    if is_placeholder(full):                         # another pipeline rank's: still no storage
        shape = list(full.shape)
        shape[axis] //= size
        return placeholder(shape, full.dtype)
    blk = full.shape[axis] // parts
    k = blk // size
    pieces = [xp.take(full, xp.arange(g * blk + rank * k, g * blk + (rank + 1) * k), axis=axis)
              for g in range(parts)]
    return xp.ascontiguousarray(xp.concatenate(pieces, axis=axis))


def _sharded(param, axis, comm, parts=1):
    return TPParameter(shard_array(param.data, axis, comm.rank, comm.size, parts), param.name,
                       tp_axis=axis, tp_parts=parts)


def _local_linear(weight, bias, dtype, name):
    """A Linear computing with the given (sharded) parameters (built without storage of its own:
    its parameters are replaced at once)."""
    lin = Linear(weight.shape[0], weight.shape[1], bias=bias is not None, init_std=0.0,
                 dtype=dtype, name=name, keep=())
    lin.weight, lin.bias = weight, bias
    lin.params = [weight] + ([bias] if bias is not None else [])
    return lin


def seq_full(shape, p: int) -> tuple:
    """(B, T/tp, ...) -> (B, T, ...): the shape a sequence all-gather produces."""
    return (shape[0], shape[1] * p) + tuple(shape[2:])


def seq_local(shape, p: int) -> tuple:
    """(B, T, ...) -> (B, T/tp, ...), T checked."""
    return (shape[0], check_divides("sequence length", shape[1], p)) + tuple(shape[2:])


class ShardDropout(Dropout):
    """Dropout of a shard: the mask is this rank's part, along ``axis``, of the mask the serial
    block draws for the whole tensor (same key), so tp = 1 and tp = k drop the same elements.
    Each rank draws the full mask: tp times its shard's random numbers, no communication."""

    def __init__(self, p=0.0, *, axis, rank, size, seed=0, index=0, dtype=backend.DEFAULT_DTYPE,
                 name="dropout"):
        super().__init__(p, seed=seed, index=index, dtype=dtype, name=name)
        if int(axis) == 0:
            raise ValueError(f"{name}: a shard dropout splits a non-batch axis, got axis=0")
        self.axis, self.rank, self.size = int(axis), int(rank), int(size)

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x, DropoutCache(mask=None)
        n = x.shape[self.axis]
        full = list(x.shape)
        full[self.axis] = n * self.size
        idx = [slice(None)] * x.ndim
        idx[self.axis] = slice(self.rank * n, (self.rank + 1) * n)
        # this rank's part of the serial mask, copied: a view would keep the whole mask alive
        mask = self._mask(tuple(full))[tuple(idx)].copy()
        return x * mask, DropoutCache(mask=mask)


def seq_dropout(comm, p, sequence_parallel, *, axis=1, **kw):
    """Dropout on a replicated tensor, or on a sequence slice (:class:`ShardDropout`) under sp."""
    if sequence_parallel and comm.size > 1:
        return ShardDropout(p, axis=axis, rank=comm.rank, size=comm.size, **kw)
    return Dropout(p, **kw)


def replicated_layernorm(dim, *, sequence_parallel=False, dtype=backend.DEFAULT_DTYPE, name="ln",
                         keep=None):
    """A LayerNorm whose parameters are replicated :class:`TPParameter` (partial gradients under
    sequence parallelism: it then normalises this rank's T/tp rows only)."""
    ln = LayerNorm(dim, dtype=dtype, name=name, keep=keep)
    ln.gamma = TPParameter(ln.gamma.data, ln.gamma.name, tp_partial=sequence_parallel)
    ln.beta = TPParameter(ln.beta.data, ln.beta.name, tp_partial=sequence_parallel)
    ln.params = [ln.gamma, ln.beta]
    return ln


class ColumnParallelCache(NamedTuple):
    """The cache of :class:`ColumnParallelLinear`: its three steps' caches."""
    c_in: Any           # under sequence parallelism the input's (B, T/tp, in) slice, else None
    c_lin: Any          # self.linear's LinearCache: the input (None: gathered again from c_in)
    c_out: Any          # self.gather's, or None without gather_output


class ColumnParallelLinear(Block):
    """y = x W_r + b_r with W = [W_1, ..., W_tp] split on its output columns (Shoeybi Eq. 3).

    forward: x (..., in) replicated [(B, T/tp, in) with ``sequence_parallel``, all-gathered
    along T first] -> (..., out/tp) [(..., out) with ``gather_output``]. backward: dx is summed
    over tp (:class:`Copy`; reduce-scattered along T with sequence parallelism).
    ``parts``: the output is ``parts`` equal blocks each split over tp (3 for [q | k | v]).
    Parameters ``weight`` (in, out/tp), tp_axis 1, and ``bias`` (out/tp,), tp_axis 0.
    Cache: :class:`ColumnParallelCache`, whose ``c_lin`` holds the input; under sequence
    parallelism ``c_in`` holds the (B, T/tp, in) slice instead, all-gathered again in the
    backward for the weight gradient (Korthikanti et al.: a tp-th of the memory for one more
    all-gather; the gathered copy lives within the backward call).
    ``backward(dy, cache, defer=None)``: with a list, the local Linear's weight gradient is
    deferred into it (:class:`~hpcnn.nn.layers.Linear`).
    """

    defers_weights = True

    def __init__(self, comm, n_in, n_out, *, bias=True, gather_output=False,
                 sequence_parallel=False, parts=1, seed=0, index=0, init_std=None,
                 dtype=backend.DEFAULT_DTYPE, name="linear", keep=None):
        super().__init__()
        if n_out % parts or (gather_output and parts > 1):
            raise ValueError(f"{name}: output features ({n_out}) must be {parts} equal blocks"
                             f"{', not gathered' if parts > 1 else ''}")
        what = "output features" + (f" per block ({n_out} / {parts})" if parts > 1 else "")
        check_divides(f"{name}: {what}", n_out // parts, comm.size)
        full = Linear(n_in, n_out, bias=bias, seed=seed, index=index, init_std=init_std,
                      dtype=dtype, name=name, keep=keep)           # the serial initialisation
        w = _sharded(full.weight, 1, comm, parts)                  # (in, out/tp)
        b = _sharded(full.bias, 0, comm, parts) if bias else None  # (out/tp,)
        self.name, self.dtype, self.comm = name, backend.dtype_of(dtype), comm
        self.n_in, self.n_out, self.parts = int(n_in), int(n_out), int(parts)
        self.sequence_parallel, self.gather_output = bool(sequence_parallel), bool(gather_output)
        self.linear = _local_linear(w, b, dtype, name)
        self.enter = AllGatherSeq(comm) if sequence_parallel else Copy(comm)
        self.gather = GatherLast(comm) if gather_output else None
        self.weight, self.bias = w, b
        self.params = self.linear.params

    def forward(self, x):
        xin, c_in = self.enter.forward(x)            # (..., in) replicated [gathered along T]
        y, c_lin = self.linear.forward(xin)          # (..., out/tp)
        if self._regathers:                          # keep the slice, not the gathered copy
            c_in, c_lin = x, None
        c_out = None
        if self.gather is not None:
            y, c_out = self.gather.forward(y)        # (..., out)
        return y, ColumnParallelCache(c_in=c_in, c_lin=c_lin, c_out=c_out)

    def backward(self, dy, cache, defer=None):
        if self.gather is not None:
            dy = self.gather.backward(dy, cache.c_out)       # (..., out/tp) this rank's part
        c_lin = cache.c_lin
        if c_lin is None:                                    # gathered again, bit for bit
            c_lin = LinearCache(x=self.enter.forward(cache.c_in)[0])
        dx = self.linear.backward(dy, c_lin, defer)          # (..., in) partial: y = x W_r + b_r
        return self.enter.backward(dx, None)         # summed [reduce-scattered: (B, T/tp, in)]

    @property
    def _regathers(self) -> bool:
        """Whether the input's slice is cached and gathered again in the backward."""
        return self.sequence_parallel and self.enter.active

    def spec(self, x_shape):
        p, dt = self.comm.size, self.dtype
        x_shape = tuple(x_shape)
        full_in = seq_full(x_shape, p) if self.sequence_parallel else x_shape
        s = self.linear.spec(full_in)                # local product on the gathered input
        out = s.out_shape[:-1] + (self.n_out,) if self.gather is not None else s.out_shape
        vol = self.enter.volume(backend.nbytes(full_in, dt))
        if self._regathers:                          # the backward's second all-gather
            vol = vol + Volume(gather=(backend.nbytes(full_in, dt),))
        if self.gather is not None:
            vol = vol + self.gather.volume(backend.nbytes(out, dt))
        # the cache holds the input itself: under sp its slice, gathered again in the backward
        return replace(s, name=self.name, in_shape=x_shape, out_shape=out,
                       bytes_x=backend.nbytes(x_shape, dt), bytes_y=backend.nbytes(out, dt),
                       bytes_cache=(backend.nbytes(x_shape, dt) if self._regathers
                                    else s.bytes_cache),
                       comm_bytes=vol.sent(p), cache_has_x=s.cache_has_x or self._regathers)


class RowParallelLinear(Block):
    """y = sum_r x_r W_r + b with W = [W_1; ...; W_tp] split on its input rows (Shoeybi Sec. 3:
    the MLP's second GEMM, cf. Eq. 2; the sum is their ``g``).

    forward: x (..., in/tp), already split on its last dimension (a column-parallel output) ->
    partial products summed over tp (:class:`Reduce`; reduce-scattered along T to (B, T/tp, out)
    with ``sequence_parallel``), then + b, once. backward: dx = dy W_r^T, no communication
    (dy all-gathered along T first with sequence parallelism). Parameters ``weight``
    (in/tp, out), tp_axis 0, and ``bias`` (out,) replicated (partial gradient under sequence
    parallelism). Cache: its local Linear's :class:`~hpcnn.nn.layers.LinearCache`, the input x
    (the collective after it keeps nothing). ``backward(dy, cache, defer=None)``: with a list,
    the local Linear's weight gradient is deferred into it (the bias gradient is not).
    """

    defers_weights = True

    def __init__(self, comm, n_in, n_out, *, bias=True, sequence_parallel=False, seed=0,
                 index=0, init_std=None, dtype=backend.DEFAULT_DTYPE, name="linear", keep=None):
        super().__init__()
        check_divides(f"{name}: input features", n_in, comm.size)
        full = Linear(n_in, n_out, bias=bias, seed=seed, index=index, init_std=init_std,
                      dtype=dtype, name=name, keep=keep)           # the serial initialisation
        w = _sharded(full.weight, 0, comm)                         # (in/tp, out)
        self.name, self.dtype, self.comm = name, backend.dtype_of(dtype), comm
        self.n_in, self.n_out = int(n_in), int(n_out)
        self.sequence_parallel = bool(sequence_parallel)
        self.linear = _local_linear(w, None, dtype, name)
        self.exit = ReduceScatterSeq(comm) if sequence_parallel else Reduce(comm)
        self.weight = w
        self.bias = (TPParameter(full.bias.data, full.bias.name, tp_partial=sequence_parallel)
                     if bias else None)                             # (out,) replicated
        self.params = [w] + ([self.bias] if bias else [])

    def forward(self, x):
        y, c_lin = self.linear.forward(x)            # (..., out) partial sum over tp
        y, _ = self.exit.forward(y)                  # (..., out) summed [(B, T/tp, out)]
        if self.bias is not None:
            y += self.bias.data                      # added once, after the sum
        return y, c_lin

    def backward(self, dy, cache, defer=None):
        if self.bias is not None:                    # from y += b [partial: this T/tp slice]
            self.bias.add_grad(dy.reshape(-1, self.n_out).sum(axis=0))
        dyp = self.exit.backward(dy, None)           # (..., out) [all-gathered along T]
        return self.linear.backward(dyp, cache, defer)   # (..., in/tp): from y_r = x_r W_r

    def spec(self, x_shape):
        p, dt = self.comm.size, self.dtype
        s = self.linear.spec(tuple(x_shape))         # (..., out) partial
        out = seq_local(s.out_shape, p) if self.sequence_parallel else s.out_shape
        n_add = 0 if self.bias is None else backend.nbytes(out, dt) // dt.itemsize   # bias adds
        return replace(s, name=self.name, out_shape=out, bytes_y=backend.nbytes(out, dt),
                       flops_fwd=s.flops_fwd + n_add, flops_bwd=s.flops_bwd + n_add,
                       bytes_params=(s.bytes_params
                                     + (backend.nbytes((self.n_out,), dt) if n_add else 0)),
                       comm_bytes=self.exit.volume(backend.nbytes(s.out_shape, dt)).sent(p))


class ParallelMLPBlock(MLPBlock):
    """:class:`~hpcnn.nn.transformer.MLPBlock` as column -> GELU -> row (Shoeybi Sec. 3, Fig. 3a).

    One allreduce forward (after the row-parallel layer) and one backward (before the column-
    parallel one); with ``sequence_parallel`` x and y are (B, T/tp, C) and these become an
    all-gather and a reduce-scatter each way. The hidden activations are (B, T, H/tp). forward,
    backward and the RNG state are the serial block's (inherited): only the sub-blocks differ.
    """

    def __init__(self, comm, dim, hidden=None, *, dropout=0.0, sequence_parallel=False, seed=0,
                 index=0, init_std=0.02, proj_std=None, dtype=backend.DEFAULT_DTYPE, name="mlp",
                 keep=None):
        Block.__init__(self)
        self.name, self.dim, self.dtype, self.comm = name, int(dim), backend.dtype_of(dtype), comm
        self.hidden = 4 * self.dim if hidden is None else int(hidden)
        self.sequence_parallel = bool(sequence_parallel)
        check_divides(f"{name}: hidden features", self.hidden, comm.size)
        proj_std = init_std if proj_std is None else proj_std
        sp = self.sequence_parallel
        self.fc = ColumnParallelLinear(comm, dim, self.hidden, sequence_parallel=sp, seed=seed,
                                       index=sub_index(index, 0), init_std=init_std,
                                       dtype=dtype, name=f"{name}.fc", keep=keep)
        self.act = GELU(dtype=dtype)
        self.proj = RowParallelLinear(comm, self.hidden, dim, sequence_parallel=sp, seed=seed,
                                      index=sub_index(index, 1), init_std=proj_std,
                                      dtype=dtype, name=f"{name}.proj", keep=keep)
        self.drop = seq_dropout(comm, dropout, sp, seed=seed, index=sub_index(index, 2),
                                dtype=dtype, name=f"{name}.drop")
        self.params = self.fc.params + self.proj.params

    def spec(self, x_shape):
        fc = self.fc.spec(x_shape)                   # (B, T, H/tp)
        return BlockSpec.compose(self.name, [fc, self.act.spec(fc.out_shape),
                                             self.proj.spec(fc.out_shape),
                                             self.drop.spec(tuple(x_shape))])


# -- whole models ----------------------------------------------------------------------------------
def replicated_sync_volume(params) -> Volume:
    """What :func:`sync_replicated_grads` hands to its allreduce for these parameters."""
    return Volume(allreduce=sum(p.data.nbytes for p in params if getattr(p, "tp_partial", False)))


def sync_replicated_grads(params, comm) -> None:
    """Sum over tp the partial gradients of replicated parameters (``tp_partial``: LayerNorms and
    row-parallel biases under sequence parallelism; Korthikanti et al. 2022, Sec. 4.2.2), in one
    allreduce. Call once per step after the last backward, before the optimizer (and before a dp
    gradient reduction)."""
    ps = [p for p in params if getattr(p, "tp_partial", False)]
    if comm.size == 1 or not ps:
        return
    flat = backend.xp.concatenate([p.grad.reshape(-1) for p in ps])   # (sum of sizes,)
    comm.allreduce(flat)
    o = 0
    for p in ps:
        p.grad = flat[o:o + p.size].reshape(p.shape)
        o += p.size


def unshard(comm, a, axis: int, parts: int = 1):
    """The full array from every rank's shard ``a`` (cut along ``axis``, ``parts`` blocks)."""
    from hpcnn.parallel.tensor.mappings import all_gather
    xp = backend.xp
    g = xp.moveaxis(all_gather(comm, a, axis), axis, 0)          # (tp * n, ...) rank-major
    k = g.shape[0] // (comm.size * parts)
    g = g.reshape((comm.size, parts, k) + g.shape[1:]).swapaxes(0, 1)   # (parts, tp, k, ...)
    return xp.moveaxis(g.reshape((-1,) + g.shape[3:]), 0, axis)


def gather_params(model, comm, *, grads: bool = False) -> dict:
    """name -> full host array (a copy) of every parameter of ``model`` (a Chain, a Block or a list
    of Parameters); ``grads=True`` gathers the gradients. Collective over ``comm`` (the tp group):
    every rank calls it on the same model; replicated parameters are this rank's copy."""
    params = model.params if hasattr(model, "params") else list(model)
    out = {}
    for p in params:
        a = p.grad if grads else p.data
        axis = getattr(p, "tp_axis", None)
        if axis is not None and comm.size > 1:
            a = unshard(comm, a, axis, p.tp_parts)
        out[p.name] = numpy.array(backend.to_host(a))
    return out

