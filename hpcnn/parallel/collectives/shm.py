"""Intra-node shared-memory allreduce (``algorithm="shm"``): direct loads and stores, no message.

When every rank of a communicator shares one node's memory, each rank owns a segment of a window
made by ``MPI.Win.Allocate_shared`` and reads its peers' segments directly (``Win.Shared_query``
gives NumPy views). Slice q of a buffer: the q-th of p parts, sizes differing by at most one.

Private buffers (any NumPy array) go through the node's window in pieces of at most
``comm.shm_piece_bytes`` (:data:`PIECE_BYTES`). Each piece, on p > 2 ranks, rank r

1. copies the slices its peers will sum (all but slice r) into its segment;                sync
2. sums slice r of every peer's segment and of its own buffer, in rank order (rank 0's operand
   first), into slice r of its segment, and copies that into its buffer;                    sync
3. copies slice q of segment q into its buffer, every q != r

On 2 ranks each rank copies its whole piece in, syncs, and adds its peer's into its own buffer
(one sync; faster: docs/results/collectives.md). Segments hold two pieces used alternately, so no
sync ends a call. Zero copy: a buffer inside an array from :func:`zeros`
(``Communicator.shared_zeros``) of at least :data:`ZERO_COPY_BYTES` is summed in place, rank r
summing slice r of all ranks' arrays chunk by chunk (:data:`CHUNK_BYTES`) and pushing each summed
chunk to every peer: two syncs. Every rank ends with bitwise the same array, the sum in rank order.

Synchronisation follows the MPI-3 unified model: windows stay in a ``Lock_all`` epoch and a sync is
``Win.Sync``, a barrier on the node communicator, ``Win.Sync``. The node's window is made on first
use and grown collectively; windows are freed by :func:`.algorithms.free`, except those whose
arrays are still alive on some rank (kept, with a ``ResourceWarning``). An algorithm is a
generator yielding the window at each sync point: the blocking call syncs with ``Barrier``,
:class:`ShmRequest` with ``Ibarrier`` (a node's requests run in call order; ``test()`` runs every
phase whose barrier completed). ``HPCNN_SHM=0`` disables shm.
"""
from __future__ import annotations

import os
import time
import warnings
import weakref
from collections import deque

import numpy

from hpcnn.parallel.collectives.mpi_base import Request, _mpi
from hpcnn.parallel.collectives.ring import split
from hpcnn.parallel.collectives.watchdog import leave

PIECE_BYTES = 1 << 20       # per piece of a private buffer; the node's window is 2 pieces per rank
MIN_HALF = 64 << 10         # smallest half-segment allocated
CHUNK_BYTES = 256 << 10     # zero copy: summed and pushed chunk by chunk, cache-resident
ZERO_COPY_BYTES = 512 << 10  # smaller shared buffers take the private path (measured)


def _window(comm, nbytes):
    MPI = _mpi()
    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")         # a page-aligned segment per rank
    try:
        win = MPI.Win.Allocate_shared(nbytes, 1, info, comm)
    finally:
        info.Free()
    win.Lock_all(MPI.MODE_NOCHECK)
    return win, [numpy.frombuffer(win.Shared_query(q)[0], numpy.uint8)
                 for q in range(comm.Get_size())]


class Shared:
    """One :func:`zeros` allocation: a window, every rank's segment, a header per rank."""

    def __init__(self, comm, nbytes):
        self.nbytes = nbytes
        hdr = -(-nbytes // 64) * 64                     # headers after the data, 64-aligned
        self.win, segs = _window(comm, hdr + 64)
        self.segs = [g[:nbytes] for g in segs]
        self.hdrs = [g[hdr:hdr + 24].view(numpy.int64) for g in segs]
        self.base = self.segs[comm.Get_rank()].__array_interface__["data"][0]
        self.seq = 0
        self.user = None           # weakref to the array under every view handed out

    def in_use(self) -> bool:
        """True while an array handed out by :func:`zeros` (or any view of it) is alive."""
        return self.user is not None and self.user() is not None


class Node:
    """The shared memory of ``comm`` (an mpi4py communicator of ranks on one node): the window
    for private buffers, the :func:`zeros` allocations and the FIFO of requests."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.win, self.half, self.segs, self.parity = None, 0, [], 0
        self.shared, self.queue, self._scratch = [], deque(), {}

    def reserve(self, nbytes: int) -> None:
        """Half-segments of at least ``nbytes`` (collective when growing: the same ``nbytes``
        on every rank); queued requests are completed first."""
        if nbytes > self.half:
            self.release()
            half = max(MIN_HALF, 1 << (nbytes - 1).bit_length())
            self.win, self.segs = _window(self.comm, 2 * half)
            self.half = half

    def release(self) -> None:
        """Complete the queued requests and free the window (collective)."""
        self.drain()
        if self.win is not None:
            self.segs = []
            self.comm.Barrier()                         # nobody reads a segment any more
            self.win.Unlock_all()
            self.win.Free()
            self.win, self.half = None, 0

    def free(self) -> None:
        """Free the windows (collective). A :func:`zeros` allocation that some rank still uses
        (an array or view of it alive) is kept, with a warning: unmapping it would leave that
        array pointing at nothing."""
        self.release()
        MPI = _mpi()
        used = numpy.array([sh.in_use() for sh in self.shared] or [0], numpy.int8)
        self.comm.Allreduce(MPI.IN_PLACE, used, op=MPI.MAX)
        kept = [sh for sh, u in zip(self.shared, used) if u]
        for sh in self.shared:
            if sh not in kept:
                sh.win.Unlock_all()
                sh.win.Free()
        if kept:
            warnings.warn(f"shm: {len(kept)} shared array(s) ({sum(sh.nbytes for sh in kept)} "
                          f"bytes per rank) still in use at free(): kept until the process "
                          f"ends", ResourceWarning, stacklevel=3)
        self.shared = []
        self.comm.Free()

    def views(self, dtype, m: int) -> list:
        """Every rank's next half-segment as ``m`` elements of ``dtype``."""
        off = self.parity * self.half
        self.parity ^= 1
        nb = m * numpy.dtype(dtype).itemsize
        return [g[off:off + nb].view(dtype) for g in self.segs]

    def scratch(self, dtype, n):
        a = self._scratch.get(dtype)
        if a is None or a.size < n:
            a = self._scratch[dtype] = numpy.empty(n, dtype)
        return a[:n]

    def find(self, flat):
        """``(allocation, byte offset)`` if ``flat`` lies in one of my :func:`zeros` segments."""
        if self.shared:
            root = flat
            while isinstance(root.base, numpy.ndarray):
                root = root.base
            if root.base is None:                      # owns its memory: not a window's
                return None
            addr = flat.__array_interface__["data"][0]
            for sh in self.shared:
                if sh.base <= addr and addr + flat.nbytes <= sh.base + sh.nbytes:
                    return sh, addr - sh.base
        return None

    def run(self, phases) -> None:
        """Run an algorithm (a generator of windows to sync) with blocking syncs."""
        self.drain()
        for win in phases:
            win.Sync()
            self.comm.Barrier()
            win.Sync()

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
    (emulated ones too: :mod:`.topology`) or ``HPCNN_SHM=0`` (collective on first call: splits
    the private communicator)."""
    from hpcnn.parallel.collectives.topology import split_node
    st = comm.collectives.get_workspace()
    if st.node is None:
        st.node = False
        if os.environ.get("HPCNN_SHM", "1") not in ("0", "false", "no"):
            sc = split_node(st.pcomm, key=comm.rank)
            if sc.Get_size() == comm.size:
                st.node = Node(sc)
            else:
                sc.Free()
    return st.node or None


def zeros(node, shape, dtype):
    """A zero-filled array in shared memory (collective: the same shape and dtype everywhere);
    :func:`allreduce` on it or on a view of it copies nothing in."""
    dtype = numpy.dtype(dtype)
    n = int(numpy.prod(shape, dtype=numpy.int64))
    sh = Shared(node.comm, max(1, n * dtype.itemsize))
    node.shared.append(sh)
    owner = numpy.frombuffer(sh.win.Shared_query(node.rank)[0], numpy.uint8)  # base of all views
    sh.user = weakref.ref(owner)
    a = owner[:n * dtype.itemsize].view(dtype).reshape(shape)
    a[...] = 0
    return a


def _private(node, flat, step):
    """Private buffer, in pieces of ``step`` elements through the node's window."""
    p, r = node.size, node.rank
    for a in range(0, flat.size, step):
        out = flat[a:a + step]
        segs = node.views(out.dtype, out.size)
        if p == 2:                                     # whole piece in, both sum it: one sync
            numpy.copyto(segs[r], out)
            yield node.win
            numpy.add(*((out, segs[1]) if r == 0 else (segs[0], out)), out=out)
            continue
        b = split(out.size, p)
        mine, lo, hi = segs[r], b[r], b[r + 1]
        numpy.copyto(mine[:lo], out[:lo])              # the slices my peers sum
        numpy.copyto(mine[hi:], out[hi:])
        yield node.win
        if hi > lo:
            v = [g[lo:hi] for g in segs]
            acc, v[r] = v[r], out[lo:hi]               # my operand straight from my buffer
            numpy.add(v[0], v[1], out=acc)
            for q in range(2, p):
                numpy.add(acc, v[q], out=acc)
            numpy.copyto(v[r], acc)
        yield node.win
        for q in range(p):
            if q != r:
                numpy.copyto(out[b[q]:b[q + 1]], segs[q][b[q]:b[q + 1]])


def _zero_copy(node, sh, off, flat):
    """A buffer at byte ``off`` of every rank's segment of allocation ``sh``, in place."""
    p, r = node.size, node.rank
    sh.seq += 1
    me = numpy.array([sh.seq, off, flat.nbytes], numpy.int64)
    sh.hdrs[r][:] = me
    yield sh.win
    for q in range(p):
        if not numpy.array_equal(sh.hdrs[q], me):
            raise ValueError(f"shm zero copy: rank {r} reduces bytes [{off}, {off + flat.nbytes})"
                             f" of its shared array (call {sh.seq}), rank {q} "
                             f"[{sh.hdrs[q][1]}, {sh.hdrs[q][1] + sh.hdrs[q][2]}) (call "
                             f"{sh.hdrs[q][0]}): every rank must pass the same region")
    v = [g[off:off + flat.nbytes].view(flat.dtype) for g in sh.segs]
    b = split(flat.size, p)
    step = max(1, CHUNK_BYTES // flat.itemsize)
    for a in range(b[r], b[r + 1], step):             # slice r, chunk by chunk
        c = [x[a:min(a + step, b[r + 1])] for x in v]
        if p == 2:
            numpy.add(c[0], c[1], out=c[r])
        else:
            acc = node.scratch(flat.dtype, c[0].size)
            numpy.add(c[0], c[1], out=acc)
            for q in range(2, p - 1):
                numpy.add(acc, c[q], out=acc)
            numpy.add(acc, c[p - 1], out=c[r])         # c[r] is read already, or is c[p-1]
        for q in range(p):                             # pushed while the sum is in cache
            if q != r:
                numpy.copyto(c[q], c[r])
    yield sh.win                                       # every slice is in every array


def _phases(node, flat, piece_bytes):
    """The algorithm for ``flat`` (zero copy if it is shared) and its number of syncs; grows the
    node's window first if needed (collective)."""
    found = node.find(flat) if flat.nbytes >= ZERO_COPY_BYTES else None
    if found is not None:
        return _zero_copy(node, found[0], found[1], flat), 2
    step = max(1, piece_bytes // flat.itemsize)
    node.reserve(min(flat.size, step) * flat.itemsize)
    return _private(node, flat, step), (1 if node.size == 2 else 2) * -(-flat.size // step)


def allreduce(node, flat, piece_bytes: int = PIECE_BYTES) -> None:
    """Sum the 1-d NumPy array ``flat`` over the node's ranks in place (blocking)."""
    if flat.size:
        node.run(_phases(node, flat, piece_bytes)[0])


class ShmRequest(Request):
    """A non-blocking shm allreduce of ``flat`` (1-d NumPy) on ``node``; see the module doc.

    Seconds recorded in ``comm.stats`` on completion: the time spent running its phases (in any
    request's ``test()`` or ``wait()``), not the time it waited in the queue.
    """

    def __init__(self, comm, node, flat, piece_bytes: int = PIECE_BYTES, on_done=None):
        p = comm.size
        super().__init__([], comm.stats, "iallreduce", 2 * (p - 1) * flat.nbytes // p,
                         time.perf_counter(), on_done)
        self.where = comm.name
        self._node, self._ib, self._win, self._busy, self._done_syncs = node, None, None, 0.0, 0
        if flat.size == 0:
            self._nsyncs = 0
            self._finish(0.0)
            return
        self._gen, self._nsyncs = _phases(node, flat, piece_bytes)   # may grow the window
        node.queue.append(self)
        node.advance()                                  # runs the first phase if at the head

    @property
    def progress(self) -> float:
        """Fraction of the syncs passed (1.0 when done)."""
        return 1.0 if self.done else self._done_syncs / self._nsyncs

    def _run(self, block: bool) -> bool:
        """Run phases until done (True), or until a barrier is pending and ``block`` is False."""
        t = time.perf_counter()
        try:
            while True:
                if self._ib is not None:
                    if block:
                        self._ib.Wait()
                    elif not self._ib.Test():
                        return False
                    self._ib = None
                    self._win.Sync()
                    self._done_syncs += 1
                win = next(self._gen, None)
                if win is None:
                    self._gen = None
                    self._busy += time.perf_counter() - t
                    self._finish(self._busy)
                    return True
                win.Sync()
                self._win, self._ib = win, self._node.comm.Ibarrier()
        finally:
            if not self.done:
                self._busy += time.perf_counter() - t

    def test(self) -> bool:
        if not self.done:
            self._node.advance()
        return self.done

    def wait(self) -> None:
        if not self.done:
            prev = self._enter_wait()
            try:
                self._node.advance(until=self)
            finally:
                leave(prev)
