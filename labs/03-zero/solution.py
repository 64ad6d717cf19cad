"""Lab 3, reference solution: ZeRO-1's sharded optimizer step, then ZeRO-2's reduce-scatter.

The parameters are one flat float64 vector of n elements, replicated on every rank; each rank
computes its own gradient of the same length (its shard of the batch). Adam's two moments are
the optimizer state that ZeRO shards.

Graded by ``python labs/03-zero/grade.py labs/03-zero/solution.py``.
"""
import numpy as np
from mpi4py import MPI


def adam_update(param, grad, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-8):
    """Adam (Kingma and Ba 2015), in place on ``param``, ``m`` and ``v`` (same shape as
    ``grad``); ``t`` counts the steps from 1. Given: nothing to write here."""
    m *= b1
    m += (1 - b1) * grad
    v *= b2
    v += (1 - b2) * grad * grad
    param -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


def shard_range(n, p, r):
    """The part [lo, hi) of n elements that rank r of p owns: contiguous parts in rank order,
    the first n % p ranks one element longer."""
    q, extra = divmod(n, p)
    lo = r * q + min(r, extra)
    return lo, lo + q + (r < extra)


class Zero1:
    """ZeRO-1: every rank keeps Adam's moments for its own part of the parameters only."""

    def __init__(self, comm, n):
        self.comm, self.n = comm, n
        p, r = comm.Get_size(), comm.Get_rank()
        self.lo, self.hi = shard_range(n, p, r)
        self.counts = [shard_range(n, p, k)[1] - shard_range(n, p, k)[0] for k in range(p)]
        self.m = np.zeros(self.hi - self.lo)      # this rank's part of the state only
        self.v = np.zeros(self.hi - self.lo)
        self.t = 0

    def gather(self, params):
        """Every rank's updated part of ``params`` to every rank (``Allgatherv`` in place)."""
        displs = [sum(self.counts[:k]) for k in range(len(self.counts))]
        self.comm.Allgatherv(MPI.IN_PLACE, [params, self.counts, displs, MPI.DOUBLE])

    def step(self, params, grads, lr):
        """One step: the mean gradient over the ranks (``Allreduce`` of ``grads`` in place, then
        divided by p), Adam on this rank's part of ``params`` with its part of the state, then
        :meth:`gather`. Afterwards every rank holds the same, fully updated ``params``."""
        self.comm.Allreduce(MPI.IN_PLACE, grads)
        grads /= self.comm.Get_size()
        self.t += 1
        lo, hi = self.lo, self.hi
        adam_update(params[lo:hi], grads[lo:hi], self.m, self.v, self.t, lr)
        self.gather(params)


class Zero2(Zero1):
    """ZeRO-2: the gradient is reduce-scattered, so each rank receives only the part it updates."""

    def step(self, params, grads, lr):
        """As :meth:`Zero1.step`, but ``comm.Reduce_scatter(grads, part, recvcounts=...)``
        gives this rank the sum of its part alone (no full allreduce); divide it by p."""
        part = np.empty(self.hi - self.lo)
        self.comm.Reduce_scatter(grads, part, recvcounts=self.counts, op=MPI.SUM)
        part /= self.comm.Get_size()
        self.t += 1
        adam_update(params[self.lo:self.hi], part, self.m, self.v, self.t, lr)
        self.gather(params)
