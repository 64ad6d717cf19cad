"""Two-level collectives over the nodes of a communicator (``algorithm="hier"``).

When a communicator's P ranks sit on N > 1 nodes of q > 1 ranks each (real nodes, or the
emulated ones of :mod:`.topology`), the allreduce is done in three steps (as NCCL's and
Horovod's hierarchical allreduce do):

1. inside each node, a reduce-scatter (``MPI_Reduce_scatter`` on the node's communicator): local
   rank l gets slice l (of q, sizes differing by at most one) of its node's sum;
2. across nodes, an allreduce of slice l among the ranks of local rank l (one per node, the
   "rail"), by hpcnn's segmented ring (:mod:`.ring`): every rail rank ends with the same bits;
3. inside each node, an all-gather of the slices (``MPI_Allgatherv``).

The inter-node links carry 2 (N - 1)/N of the bytes of one slice per rank, 1/q of a flat
allreduce's; each element is summed once per node, then once across nodes, so every rank ends
with bitwise the same array (the sum's order differs from the library's: results agree with
``mpi`` to rounding). :class:`HierRequest` is the non-blocking form, a state machine whose
``test()`` advances as far as its current step allows (the backward's buckets call it after
every block), like the ring's. Where the nodes differ in size, or there is one node, or one
rank a node, ``hier`` is the library's Allreduce.

    HPCNN_NODES=2 mpiexec -n 4 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.collectives import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.arange(6.0) * (c.rank + 1); c.allreduce(a, algorithm='hier'); print(a)"
"""
from __future__ import annotations

import time
from collections import deque

import numpy

from hpcnn.parallel.collectives.mpi_base import Request, _mpi
from hpcnn.parallel.collectives.ring import RingRequest, flat_view, split


class Levels:
    """A communicator's two levels: ``node`` (mpi4py, this rank's node) and ``gather`` (a
    duplicate of it: the all-gathers of step 3 start later than the reduce-scatters of step 1
    of requests made after them, and collectives on one communicator must start in the same
    order on every rank), ``rail`` (a Communicator of the ranks of this local rank on every
    node), ``q`` ranks a node, and the :class:`HierRequest` s in flight, in call order
    (``queue``)."""

    def __init__(self, node, rail, q: int):
        self.node, self.gather, self.rail, self.q = node, node.Dup(), rail, q
        self.queue: deque = deque()

    def advance(self, until=None) -> None:
        """Advance the requests in flight in call order, each no further than the one before
        it (so every rank starts each step's collectives in the same order, whatever order
        its requests are tested in); without blocking, or until ``until`` is done."""
        ahead = 3
        for req in list(self.queue):
            req._advance(block=until is not None, limit=ahead)
            ahead = req._step
            if req is until:
                break
        while self.queue and self.queue[0]._step == 3:
            self.queue.popleft()

    def free(self) -> None:
        if self.queue:
            self.advance(until=self.queue[-1])
        self.rail.free()
        self.gather.Free()
        self.node.Free()


def levels_of(comm) -> Levels | None:
    """The :class:`Levels` of ``comm`` (a Communicator), or None where the two-level form does
    not apply (one node, one rank a node, nodes of different sizes). Collective on first call;
    kept in the communicator's workspace, freed with it."""
    ws = comm.collectives.get_workspace()
    if ws.levels is None:
        from hpcnn.parallel.collectives.topology import split_node
        ws.levels = False
        node = split_node(ws.pcomm, key=comm.rank)
        q = node.Get_size()
        sizes = set(ws.pcomm.allgather(q))
        if len(sizes) == 1 and 1 < q < comm.size:
            rail = ws.pcomm.Split(color=node.Get_rank(), key=comm.rank)
            # (the rail a Communicator of comm's own class: its ring, its counters)
            ws.levels = Levels(node, type(comm)(rail, name=f"{comm.name}.rail"), q)
        else:
            node.Free()
    return ws.levels or None


class HierRequest(Request):
    """The two-level allreduce of ``buf`` in place (module docstring), as a state machine:
    the node's ``Ireduce_scatter``, then the rail's ring (:class:`~.ring.RingRequest`), then the
    node's ``Iallgatherv``. ``test()`` completes what it can without blocking; ``wait()`` runs
    it to the end."""

    def __init__(self, comm, levels: Levels, buf, on_done=None):
        flat = self._buf = flat_view(buf)
        q = levels.q
        super().__init__([], comm.stats, "iallreduce", 2 * (comm.size - 1) * flat.nbytes
                         // comm.size, time.perf_counter(), on_done)
        self.where, self._lv = comm.name, levels
        cut = split(flat.size, q)
        self._counts = [cut[i + 1] - cut[i] for i in range(q)]
        self._displs = cut[:-1]
        lr = levels.node.Get_rank()
        self._part = numpy.empty(self._counts[lr], flat.dtype)
        MPI = _mpi()
        self._step, self._busy = 0, 0.0
        self._req = levels.node.Ireduce_scatter(flat, self._part, self._counts, op=MPI.SUM)
        levels.queue.append(self)

    def _advance(self, block: bool, limit: int) -> None:
        """Go through the steps whose requests are complete (all of them when ``block``),
        starting step k's collective only where the request before it has (``limit`` >= k)."""
        while self._step < 3:
            if self._step < 2 and self._step + 1 > limit:
                return                     # the request before it has not started that step
            if block:
                self._req.wait() if self._step == 1 else self._req.Wait()
            elif not (self._req.test() if self._step == 1 else self._req.Test()):
                return
            self._step += 1
            if self._step == 1:            # the node's slice summed: across the nodes
                self._req = RingRequest(self._lv.rail, self._part, blocking=block)
            elif self._step == 2:          # every node's sum of my slice: to my node's ranks
                self._req = self._lv.gather.Iallgatherv(
                    self._part, [self._buf, (self._counts, self._displs)])

    def test(self) -> bool:
        if not self.done:
            t = time.perf_counter()
            self._lv.advance()
            self._busy += time.perf_counter() - t
            if self._step == 3:
                self._finish(self._busy)
        return self.done

    def wait(self) -> None:
        if not self.done:
            prev = self._enter_wait()
            t = time.perf_counter()
            try:
                self._lv.advance(until=self)
            finally:
                from hpcnn.parallel.collectives.watchdog import leave
                leave(prev)
            self._finish(self._busy + time.perf_counter() - t)


def allreduce(comm, levels: Levels, buf) -> None:
    """The blocking two-level allreduce of ``buf`` (a host array) in place."""
    HierRequest(comm, levels, buf).wait()
