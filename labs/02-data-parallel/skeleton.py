"""Lab 2: data parallelism, naive, then bucketed with overlap, then weighted.

The model is hpcnn's (``hpcnn.nn.models.mlp``): ``model.params`` lists Parameters (``.data``,
``.grad``, ``.name``), ``model.blocks[i].params`` those of block i, and
``model.backward(1.0, caches, on_block_done=hook)`` calls ``hook(i)`` once block i's gradients
are complete, from the last block to the first.

Copy this file to student.py in this folder, write the functions that raise
NotImplementedError, then grade it: ``make lab N=2`` (or ``python labs/02-data-parallel/grade.py``).
``comm`` is an mpi4py communicator: use its buffer methods (``comm.Allreduce(MPI.IN_PLACE, a)``,
``comm.Iallreduce``), and ``comm.allreduce`` for a Python number.
"""
import numpy as np
from mpi4py import MPI


def allreduce_mean(comm, params):
    """Replace every parameter's gradient by its mean over the ranks: one ``Allreduce`` per
    parameter, in the order of ``params`` (the same on every rank)."""
    raise NotImplementedError


def naive_step(comm, model, x, y):
    """One data-parallel step's gradients: zero them, forward and backward this rank's shard
    (x, y), then :func:`allreduce_mean`. Returns this rank's loss."""
    raise NotImplementedError


def make_buckets(sizes, cap):
    """Group parameters into buckets in the order the backward completes them: the last
    parameter first. ``sizes[j]`` is parameter j's number of elements. Walk j from the last to
    the first; add j to the current bucket if the bucket's total stays <= ``cap``, else start a
    new bucket with j (a parameter larger than ``cap`` is a bucket of its own). Returns a list of
    buckets, each a list of parameter indices in the order they were added."""
    raise NotImplementedError


class BucketedAllreduce:
    """Gradient buckets whose allreduce starts during the backward, as soon as they are complete.

    Use: ``model.backward(1.0, caches, on_block_done=engine.on_block_done)``, then
    ``engine.finish()``; afterwards every gradient holds its mean over the ranks.
    """

    def __init__(self, comm, model, cap):
        self.comm, self.params = comm, model.params
        self.buckets = make_buckets([p.data.size for p in self.params], cap)
        block_of = {id(p): i for i, b in enumerate(model.blocks) for p in b.params}
        # bucket k is complete once the block of its earliest parameter is done
        self.ready_at = [min(block_of[id(self.params[j])] for j in b) for b in self.buckets]
        self.in_flight = []                  # (bucket index, flat buffer, request)

    def on_block_done(self, i):
        """Block i's gradients are complete: for each bucket that became complete with it, copy
        its gradients into one flat buffer and start ``comm.Iallreduce`` on it (in place)."""
        raise NotImplementedError

    def finish(self):
        """Wait for every bucket's allreduce, then write each gradient back, divided by p."""
        raise NotImplementedError


def bucketed_step(comm, model, x, y, engine):
    """:func:`naive_step` with the bucketed engine: the allreduces overlap the backward."""
    model.zero_grad()
    loss, caches = model.forward(x, y)
    model.backward(1.0, caches, need_dx=False, on_block_done=engine.on_block_done)
    engine.finish()
    return loss


def weighted_mean(comm, params, n_local):
    """Each rank's gradients are the mean over its own ``n_local`` samples (the shares differ).
    Replace them by the mean over all samples of all ranks: sum_i n_i g_i / sum_i n_i."""
    raise NotImplementedError
