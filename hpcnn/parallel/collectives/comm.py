"""Named collectives over one MPI communicator, counting bytes and seconds per call.

Every parallel layer calls these, never MPI directly. Each wrapper uses the uppercase buffer
methods on arrays (no pickling), is a no-op (or a local copy) on a communicator of size 1, and on
CuPy synchronises the stream first; when the MPI library is not CUDA-aware
(``HPCNN_CUDA_AWARE`` unset) device arrays are staged through host memory.

Byte counts are what this rank sends under a bandwidth-optimal algorithm, so that they can be
compared with a cost model whatever algorithm the library picks: for ``n`` bytes on ``p`` ranks,
allreduce 2(p-1)/p n (floored on the total of a communicator's calls, not per call),
reduce-scatter and all-gather (p-1)/p n (n = the full, unscattered size), broadcast n on the
root, point-to-point the message size. Counters live in a :class:`CommStats` shared by all the
communicators of a process, read into the run log's ``/ranks`` table.

``allreduce`` of a NumPy buffer by the library (``mpi``, or ``auto`` where it picks ``mpi``)
takes a lean path: the optional C module (:mod:`.lean_build`) when built, a counted in-place
``MPI_Allreduce`` that skips mpi4py's argument parsing; else a Python closure (timings:
docs/results/collectives.md). That path, the algorithms'
thresholds and resources live in ``comm.collectives`` (:class:`~.state.Collectives`). Counters
and the sampling of small calls' seconds: :mod:`.stats`.

The ``bare_*`` methods make the library's call alone (not counted, not recorded): what the
machine-file calibration (:mod:`hpcnn.plan.calibrate`) times.

Small picklable objects (metadata, error messages) travel by :meth:`Communicator.allgather_objects`,
:meth:`Communicator.gather_objects` and :meth:`Communicator.bcast_object`. A serial run uses
:meth:`Communicator.single` (a :class:`SelfCommunicator`): the same methods on one rank, without
MPI.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.collectives import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.ones(4); c.allreduce(a); print(a, c.stats.bytes_sent)"
"""
from __future__ import annotations

import pickle
import time
from collections import deque

import numpy

from hpcnn import backend
from hpcnn.parallel.collectives import algorithms      # the algorithms behind allreduce(...)
from hpcnn.parallel.collectives.mpi_base import (Request, _cuda_aware, _mpi, device_view,
                                                 host_buffers, host_side, mpi_buffers, staged)
from hpcnn.parallel.collectives.objects import ObjectCalls
from hpcnn.parallel.collectives.state import Collectives
from hpcnn.parallel.collectives.stats import CommStats
from hpcnn.parallel.collectives.watchdog import SKIP, enter, leave, recorded_allreduce, started

_perf = time.perf_counter
_ndarray = numpy.ndarray


def library_version() -> str:
    """The first line of the MPI library's version string (what the run log records)."""
    return _mpi().Get_library_version().splitlines()[0].strip()


class _LeanRequest(Request):
    """One library request, its counter given (the iallreduce hot path)."""

    def __init__(self, req, counter, nbytes, on_done=None):
        self._req, self._counter, self._nbytes = req, counter, nbytes
        self._on_done, self.done, self.wait_seconds = on_done, False, 0.0

    def test(self) -> bool:
        if not self.done and self._req.Test():
            self._finish(0.0)
        return self.done

    def wait(self) -> None:
        if not self.done:
            prev = enter("wait iallreduce", self.where, -1, self._nbytes)
            t = _perf()
            try:
                self._req.Wait()
            finally:
                leave(prev)
            self._finish(_perf() - t)


class Communicator(ObjectCalls):
    """Named, counted collectives on ``comm`` (an ``mpi4py.MPI.Comm``).

    Attributes read by :mod:`.algorithms`: ``allreduce_table`` (what ``auto`` chooses, see
    :func:`~.algorithms.calibrate`; None: the defaults), ``allreduce_segment_bytes``,
    ``iallreduce_segment_bytes``, ``shm_piece_bytes`` (optional). The algorithms' own state is
    ``collectives`` (:class:`~.state.Collectives`). ``device_path`` (None, or a path of
    :mod:`.device_paths`, set by :func:`.gpu.attach`): how device arrays are reduced.
    """

    device_path = None

    def __init__(self, comm, stats: CommStats | None = None, name: str = "comm"):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.name = name
        self._lean = self.size > 1          # the hot path: NumPy buffers, library's Allreduce
        if self._lean:
            MPI = _mpi()
            self._Iallreduce = comm.Iallreduce
            self._IN_PLACE, self._SUM = MPI.IN_PLACE, MPI.SUM
        self.collectives = Collectives(self)    # the algorithms' shared state
        self.stats = stats if stats is not None else CommStats()

    @classmethod
    def single(cls, name: str = "self", stats: CommStats | None = None) -> "SelfCommunicator":
        """A one-rank communicator that never imports mpi4py (:class:`SelfCommunicator`)."""
        return SelfCommunicator(name, stats)

    @property
    def stats(self) -> CommStats:
        return self._stats

    @stats.setter
    def stats(self, stats: CommStats) -> None:
        self._stats = stats
        self._ar = stats.counter("allreduce", 2 * (self.size - 1), self.size)
        self._iar = stats.counter("iallreduce", 2 * (self.size - 1), self.size)
        if self._lean:                      # the hot path, bound to this counter; recorded
            self.allreduce = self.collectives.bind_allreduce(recorded_allreduce(
                Communicator.allreduce.__get__(self), self.name), self._ar, self.name)

    @property
    def allreduce_table(self):
        """The table ``auto`` reads (``{"sizes": [...], "choice": [...]}``) or None: the
        defaults (kept in :attr:`collectives`, see :class:`Collectives`)."""
        return self.collectives.table

    @allreduce_table.setter
    def allreduce_table(self, table) -> None:
        self.collectives.table = table

    def _timed(self, op, nbytes, fn, peer: int = -1, skipped=None):
        """``fn()``, timed and counted under ``op``, recorded for the watchdog
        (:mod:`.watchdog`; ``skipped`` is returned if its test-only fault hook skips it)."""
        prev = enter(op, self.name, peer, nbytes)
        if prev is SKIP:
            return skipped
        t = _perf()
        try:
            out = fn()
        finally:
            leave(prev)
        self.stats.add(op, nbytes, _perf() - t)
        return out

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, buf, algorithm: str = "mpi"):
        """Sum ``buf`` over all ranks, in place. ``algorithm``: mpi | ring | rd | shm | auto
        (see :mod:`.algorithms`). Returns ``buf``.

        On more than one rank this method is shadowed by the hot path bound by
        :meth:`Collectives.bind_allreduce`: a NumPy buffer reduced by the library (``mpi``, or
        ``auto`` below its first other choice) then costs a type and a size check, two counter
        increments and the bound ``Allreduce`` (timed one call in ``SAMPLE_EVERY`` below
        ``SAMPLED_BELOW`` bytes).
        """
        if self.size == 1:
            return buf
        t = _perf()
        if self.device_path is not None and type(buf) is not _ndarray:
            self.device_path.allreduce(self, buf)   # a device array: --gpu_comm's path
        else:
            algorithms.allreduce(self, buf, algorithm)  # resolves auto, rejects unknown names
        c = self._ar
        c.seconds += _perf() - t
        c.calls += 1
        c.raw += buf.nbytes
        return buf

    def iallreduce(self, buf, on_done=None, algorithm: str = "mpi") -> Request:
        """Start a non-blocking in-place sum of ``buf``; ``wait()`` the returned request.
        ``algorithm``: mpi (the library's Iallreduce) | ring (hpcnn's segmented ring, advanced
        by ``test()`` calls between blocks of compute; faster than the MPICH and Open MPI wheels'
        Iallreduce from ~2 MiB) | shm (one node: shared memory, phases run by ``test()``) |
        auto (see :func:`.algorithms.choose_nonblocking`)."""
        if type(buf) is _ndarray and self._lean:
            n = buf.nbytes
            if algorithm == "mpi" or algorithm == "auto" and n < self.collectives.iauto_mpi_below:
                if started("iallreduce", self.name, -1, n):     # test-only fault hook
                    return self._skipped("iallreduce", on_done)
                r = _LeanRequest(self._Iallreduce(self._IN_PLACE, buf, self._SUM), self._iar,
                                 n, on_done)
                r.where = self.name
                return r
        if self.size > 1 and started("iallreduce", self.name, -1, buf.nbytes):
            return self._skipped("iallreduce", on_done)
        if self.size > 1 and self.device_path is not None and type(buf) is not _ndarray:
            return self.device_path.iallreduce(self, buf, on_done)
        if self.size > 1 and algorithm != "mpi":
            return algorithms.iallreduce(self, buf, algorithm, on_done)
        r = Request([], self._stats, "iallreduce", 0, _perf(), on_done)
        r.where = self.name
        backend.sync()
        # one rank, or CuPy without CUDA-aware MPI (staged through the host): blocking
        if self.size == 1 or backend.xp is not numpy and not _cuda_aware():
            self.allreduce(buf)
            r._finish(0.0)
            return r
        MPI = _mpi()
        r._reqs = [self.comm.Iallreduce(MPI.IN_PLACE, device_view(buf), op=MPI.SUM)]
        r._nbytes = 2 * (self.size - 1) * buf.nbytes // self.size
        return r

    def _skipped(self, op: str, on_done=None) -> Request:
        """A request complete at once, for a start the watchdog's test-only fault hook skips."""
        r = Request([], self._stats, op, 0, _perf(), on_done)
        r._finish(0.0)
        return r

    def shared_zeros(self, shape, dtype=numpy.float32):
        """A zero-filled array that ``allreduce``/``iallreduce`` with ``shm`` (or ``auto``)
        reduce in place without copying it in: in shared memory when all ranks are on one node,
        else a plain array (see :func:`.algorithms.shared_zeros`). Collective."""
        return algorithms.shared_zeros(self, shape, dtype)

    def allreduce_scalars(self, values, op: str = "sum") -> numpy.ndarray:
        """Reduce a few float64 numbers (loss, norms, counts) over all ranks: sum, max or min."""
        a = numpy.ascontiguousarray(values, dtype=numpy.float64).reshape(-1)
        return a if self.size == 1 else self._reduced("allreduce_scalars", a, op)

    def reduce_array(self, x, op: str = "sum"):
        """A new array: ``x`` reduced element-wise over all ranks (``"sum"``, ``"max"`` or
        ``"min"``), its dtype and shape kept; a copy of ``x`` on one rank. Counted under
        ``reduce_array`` as an allreduce (2(p-1)/p of the bytes)."""
        a = numpy.ascontiguousarray(x)
        return a.copy() if self.size == 1 else self._reduced("reduce_array", a, op)

    def _reduced(self, name: str, a, op: str):
        """A new array: the contiguous host array ``a`` reduced over all ranks by ``op``
        ("sum", "max", "min"), counted under ``name`` as an allreduce."""
        MPI = _mpi()
        mop = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        out = numpy.empty_like(a)
        self._timed(name, 2 * (self.size - 1) * a.nbytes // self.size,
                    lambda: self.comm.Allreduce(a, out, op=mop))
        return out

    def ireduce_max(self, sendbuf, recvbuf) -> Request:
        """Start ``recvbuf`` = the element-wise maximum of every rank's ``sendbuf`` (host
        arrays, a few numbers: flags agreed in the background); ``wait()`` the request."""
        t0 = _perf()
        if self.size == 1:
            recvbuf[...] = sendbuf
            return _SelfRequest(self.stats, "ireduce_max")
        req = self.comm.Iallreduce(sendbuf, recvbuf, op=_mpi().MAX)
        return Request([req], self.stats, "ireduce_max", sendbuf.nbytes, t0).at(self.name)

    def allreduce_max(self, buf):
        """Element-wise maximum of ``buf`` over all ranks, in place; returns ``buf``.

        Counted under op ``allreduce_max`` as an allreduce (2(p-1)/p of the bytes, floored on
        the total). ``buf`` must be contiguous. Identity on one rank.
        """
        if self.size == 1:
            return buf
        MPI = _mpi()
        counter = self.stats.counter("allreduce_max", 2 * (self.size - 1), self.size)
        prev = enter("allreduce_max", self.name, -1, buf.nbytes)
        if prev is SKIP:
            return buf
        t = _perf()
        try:
            with host_buffers(buf, writeback=(0,)) as (h,):
                self.comm.Allreduce(MPI.IN_PLACE, h, op=MPI.MAX)
        finally:
            leave(prev)
        counter.calls += 1
        counter.raw += buf.nbytes
        counter.seconds += _perf() - t
        return buf

    def reduce_scatter(self, sendbuf, recvbuf):
        """recvbuf = this rank's 1/p block (along axis 0) of the sum of every rank's sendbuf."""
        if self.size == 1:
            recvbuf[...] = sendbuf
            return recvbuf
        if sendbuf.shape[0] != recvbuf.shape[0] * self.size:
            raise ValueError(f"reduce_scatter: send axis 0 ({sendbuf.shape[0]}) != "
                             f"size ({self.size}) x recv axis 0 ({recvbuf.shape[0]})")
        nbytes = (self.size - 1) * sendbuf.nbytes // self.size
        if self._nccl_gathers(sendbuf):
            return self._timed("reduce_scatter", nbytes, lambda: self.device_path.reduce_scatter(
                self, sendbuf, recvbuf))
        MPI = _mpi()
        with host_buffers(sendbuf, recvbuf, writeback=(1,), fresh=(1,)) as (s, r):
            self._timed("reduce_scatter", nbytes,
                        lambda: self.comm.Reduce_scatter_block(s, r, op=MPI.SUM))
        return recvbuf

    def _nccl_gathers(self, buf) -> bool:
        """Whether ``buf`` (a device array) goes to the device path's gathers (NCCL's)."""
        path = self.device_path
        return path is not None and path.gathers and type(buf) is not _ndarray

    def allgather(self, sendbuf, recvbuf):
        """recvbuf (axis 0 = p blocks) = every rank's sendbuf, in rank order."""
        if self.size == 1:
            recvbuf[...] = sendbuf.reshape(recvbuf.shape)
            return recvbuf
        if recvbuf.shape[0] != sendbuf.shape[0] * self.size:
            raise ValueError(f"allgather: recv axis 0 ({recvbuf.shape[0]}) != size ({self.size}) "
                             f"x send axis 0 ({sendbuf.shape[0]})")
        nbytes = (self.size - 1) * recvbuf.nbytes // self.size
        if self._nccl_gathers(sendbuf):
            return self._timed("allgather", nbytes, lambda: self.device_path.allgather(
                self, sendbuf, recvbuf))
        with host_buffers(sendbuf, recvbuf, writeback=(1,), fresh=(1,)) as (s, r):
            self._timed("allgather", nbytes, lambda: self.comm.Allgather(s, r))
        return recvbuf

    def _levels(self, algorithm: str):
        """The two levels of this communicator for a parts collective (``algorithm="hier"``
        over consecutive nodes of as many ranks each), else None: the library's call."""
        if algorithm != "hier" or self.size == 1:
            return None
        from hpcnn.parallel.collectives.hier import levels_of
        levels = levels_of(self)
        return levels if levels is not None and levels.consecutive else None

    def ireduce_scatter_parts(self, sendbuf, recvbuf, counts, algorithm: str = "mpi") -> Request:
        """Start: ``recvbuf`` = this rank's part (``counts[rank]`` elements, after the earlier
        ranks' parts) of the element-wise sum of every rank's flat ``sendbuf``
        (``MPI_Ireduce_scatter``; uneven parts, zeros included); ``wait()`` the request.
        Counted under ``ireduce_scatter`` as the bytes of the parts the others receive."""
        counts = [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != sendbuf.size or \
                recvbuf.size != counts[self.rank]:
            raise ValueError(f"ireduce_scatter_parts: counts {counts} for {self.size} ranks, a "
                             f"send buffer of {sendbuf.size} and a receive buffer of "
                             f"{recvbuf.size} elements")
        t0 = _perf()
        if self.size == 1:
            recvbuf[...] = sendbuf
            return _SelfRequest(self.stats, "ireduce_scatter")
        backend.sync()
        levels = self._levels(algorithm)
        if levels is not None:             # two levels (hier.py): the node's, the rail's
            from hpcnn.parallel.collectives import hier
            mpi_buffers("ireduce_scatter_parts (hier)", sendbuf, recvbuf)   # not staged
            return hier.ireduce_scatter_parts(self, levels, sendbuf, recvbuf, counts)
        send = backend.to_host(sendbuf) if staged(sendbuf) else sendbuf      # a device's: staged
        recv, back = host_side(recvbuf)
        req = self.comm.Ireduce_scatter(*mpi_buffers("ireduce_scatter_parts", send, recv),
                                        counts, op=_mpi().SUM)
        nbytes = (sendbuf.size - counts[self.rank]) * sendbuf.itemsize
        return Request([req], self.stats, "ireduce_scatter", nbytes, t0,
                       on_done=back).at(self.name)

    def iallgather_parts(self, buf, counts, algorithm: str = "mpi") -> Request:
        """Start :meth:`allgather_parts` (``MPI_Iallgatherv`` in place); ``wait()`` the request
        before reading ``buf``. Counted under ``iallgather`` as the bytes of the others'
        parts. ZeRO-3 gathers the next block's parameters with it while this one computes."""
        counts = self._part_counts("iallgather_parts", buf, counts)
        t0 = _perf()
        if self.size == 1:
            return _SelfRequest(self.stats, "iallgather")
        backend.sync()
        levels = self._levels(algorithm)
        if levels is not None:             # two levels (hier.py): the rail's, the node's
            from hpcnn.parallel.collectives import hier
            mpi_buffers("iallgather_parts (hier)", buf)                      # not staged
            return hier.iallgather_parts(self, levels, buf, counts)
        displs = [sum(counts[:r]) for r in range(self.size)]
        h, back = host_side(buf, copy=True)          # a device's: staged, written back
        req = self.comm.Iallgatherv(_mpi().IN_PLACE, [*mpi_buffers("iallgather_parts", h),
                                                      (counts, displs)])
        nbytes = (buf.size - counts[self.rank]) * buf.itemsize
        return Request([req], self.stats, "iallgather", nbytes, t0, on_done=back).at(self.name)

    def _part_counts(self, op: str, buf, counts) -> list[int]:
        counts = [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != buf.size:
            raise ValueError(f"{op}: {len(counts)} counts summing to {sum(counts)} for "
                             f"{self.size} ranks and a buffer of {buf.size} elements")
        return counts

    def allgather_parts(self, buf, counts, algorithm: str = "mpi"):
        """In place: rank r's part of the flat, contiguous ``buf`` (``counts[r]`` elements after
        the earlier ranks' parts) copied into every rank's ``buf`` (``MPI_Allgatherv`` with
        ``MPI_IN_PLACE``; uneven parts, zeros included). Counted under ``allgather`` as the bytes
        of the parts the others hold. Returns ``buf``."""
        counts = self._part_counts("allgather_parts", buf, counts)
        if self.size == 1:
            return buf
        if self._levels(algorithm) is not None:
            self.iallgather_parts(buf, counts, algorithm).wait()
            return buf
        MPI = _mpi()
        displs = [sum(counts[:r]) for r in range(self.size)]
        with host_buffers(buf, writeback=(0,)) as (b,):
            self._timed("allgather", (buf.size - counts[self.rank]) * buf.itemsize,
                        lambda: self.comm.Allgatherv(MPI.IN_PLACE, [b, (counts, displs)]))
        return buf

    def alltoallv(self, sendbuf, sendcounts, recvbuf, recvcounts):
        """Personalised all-to-all: this rank sends ``sendcounts[q]`` elements to rank q and
        receives ``recvcounts[q]`` from it, each block contiguous in rank order in the flat,
        contiguous ``sendbuf``/``recvbuf`` (``MPI_Alltoallv``; the two count lists of a pair of
        ranks must agree). Counted under ``alltoallv`` as the bytes sent to the other ranks
        (point-to-point convention: the block a rank keeps for itself leaves nothing).
        One rank: ``recvbuf`` = its own block."""
        sendcounts = [int(c) for c in sendcounts]
        recvcounts = [int(c) for c in recvcounts]
        if len(sendcounts) != self.size or len(recvcounts) != self.size:
            raise ValueError(f"alltoallv: {len(sendcounts)} send and {len(recvcounts)} receive "
                             f"counts on {self.size} ranks")
        if sum(sendcounts) > sendbuf.size or sum(recvcounts) > recvbuf.size:
            raise ValueError(f"alltoallv: counts sum to {sum(sendcounts)} sent, "
                             f"{sum(recvcounts)} received; buffers hold {sendbuf.size}, "
                             f"{recvbuf.size}")
        if self.size == 1:
            t = _perf()
            recvbuf.reshape(-1)[:recvcounts[0]] = sendbuf.reshape(-1)[:sendcounts[0]]
            self.stats.add("alltoallv", 0, _perf() - t)
            return recvbuf
        sdispl = numpy.concatenate([[0], numpy.cumsum(sendcounts)[:-1]]).astype(int).tolist()
        rdispl = numpy.concatenate([[0], numpy.cumsum(recvcounts)[:-1]]).astype(int).tolist()
        nbytes = (sum(sendcounts) - sendcounts[self.rank]) * sendbuf.dtype.itemsize
        with host_buffers(sendbuf, recvbuf, writeback=(1,)) as (s, r):
            self._timed("alltoallv", nbytes, lambda: self.comm.Alltoallv(
                [s, (sendcounts, sdispl)], [r, (recvcounts, rdispl)]))
        return recvbuf

    def allgather_scalars(self, values) -> numpy.ndarray:
        """(p, k) float64 array of every rank's k numbers (speeds, timings)."""
        a = numpy.ascontiguousarray(values, dtype=numpy.float64).reshape(-1)
        out = numpy.empty((self.size, a.size))
        if self.size == 1:
            out[0] = a
            return out
        self._timed("allgather_scalars", a.nbytes * (self.size - 1), lambda: self.comm.Allgather(a, out))
        return out

    def bcast(self, buf, root: int = 0):
        """Broadcast ``buf`` from ``root`` in place."""
        if self.size == 1:
            return buf
        with host_buffers(buf, writeback=(0,)) as (h,):
            self._timed("bcast", buf.nbytes if self.rank == root else 0,
                        lambda: self.comm.Bcast(h, root=root))
        return buf

    def barrier(self) -> None:
        if self.size > 1:
            self._timed("barrier", 0, self.comm.Barrier)

    # -- point to point -------------------------------------------------------------------------
    def sendrecv(self, sendbuf, dest, recvbuf, source, tag: int = 0):
        """Send to ``dest`` while receiving from ``source`` (MPI.PROC_NULL allowed)."""
        MPI = _mpi()
        nbytes = 0 if dest == MPI.PROC_NULL else sendbuf.nbytes
        with host_buffers(sendbuf, recvbuf, writeback=(1,)) as (s, r):
            self._timed("sendrecv", nbytes, lambda: self.comm.Sendrecv(
                s, dest=dest, sendtag=tag, recvbuf=r, source=source, recvtag=tag),
                peer=dest if dest >= 0 else source)
        return recvbuf

    def isend(self, buf, dest, tag: int = 0) -> Request:
        MPI = _mpi()
        backend.sync()
        t0 = time.perf_counter()
        nbytes = 0 if dest == MPI.PROC_NULL else buf.nbytes
        if started("isend", self.name, dest, nbytes):   # test-only fault hook
            return self._skipped("isend")
        if staged(buf):                  # a host copy, kept alive by the request
            buf = backend.to_host(buf)
        req = self.comm.Isend(*mpi_buffers("isend", buf), dest=dest, tag=tag)
        return Request([req], self.stats, "isend", nbytes, t0).at(self.name, dest)

    def irecv(self, buf, source, tag: int = 0) -> Request:
        """Start receiving into ``buf``; a :func:`staged` device buffer is written from a host
        one when the request completes."""
        t0 = time.perf_counter()
        if started("irecv", self.name, source, buf.nbytes):  # test-only fault hook
            return self._skipped("irecv")
        h, back = host_side(buf)
        return Request([self.comm.Irecv(*mpi_buffers("irecv", h), source=source, tag=tag)],
                       self.stats, "irecv", 0, t0, on_done=back).at(self.name, source, buf.nbytes)

    # -- sub-communicators and the node ------------------------------------------------------
    def split(self, color: int, key: int, name: str | None = None) -> "Communicator":
        """The Communicator of the ranks passing the same ``color``, ordered by ``key``
        (``MPI_Comm_split``, collective), sharing this one's counters; :meth:`free` it."""
        return Communicator(self.comm.Split(color=color, key=key), stats=self.stats,
                            name=name or self.name)

    def free(self) -> None:
        """Free the algorithms' resources and the MPI communicator of one made by
        :meth:`split` (collective)."""
        self.collectives.free()
        self.comm.Free()

    def dup(self, name: str | None = None) -> "Communicator":
        """A duplicate of this communicator (its own message space; collective; :meth:`free`
        it), with counters of its own."""
        if self.size == 1:
            return SelfCommunicator(name or self.name)
        return Communicator(self.comm.Dup(), name=name or self.name)

    def ranks_on_node(self) -> int:
        """How many ranks of this communicator share this rank's node (its memory), from
        ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``, or its emulated node
        (:mod:`.topology`; collective)."""
        if self.size == 1:
            return 1
        from hpcnn.parallel.collectives.topology import split_node
        local = split_node(self.comm, key=self.rank)
        try:
            return local.Get_size()
        finally:
            local.Free()

    def ibarrier(self) -> Request:
        """Start a non-blocking barrier; ``test()`` or ``wait()`` the returned request (a
        rank can sleep between tests where a blocking ``barrier`` would spin on its core)."""
        if self.size == 1:
            return self._skipped("ibarrier")
        return Request([self.comm.Ibarrier()], self.stats, "ibarrier", 0, _perf()).at(self.name)

    # -- the library's calls bare, for timing them (hpcnn.plan.calibrate) ------------------------
    # Not counted, not recorded for the watchdog, no host staging: the timed call is the MPI
    # call alone (the counting around a call costs about as much as an 8-byte message).
    def bare_round_trip(self, buf, peer: int, first: bool, tag: int = 0) -> None:
        """One round trip of ``buf`` with rank ``peer``: blocking ``Send`` then ``Recv`` when
        ``first``, else ``Recv`` then ``Send`` (the peer passes the other). One rank: nothing
        moves (the buffer would come back as it went)."""
        if self.size == 1:
            return
        if first:
            self.comm.Send(buf, dest=peer, tag=tag)
            self.comm.Recv(buf, source=peer, tag=tag)
        else:
            self.comm.Recv(buf, source=peer, tag=tag)
            self.comm.Send(buf, dest=peer, tag=tag)

    def bare_allreduce(self, buf):
        """The library's in-place ``Allreduce`` (sum) of the host array ``buf``; returns it."""
        if self.size > 1:
            MPI = _mpi()
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf

    def bare_alltoall(self, sendbuf, recvbuf, counts) -> None:
        """The library's ``Alltoallv`` of the host arrays: ``counts[q]`` elements to and from
        each rank q, blocks in rank order (the displacements the library derives)."""
        if self.size > 1:
            self.comm.Alltoallv([sendbuf, counts], [recvbuf, counts])
        else:
            recvbuf.reshape(-1)[:counts[0]] = sendbuf.reshape(-1)[:counts[0]]

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank}/{self.size})"


class _SelfComm:
    """Stands in for ``MPI.COMM_SELF`` under a :class:`SelfCommunicator`: a rank and a size, no
    communication (every collective is the Communicator's, which need none on one rank)."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1


class _SelfRequest(Request):
    """A request on one rank: complete as soon as it is ``ready`` (at once, but for an ``irecv``
    posted before its ``isend``); counted, like an MPI request, when ``test``/``wait`` sees it
    complete."""

    def __init__(self, stats, op: str, ready: bool = True, buf=None, tag: int = 0):
        super().__init__([], stats, op, 0, _perf())
        self.ready, self.buf, self.tag = ready, buf, tag

    def test(self) -> bool:
        if self.ready and not self.done:
            self._finish(0.0)
        return self.done

    def wait(self) -> None:
        if not self.test():
            raise RuntimeError(f"irecv (tag {self.tag}) on a one-rank communicator: no isend to "
                               "rank 0 with this tag was posted, so it would wait forever")


class SelfCommunicator(Communicator):
    """The :class:`Communicator` of one rank, without MPI (mpi4py is never imported).

    Every method gives the one-rank answer of a Communicator over ``MPI.COMM_SELF``: reductions,
    broadcasts and gathers are identities or copies, requests complete at once, ``shared_zeros``
    is a plain zeros array, and the counters count calls but no bytes. Point-to-point goes to
    rank 0 itself (``dest``/``source`` 0) or nowhere (a negative rank, e.g. ``MPI.PROC_NULL``):
    a message to itself is copied and counted as 0 bytes (nothing leaves the rank). A serial run
    uses it so that it runs the code of an MPI run. Make it with :meth:`Communicator.single`.
    """

    def __init__(self, name: str = "self", stats: CommStats | None = None):
        super().__init__(_SelfComm(), stats, name)
        self._sent, self._waiting = {}, {}     # tag -> queued copies sent; tag -> receives
        self._objects = {}                     # tag -> pickled objects sent to itself

    @staticmethod
    def _peer(op: str, rank: int) -> bool:
        """True for rank 0 (this rank), False for no peer (negative); else a ValueError."""
        if rank > 0:
            raise ValueError(f"{op}: rank {rank} on a one-rank communicator (only 0, or a "
                             "negative rank for no peer)")
        return rank == 0

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag: int = 0):
        """``recvbuf[...] = sendbuf`` when both peers are rank 0; nothing when neither is."""
        to_self, from_self = self._peer("sendrecv", dest), self._peer("sendrecv", source)
        if to_self != from_self:
            raise ValueError(f"sendrecv on a one-rank communicator: dest {dest} and source "
                             f"{source} must both be 0 (to itself) or both no peer")
        t = _perf()
        if to_self:
            recvbuf[...] = sendbuf
        self.stats.add("sendrecv", 0, _perf() - t)
        return recvbuf

    def isend(self, buf, dest, tag: int = 0) -> Request:
        """A copy of ``buf`` for the matching ``irecv`` (tag), or dropped for no peer."""
        if self._peer("isend", dest):
            waiting = self._waiting.get(tag)
            if waiting:
                r = waiting.popleft()
                r.buf[...] = buf
                r.ready = True
            else:
                self._sent.setdefault(tag, deque()).append(buf.copy())
        return _SelfRequest(self.stats, "isend")

    def irecv(self, buf, source, tag: int = 0) -> Request:
        """Filled from an earlier ``isend`` with this tag, else when one is posted."""
        if not self._peer("irecv", source):
            return _SelfRequest(self.stats, "irecv")
        sent = self._sent.get(tag)
        if sent:
            buf[...] = sent.popleft()
            return _SelfRequest(self.stats, "irecv")
        r = _SelfRequest(self.stats, "irecv", ready=False, buf=buf, tag=tag)
        self._waiting.setdefault(tag, deque()).append(r)
        return r

    def send_object(self, obj, dest: int, tag: int = 0) -> Request:
        """A pickled copy of ``obj`` kept for :meth:`recv_object` with this tag (to itself), or
        dropped (no peer); the request is complete at once."""
        if self._peer("send_object", dest):
            self._objects.setdefault(tag, deque()).append(pickle.dumps(obj))
        return _SelfRequest(self.stats, "send_object")

    def recv_object(self, source: int, tag: int = 0):
        """The object an earlier :meth:`send_object` to itself with ``tag`` sent; a ValueError
        if there is none (on one rank nothing else could ever send it: never a hang)."""
        if not self._peer("recv_object", source) or not self._objects.get(tag):
            raise ValueError(f"recv_object on a one-rank communicator: no object sent with tag "
                             f"{tag} from rank {source}")
        t = _perf()
        obj = pickle.loads(self._objects[tag].popleft())
        self.stats.add("recv_object", 0, _perf() - t)
        return obj

    def split(self, color: int, key: int, name: str | None = None) -> "Communicator":
        """Another one-rank communicator (``color`` and ``key`` choose nothing on one rank)."""
        return SelfCommunicator(name or self.name, self.stats)

    def free(self) -> None:
        """Nothing to free: no MPI communicator."""

    def __repr__(self) -> str:
        return f"SelfCommunicator({self.name})"
