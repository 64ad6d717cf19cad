"""Data parallelism in its plainest form: a full backward, then one allreduce per gradient.

This is the reading twin of :class:`hpcnn.parallel.data.bucketed.DataParallel`; it computes the same
summed gradient G = Σ_i c_i g_i (rank i scales its backward by ``dloss = c_i``, see
:func:`hpcnn.parallel.data.bucketed.dloss_for`), so the two engines agree to rounding, and the tests check
that they do. Read this class first, then the bucketed one.

One step on every rank::

    model.zero_grad()
    loss, caches = model.forward(x_i, y_i)        # this rank's share of the global batch
    dp.backward(dloss_for("weighted", b_i, shares), caches)
    opt.step(lr)                                  # every replica applies the same G

What :class:`~hpcnn.parallel.data.bucketed.DataParallel` adds on top, and why:

- **buckets**: here each parameter is one collective, so a model with hundreds of small tensors
  pays hundreds of latencies. The bucketed engine lays all gradients out in one flat buffer and
  reduces byte ranges of a fixed size (``bucket_mb``): a few large messages near full bandwidth.
- **overlap**: here communication starts only after the whole backward. The bucketed engine
  starts a bucket's non-blocking allreduce as soon as the blocks that write it are done (the
  chain's ``on_block_done`` hook), so the last layers' gradients travel while the first layers
  still compute.
- **shared windows**: on one node the flat buffer lives in an MPI shared-memory window, which
  the ``shm`` allreduce sums in place from the peers' memory without copying it in.
- **a one-pass finiteness check** (the sum of squares riding in a sentinel element) and
  gradient accumulation with one reduction per step, however many micro-batches.
"""
from __future__ import annotations


class NaiveDataParallel:
    """Replicated ``model`` on every rank of ``comm`` (a
    :class:`~hpcnn.parallel.collectives.Communicator`); gradients summed one parameter at a time
    after the backward.

    ``backward(dloss, caches, sync)`` runs the model's whole backward scaled by ``dloss``; with
    ``sync=True`` (the last micro-batch of a step) it then sums every parameter's gradient over
    the ranks. ``sync=False`` only accumulates locally.
    """

    def __init__(self, model, comm):
        self.model, self.comm = model, comm
        # a parameter shared by two blocks (tied weights) is listed once: reduced once
        self.params = list({id(p): p for p in model.params}.values())

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def backward(self, dloss, caches, sync: bool = True) -> None:
        """Local backward (gradients accumulate), then, if ``sync``, the allreduces."""
        self.model.backward(dloss, caches, need_dx=False)
        if sync:
            self.allreduce_gradients()

    def allreduce_gradients(self) -> None:
        """grad <- Σ_ranks grad for each parameter, in the same order on every rank.

        Reading ``p.grad`` materialises a gradient that no block wrote this step as zeros, so a
        rank whose data never touched a parameter still sends its (zero) contribution."""
        for p in self.params:
            self.comm.allreduce(p.grad)

    def __repr__(self) -> str:
        return (f"NaiveDataParallel({self.model.name}, {self.comm.size} ranks, "
                f"{len(self.params)} allreduces per step)")
