"""Intra-node shared-memory allreduce (``algorithm="shm"``): direct loads and stores, no message.

When every rank of a communicator shares one node's memory, each rank owns a segment of a window
made by ``MPI.Win.Allocate_shared`` and reads its peers' segments directly (``Win.Shared_query``
gives NumPy views). A message is processed in pieces of at most ``comm.shm_piece_bytes``
(:data:`PIECE_BYTES`); for each piece, on p ranks:

1. copy-in: each rank copies its piece into its own segment;                               sync
2. reduce-scatter by direct reads: rank r sums slice r (of p; sizes differ by at most one
   element) of every rank's segment, in rank order (rank 0's first), into slice r of its own
   segment;                                                                                 sync
3. all-gather by direct reads: each rank copies slice q of segment q into its buffer, every q.

Each slice is summed by exactly one rank, in a fixed order, and copied by the others: every rank
ends with bitwise the same array. Segments hold two pieces used alternately (piece k uses half
k % 2, counting across calls), so a rank may copy piece k + 1 in while a slower one still reads
piece k: two syncs per piece, none at the end of a call. Traffic per rank for p = 2: reads 3n,
writes 2.5n, about what a ring over the library's shared-memory transport moves, without the
message protocol and its pipeline stalls.

Synchronisation follows the MPI-3 unified shared-memory model: the window stays in a
passive-target epoch (``Lock_all``) and a sync is ``Win.Sync`` (my stores are visible), a barrier
on the node communicator, ``Win.Sync`` (peers' stores are visible to my loads). The window is
allocated on first use, grown (collectively, the same size on every rank) when a larger piece
comes, and freed by :func:`hpcnn.parallel.allreduce.free`.

:class:`ShmRequest` (non-blocking): the same phases with ``Ibarrier``; the requests of a node run
one at a time in call order (a FIFO), and ``test()`` on any of them runs every phase whose barrier
has completed. The copies and sums are the caller's CPU time either way: what a request hides is
the wait for late peers, not the memory traffic. ``HPCNN_SHM=0`` disables shm (as on several
nodes).

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.comm import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.arange(5.0); c.allreduce(a, algorithm='shm'); print(a)"
"""
from __future__ import annotations

import os
import time
from collections import deque

import numpy

from hpcnn.parallel.comm import Request, _mpi
from hpcnn.parallel.ring import split, state

PIECE_BYTES = 8 << 20       # per piece; the window is 2 pieces per rank
MIN_HALF = 64 << 10         # smallest half-segment allocated


class Node:
    """The shared window of ``comm`` (an mpi4py communicator of ranks on one node) and the FIFO
    of its non-blocking requests."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.win, self.half, self.segs, self.parity = None, 0, [], 0
        self.queue = deque()

    def reserve(self, nbytes: int) -> None:
        """Make each half-segment at least ``nbytes`` (collective when it grows: every rank
        must pass the same ``nbytes``); earlier requests are completed first."""
        if nbytes <= self.half:
            return
        self.release()
        MPI = _mpi()
        half = max(MIN_HALF, 1 << (nbytes - 1).bit_length())
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")     # page-aligned segment per rank
        try:
            self.win = MPI.Win.Allocate_shared(2 * half, 1, info, self.comm)
        finally:
            info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.segs = [numpy.frombuffer(self.win.Shared_query(q)[0], numpy.uint8)
                     for q in range(self.size)]
        self.half = half

    def release(self) -> None:
        """Complete the queued requests and free the window (collective)."""
        self.drain()
        if self.win is not None:
            self.segs = []
            self.comm.Barrier()                             # nobody reads a segment any more
            self.win.Unlock_all()
            self.win.Free()
            self.win, self.half = None, 0

    def free(self) -> None:
        self.release()
        self.comm.Free()

    def views(self, dtype, m: int) -> list:
        """Every rank's next half-segment as ``m`` elements of ``dtype``."""
        off = self.parity * self.half
        self.parity ^= 1
        nb = m * numpy.dtype(dtype).itemsize
        return [g[off:off + nb].view(dtype) for g in self.segs]

    def sync(self) -> None:
        self.win.Sync()
        self.comm.Barrier()
        self.win.Sync()

    def advance(self, until=None) -> None:
        """Run queued requests in order: without blocking, or until ``until`` is done."""
        while self.queue:
            head = self.queue[0]
            if not head._run(block=until is not None):
                return
            self.queue.popleft()
            if head is until:
                return

    def drain(self) -> None:
        if self.queue:
            self.advance(until=self.queue[-1])


def node_of(comm):
    """The :class:`Node` of ``comm`` (a Communicator), or None if its ranks span several nodes
    or ``HPCNN_SHM=0`` (collective on first call: splits the private communicator)."""
    st = state(comm)
    if st.node is None:
        MPI = _mpi()
        st.node = False
        if os.environ.get("HPCNN_SHM", "1") not in ("0", "false", "no"):
            sc = st.pcomm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
            if sc.Get_size() == comm.size:
                st.node = Node(sc)
            else:
                sc.Free()
    return st.node or None


def _load(node, out):
    segs = node.views(out.dtype, out.size)
    numpy.copyto(segs[node.rank], out)
    return segs


def _reduce(node, segs, out) -> None:
    """Slice r of the sum, in rank order, into slice r of my segment (``out``, whose data is
    already in my segment, is the accumulator for p > 2)."""
    p, r = node.size, node.rank
    b = split(out.size, p)
    lo, hi = b[r], b[r + 1]
    if lo == hi:
        return
    v = [g[lo:hi] for g in segs]
    if p == 2:
        numpy.add(v[0], v[1], out=v[r])
        return
    acc = out[lo:hi]
    numpy.add(v[0], v[1], out=acc)
    for q in range(2, p - 1):
        numpy.add(acc, v[q], out=acc)
    numpy.add(acc, v[p - 1], out=v[r])      # v[r] is read already (or is v[p-1]: elementwise)


def _gather(node, segs, out) -> None:
    b = split(out.size, node.size)
    for q in range(node.size):
        numpy.copyto(out[b[q]:b[q + 1]], segs[q][b[q]:b[q + 1]])


def allreduce(node, flat, piece_bytes: int = PIECE_BYTES) -> None:
    """Sum the 1-d NumPy array ``flat`` over the node's ranks in place (blocking)."""
    node.drain()
    n, step = flat.size, max(1, piece_bytes // flat.itemsize)
    if n == 0:
        return
    node.reserve(min(n, step) * flat.itemsize)
    for a in range(0, n, step):
        out = flat[a:a + step]
        segs = _load(node, out)
        node.sync()
        _reduce(node, segs, out)
        node.sync()
        _gather(node, segs, out)


class ShmRequest(Request):
    """A non-blocking shm allreduce of ``flat`` (1-d NumPy) on ``node``; see the module doc.

    Seconds recorded in ``comm.stats`` on completion: the time spent running its phases (in any
    request's ``test()`` or ``wait()``), not the time it waited in the queue.
    """

    def __init__(self, comm, node, flat, piece_bytes: int = PIECE_BYTES, on_done=None):
        p = comm.size
        super().__init__([], comm.stats, "iallreduce", 2 * (p - 1) * flat.nbytes // p,
                         time.perf_counter(), on_done)
        self._node, self._flat = node, flat
        self._step = max(1, piece_bytes // flat.itemsize)
        self._a, self._phase, self._ib, self._segs, self._busy = 0, 0, None, None, 0.0
        if flat.size == 0:
            self._finish(0.0)
            return
        need = min(flat.size, self._step) * flat.itemsize
        if need > node.half:
            node.reserve(need)                          # completes the queue first
        node.queue.append(self)
        node.advance()                                  # copy the first piece in if at the head

    def _run(self, block: bool) -> bool:
        """Run phases until done (True), or until a barrier is pending and ``block`` is False."""
        t = time.perf_counter()
        node = self._node
        while self._a < self._flat.size:
            out = self._flat[self._a:self._a + self._step]
            if self._phase == 0:                        # copy in, then the first barrier
                self._segs = _load(node, out)
            else:
                if block:
                    self._ib.Wait()
                elif not self._ib.Test():
                    self._busy += time.perf_counter() - t
                    return False
                node.win.Sync()
                if self._phase == 1:
                    _reduce(node, self._segs, out)
                else:                                   # all-gather: this piece is done
                    _gather(node, self._segs, out)
                    self._a += out.size
                    self._phase = 0
                    continue
            node.win.Sync()
            self._ib = node.comm.Ibarrier()
            self._phase += 1
        self._segs = None
        self._busy += time.perf_counter() - t
        self._finish(self._busy)
        return True

    def test(self) -> bool:
        if not self.done:
            self._node.advance()
        return self.done

    def wait(self) -> None:
        if not self.done:
            self._node.advance(until=self)
