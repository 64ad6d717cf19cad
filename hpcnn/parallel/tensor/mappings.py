"""Conjugate collectives of operator (tensor) parallelism, each documented in both directions.

A tensor-parallel block computes on shards and joins them with a collective; the backward of a
collective is its conjugate (Shoeybi et al. 2019, Megatron-LM, arXiv:1909.08053, Sec. 3, the
``f``/``g`` operators; Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2, ``g``/``ḡ`` of
sequence parallelism)::

    op                 forward                          backward
    Copy               identity                         allreduce (sum of partial dx)
    Reduce             allreduce (sum of partial y)     identity
    GatherLast         all-gather along the last dim    split: keep this rank's part
    SplitLast          split: keep this rank's part     all-gather along the last dim
    AllGatherSeq       all-gather along T (dim 1)       reduce-scatter along T
    ReduceScatterSeq   reduce-scatter along T (dim 1)   all-gather along T

Each op has the block interface (``y, cache = op.forward(x)``, ``dx = op.backward(dy, cache)``),
keeps nothing for its backward (cache None) and is the identity on a communicator of size 1. They
call the named methods of :class:`~hpcnn.parallel.collectives.Communicator` along axis 0 (the
communicated axis moved first, then back); :func:`allreduce_max` adds the element-wise maximum of
the vocabulary-parallel softmax, counted like the others. ``op.volume(nbytes)`` is what one
forward+backward hands to the collectives, a :class:`Volume` whose :meth:`Volume.sent` applies
the counting convention of :mod:`~hpcnn.parallel.collectives.comm`, so a block's
``spec().comm_bytes`` equals what the stats count.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; \\
        from hpcnn.parallel.collectives import world; from hpcnn.parallel.tensor.mappings import \\
        AllGatherSeq; c = world(); y, _ = AllGatherSeq(c).forward( \\
        np.full((1, 2, 3), c.rank, float)); print(y[0, :, 0], c.stats.bytes_sent)"
"""
from __future__ import annotations

from dataclasses import dataclass

from hpcnn import backend


@dataclass(frozen=True)
class Volume:
    """Raw bytes handed to collectives in one forward+backward (sizes of the full tensors).

    ``allreduce`` and ``allreduce_max``: summed buffer sizes; ``gather``: the full size of each
    all-gather or reduce-scatter call, in order.
    """

    allreduce: int = 0
    allreduce_max: int = 0
    gather: tuple = ()

    def __add__(self, other: "Volume") -> "Volume":
        return Volume(self.allreduce + other.allreduce, self.allreduce_max + other.allreduce_max,
                      self.gather + other.gather)

    def sent(self, p: int) -> int:
        """Bytes one rank of ``p`` sends, under the convention of
        :mod:`~hpcnn.parallel.collectives.comm`."""
        return (2 * (p - 1) * self.allreduce // p + 2 * (p - 1) * self.allreduce_max // p
                + sum((p - 1) * int(n) // p for n in self.gather))


def check_divides(what: str, n: int, p: int) -> int:
    """n // p, or ValueError naming ``what`` and both numbers when p does not divide n."""
    if n % p:
        raise ValueError(f"{what} ({n}) is not divisible by tp ({p})")
    return n // p


def allreduce_max(comm, buf):
    """Element-wise maximum of ``buf`` over the ranks of ``comm``, in place; returns ``buf``
    (:meth:`~hpcnn.parallel.collectives.Communicator.allreduce_max`, counted as an allreduce)."""
    return comm.allreduce_max(buf)


# -- the three data movements, along any axis -----------------------------------------------------
def all_gather(comm, x, axis: int):
    """Concatenate every rank's ``x`` along ``axis``, in rank order (x's axis grows p times)."""
    xp = backend.xp
    xt = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))            # (n, ...) axis first
    out = xp.empty((xt.shape[0] * comm.size,) + xt.shape[1:], dtype=x.dtype)   # (p n, ...)
    comm.allgather(xt, out)
    return xp.ascontiguousarray(xp.moveaxis(out, 0, axis))


def reduce_scatter(comm, x, axis: int):
    """Sum ``x`` over the ranks and keep this rank's 1/p part along ``axis``."""
    xp = backend.xp
    n = check_divides(f"reduce-scatter: size of dimension {axis % x.ndim} in {tuple(x.shape)}",
                      x.shape[axis], comm.size)
    xt = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))            # (p n, ...) axis first
    out = xp.empty((n,) + xt.shape[1:], dtype=x.dtype)            # (n, ...)
    comm.reduce_scatter(xt, out)
    return xp.ascontiguousarray(xp.moveaxis(out, 0, axis))


def split(comm, x, axis: int):
    """This rank's 1/p part of ``x`` along ``axis`` (a contiguous copy; no communication)."""
    n = check_divides(f"split: size of dimension {axis % x.ndim} in {tuple(x.shape)}",
                      x.shape[axis], comm.size)
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(comm.rank * n, (comm.rank + 1) * n)
    return backend.xp.ascontiguousarray(x[tuple(idx)])


def _reduce_inplace(comm, x):
    if not x.flags.c_contiguous:
        x = backend.xp.ascontiguousarray(x)
    return comm.allreduce(x)


# -- conjugate pairs ------------------------------------------------------------------------------
class _Conjugate:
    """Base: holds the Communicator; ``active`` is False on one rank (then forward/backward are
    the identity)."""

    def __init__(self, comm):
        self.comm = comm
        self.active = comm.size > 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tp={self.comm.size})"


class Copy(_Conjugate):
    """Enter a tensor-parallel region with a replicated input (Megatron's ``f``).

    forward: y = x (every rank holds the full x). backward: dx = sum over ranks of dy, the partial
    input gradients of the shards; ``dy`` is reduced in place (pass a spent array you own).
    """

    def forward(self, x):
        return x, None                                   # (..., C) replicated

    def backward(self, dy, cache):
        return _reduce_inplace(self.comm, dy) if self.active else dy   # (..., C) summed

    def volume(self, nbytes: int) -> Volume:
        return Volume(allreduce=nbytes) if self.active else Volume()


class Reduce(_Conjugate):
    """Leave a tensor-parallel region whose output is a partial sum (Megatron's ``g``).

    forward: y = sum over ranks of x, reduced in place (pass a fresh array you own).
    backward: dx = dy (each rank's partial output had the same gradient).
    """

    def forward(self, x):
        return (_reduce_inplace(self.comm, x) if self.active else x), None   # (..., C) summed

    def backward(self, dy, cache):
        return dy

    def volume(self, nbytes: int) -> Volume:
        return Volume(allreduce=nbytes) if self.active else Volume()


class GatherLast(_Conjugate):
    """forward: (..., C/tp) -> (..., C), all-gather along the last dimension, rank order.
    backward: (..., C) -> (..., C/tp), this rank's part of dy (the other parts belong to the
    other ranks' shards). ``volume`` takes the gathered (full) size."""

    def forward(self, x):
        return (all_gather(self.comm, x, -1) if self.active else x), None   # (..., C)

    def backward(self, dy, cache):
        return split(self.comm, dy, -1) if self.active else dy              # (..., C/tp)

    def volume(self, nbytes: int) -> Volume:
        return Volume(gather=(nbytes,)) if self.active else Volume()


class SplitLast(_Conjugate):
    """forward: (..., C) -> (..., C/tp), keep this rank's part of a replicated x.
    backward: (..., C/tp) -> (..., C), all-gather of every rank's dy part."""

    def forward(self, x):
        return (split(self.comm, x, -1) if self.active else x), None        # (..., C/tp)

    def backward(self, dy, cache):
        return all_gather(self.comm, dy, -1) if self.active else dy         # (..., C)

    def volume(self, nbytes: int) -> Volume:
        return Volume(gather=(nbytes,)) if self.active else Volume()


class AllGatherSeq(_Conjugate):
    """Leave a sequence-parallel region into a tensor-parallel one (Korthikanti's ``g``).

    forward: (B, T/tp, C) -> (B, T, C), all-gather along the sequence, rank order.
    backward: (B, T, C) -> (B, T/tp, C), reduce-scatter of the partial dy (summed over the ranks,
    this rank keeps its T/tp rows). ``volume`` takes the full (B, T, C) size: both directions.
    """

    def forward(self, x):
        return (all_gather(self.comm, x, 1) if self.active else x), None    # (B, T, C)

    def backward(self, dy, cache):
        return reduce_scatter(self.comm, dy, 1) if self.active else dy      # (B, T/tp, C)

    def volume(self, nbytes: int) -> Volume:
        return Volume(gather=(nbytes, nbytes)) if self.active else Volume()


class ReduceScatterSeq(_Conjugate):
    """Leave a tensor-parallel region into a sequence-parallel one (Korthikanti's ``ḡ``).

    forward: (B, T, C) partial sums -> (B, T/tp, C), reduce-scatter along the sequence.
    backward: (B, T/tp, C) -> (B, T, C), all-gather of dy (every rank's partial output had the
    full gradient). ``volume`` takes the full (B, T, C) size: both directions.
    """

    def forward(self, x):
        return (reduce_scatter(self.comm, x, 1) if self.active else x), None   # (B, T/tp, C)

    def backward(self, dy, cache):
        return all_gather(self.comm, dy, 1) if self.active else dy            # (B, T, C)

    def volume(self, nbytes: int) -> Volume:
        return Volume(gather=(nbytes, nbytes)) if self.active else Volume()
