"""Lab 2, reference solution: data parallelism, naive, then bucketed with overlap, then weighted.

The model is hpcnn's (``hpcnn.nn.models.mlp``): ``model.params`` lists Parameters (``.data``,
``.grad``, ``.name``), ``model.blocks[i].params`` those of block i, and
``model.backward(1.0, caches, on_block_done=hook)`` calls ``hook(i)`` once block i's gradients
are complete, from the last block to the first.

Graded by ``python labs/02-data-parallel/grade.py labs/02-data-parallel/solution.py``.
"""
import numpy as np
from mpi4py import MPI


def allreduce_mean(comm, params):
    """Replace every parameter's gradient by its mean over the ranks: one ``Allreduce`` per
    parameter, in the order of ``params`` (the same on every rank)."""
    for p in params:
        g = p.grad
        comm.Allreduce(MPI.IN_PLACE, g)
        g /= comm.Get_size()


def naive_step(comm, model, x, y):
    """One data-parallel step's gradients: zero them, forward and backward this rank's shard
    (x, y), then :func:`allreduce_mean`. Returns this rank's loss."""
    model.zero_grad()
    loss, caches = model.forward(x, y)
    model.backward(1.0, caches, need_dx=False)
    allreduce_mean(comm, model.params)
    return loss


def make_buckets(sizes, cap):
    """Group parameters into buckets in the order the backward completes them: the last
    parameter first. ``sizes[j]`` is parameter j's number of elements. Walk j from the last to
    the first; add j to the current bucket if the bucket's total stays <= ``cap``, else start a
    new bucket with j (a parameter larger than ``cap`` is a bucket of its own). Returns a list of
    buckets, each a list of parameter indices in the order they were added."""
    buckets, total = [], 0
    for j in reversed(range(len(sizes))):
        if buckets and total + sizes[j] <= cap:
            buckets[-1].append(j)
            total += sizes[j]
        else:
            buckets.append([j])
            total = sizes[j]
    return buckets


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
        for k, bucket in enumerate(self.buckets):
            if self.ready_at[k] == i:
                flat = np.concatenate([self.params[j].grad.reshape(-1) for j in bucket])
                req = self.comm.Iallreduce(MPI.IN_PLACE, flat)
                self.in_flight.append((k, flat, req))

    def finish(self):
        """Wait for every bucket's allreduce, then write each gradient back, divided by p."""
        p = self.comm.Get_size()
        for k, flat, req in self.in_flight:
            req.Wait()
            offset = 0
            for j in self.buckets[k]:
                g = self.params[j].grad
                g[...] = flat[offset:offset + g.size].reshape(g.shape) / p
                offset += g.size
        self.in_flight = []


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
    total = comm.allreduce(n_local)
    for p in params:
        g = p.grad
        g *= n_local
        comm.Allreduce(MPI.IN_PLACE, g)
        g /= total
