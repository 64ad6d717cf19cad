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

``allreduce`` of a NumPy buffer by the library (``mpi``, or ``auto`` where it picks ``mpi``) is
a lean path: measured on 2 ranks (MPICH wheel, 2 vCPUs) it adds ~0.2-0.3 us to a ~1.8 us raw
8-byte ``Allreduce`` (two clock reads, ~0.1 us, are the largest part).

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.comm import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.ones(4); c.allreduce(a); print(a, c.stats.bytes_sent)"
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from contextlib import contextmanager
from math import gcd

import numpy

from hpcnn import backend as B

_perf = time.perf_counter
_ndarray = numpy.ndarray
_MPI = None                 # mpi4py.MPI once imported (not at import time: see DESIGN.md)
_AR = None                  # hpcnn.parallel.allreduce once imported (it imports this module)


class _Counter:
    """One op's counters: calls, seconds, and ``raw`` bytes of which ``num/den`` are counted
    (2(p-1)/p for an allreduce on p ranks; floored once, on the total, when read)."""

    __slots__ = ("op", "calls", "raw", "seconds", "num", "den")

    def __init__(self, op, num=1, den=1):
        g = gcd(num, den) or 1
        self.op, self.num, self.den = op, num // g, den // g
        self.calls = self.raw = 0
        self.seconds = 0.0

    @property
    def bytes(self) -> int:
        return self.raw * self.num // self.den


class _Column(Mapping):
    """Read-only ``op -> total`` view of one field of a :class:`CommStats` (0 for unseen ops)."""

    def __init__(self, stats, field):
        self._stats, self._field = stats, field

    def __getitem__(self, op):
        cs = self._stats._by_op.get(op, ())
        return sum(getattr(c, self._field) for c in cs) if cs else (0.0 if self._field == "seconds" else 0)

    def __iter__(self):
        return iter([op for op, cs in self._stats._by_op.items() if any(c.calls for c in cs)])

    def __len__(self):
        return sum(1 for _ in self)

    def __repr__(self):
        return repr(dict(self))


class CommStats:
    """Per-operation counters: calls, bytes sent by this rank, seconds spent inside the call.

    ``calls``, ``bytes`` and ``seconds`` are read-only mappings ``op -> total`` (0 for an op never
    called); :meth:`add` counts one call. Communicators hold counter objects of their own (one
    per op and byte ratio) and bump their attributes: the cheapest bookkeeping Python offers.
    """

    def __init__(self):
        self._by_op = {}                    # op -> [_Counter]
        self.calls = _Column(self, "calls")
        self.bytes = _Column(self, "bytes")
        self.seconds = _Column(self, "seconds")

    def counter(self, op: str, num: int = 1, den: int = 1) -> _Counter:
        """The counter of ``op`` whose bytes are ``num/den`` of the raw bytes added to it."""
        cs = self._by_op.setdefault(op, [])
        g = gcd(num, den) or 1
        for c in cs:
            if (c.num, c.den) == (num // g, den // g):
                return c
        cs.append(_Counter(op, num, den))
        return cs[-1]

    def reset(self) -> None:
        """Zero every counter (communicators keep theirs)."""
        for cs in self._by_op.values():
            for c in cs:
                c.calls = c.raw = 0
                c.seconds = 0.0

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        cs = self._by_op.get(op)
        c = cs[0] if cs and cs[0].num == cs[0].den else self.counter(op)
        c.calls += 1
        c.raw += int(nbytes)
        c.seconds += seconds

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes for cs in self._by_op.values() for c in cs)

    @property
    def comm_seconds(self) -> float:
        return sum(c.seconds for cs in self._by_op.values() for c in cs)

    def snapshot(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "comm_s": self.comm_seconds,
                "calls": dict(self.calls)}


def _mpi():
    global _MPI
    if _MPI is None:
        from mpi4py import MPI
        _MPI = MPI
    return _MPI


def _algorithms():
    global _AR
    if _AR is None:
        from hpcnn.parallel import allreduce
        _AR = allreduce
    return _AR


def _cuda_aware() -> bool:
    return os.environ.get("HPCNN_CUDA_AWARE", "0") not in ("", "0", "false")


@contextmanager
def host_buffers(*arrays, writeback=()):
    """Yield buffers MPI can read: the arrays themselves on NumPy or CUDA-aware MPI, else host
    copies; arrays whose index is in ``writeback`` are copied back to the device afterwards."""
    B.sync()
    if B.xp is numpy or _cuda_aware():
        yield arrays
        return
    hosts = tuple(B.to_host(a) for a in arrays)  # pragma: no cover - CuPy without CUDA-aware MPI
    yield hosts  # pragma: no cover
    for i in writeback:  # pragma: no cover
        arrays[i][...] = B.to_device(hosts[i])


class Request:
    """A pending non-blocking operation; ``wait()`` completes it and records its time."""

    def __init__(self, reqs, stats, op, nbytes, t0, on_done=None):
        self._reqs, self._stats, self._op, self._nbytes, self._t0 = reqs, stats, op, nbytes, t0
        self._on_done = on_done
        self.done = False
        self.wait_seconds = 0.0

    def test(self) -> bool:
        if not self.done and (_MPI or _mpi()).Request.Testall(self._reqs):
            self._finish(0.0)
        return self.done

    def wait(self) -> None:
        if self.done:
            return
        t = _perf()
        _mpi().Request.Waitall(self._reqs)
        self._finish(_perf() - t)

    def _finish(self, waited):
        self.done = True
        self.wait_seconds = waited
        # seconds counted: time blocked in wait (the non-hidden part), bytes: the whole message
        self._stats.add(self._op, self._nbytes, waited)
        if self._on_done is not None:
            self._on_done()


class Communicator:
    """Named, counted collectives on ``comm`` (an ``mpi4py.MPI.Comm``).

    Attributes read by :mod:`hpcnn.parallel.allreduce`: ``allreduce_table`` (what ``auto``
    chooses, see :func:`~hpcnn.parallel.allreduce.calibrate`; None: the defaults),
    ``allreduce_segment_bytes``, ``iallreduce_segment_bytes``, ``shm_piece_bytes``.
    """

    def __init__(self, comm, stats: CommStats | None = None, name: str = "comm"):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.name = name
        self._lean = self.size > 1          # the hot path: NumPy buffers, library's Allreduce
        if self._lean:
            MPI = _mpi()
            self._Allreduce, self._Iallreduce = comm.Allreduce, comm.Iallreduce
            self._IN_PLACE, self._SUM = MPI.IN_PLACE, MPI.SUM
        self._iauto_mpi_below = 0           # iallreduce "auto" is "mpi" below this (once known)
        self.stats = stats if stats is not None else CommStats()
        self.allreduce_table = None

    @property
    def stats(self) -> CommStats:
        return self._stats

    @stats.setter
    def stats(self, stats: CommStats) -> None:
        self._stats = stats
        self._ar = stats.counter("allreduce", 2 * (self.size - 1), self.size)

    @property
    def allreduce_table(self):
        """The table ``auto`` reads (``{"sizes": [...], "choice": [...]}``) or None."""
        return self._table

    @allreduce_table.setter
    def allreduce_table(self, table) -> None:
        self._table = table
        self._auto = None                   # compiled on the next "auto" call
        self._auto_mpi_below = 0            # allreduce "auto" is "mpi" below this (once known)

    def _timed(self, op, nbytes, fn):
        t = _perf()
        out = fn()
        self.stats.add(op, nbytes, _perf() - t)
        return out

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, buf, algorithm: str = "mpi"):
        """Sum ``buf`` over all ranks, in place. ``algorithm``: mpi | ring | rd | shm | auto
        (see :mod:`hpcnn.parallel.allreduce`). Returns ``buf``.

        A NumPy buffer reduced by the library (``mpi``, or ``auto`` below its first other
        choice) takes a lean path: type and size checks, two clock reads, the bound
        ``Allreduce`` and three counter increments.
        """
        if self._lean and type(buf) is _ndarray and (
                algorithm == "mpi" or algorithm == "auto" and buf.nbytes < self._auto_mpi_below):
            t = _perf()
            self._Allreduce(self._IN_PLACE, buf, self._SUM)
            t = _perf() - t
            c = self._ar
            c.calls += 1
            c.raw += buf.nbytes
            c.seconds += t
            return buf
        if self.size == 1:
            return buf
        AR = _algorithms()
        if algorithm == "auto":
            algorithm = AR.choose(self, buf.nbytes)
        elif algorithm not in AR.ALGORITHMS:
            raise ValueError(f"unknown allreduce algorithm {algorithm!r}; "
                             f"expected one of {AR.ALGORITHMS}")
        t = _perf()
        AR.allreduce(self, buf, algorithm)
        t = _perf() - t
        c = self._ar
        c.calls += 1
        c.raw += buf.nbytes
        c.seconds += t
        return buf

    def iallreduce(self, buf, on_done=None, algorithm: str = "mpi") -> Request:
        """Start a non-blocking in-place sum of ``buf``; ``wait()`` the returned request.
        ``algorithm``: mpi (the library's Iallreduce) | ring (hpcnn's segmented ring, advanced
        by ``test()`` calls between blocks of compute; faster than the MPICH and Open MPI wheels'
        Iallreduce from ~2 MiB) | shm (one node: shared memory, phases run by ``test()``) |
        auto (see :func:`hpcnn.parallel.allreduce.choose_nonblocking`)."""
        if self._lean and type(buf) is _ndarray and (
                algorithm == "mpi" or algorithm == "auto" and buf.nbytes < self._iauto_mpi_below):
            return Request([self._Iallreduce(self._IN_PLACE, buf, self._SUM)], self._stats,
                           "iallreduce", 2 * (self.size - 1) * buf.nbytes // self.size, _perf(),
                           on_done)
        t0 = _perf()
        if self.size == 1:
            r = Request([], self.stats, "iallreduce", 0, t0, on_done)
            r._finish(0.0)
            return r
        if algorithm != "mpi":
            return _algorithms().iallreduce(self, buf, algorithm, on_done)
        B.sync()
        if B.xp is not numpy and not _cuda_aware():  # pragma: no cover - CuPy staging
            self.allreduce(buf)
            r = Request([], self.stats, "iallreduce", 0, t0, on_done)
            r._finish(0.0)
            return r
        req = self.comm.Iallreduce(_MPI.IN_PLACE, buf, op=_MPI.SUM)
        return Request([req], self.stats, "iallreduce", 2 * (self.size - 1) * buf.nbytes // self.size,
                       t0, on_done)

    def allreduce_scalars(self, values, op: str = "sum") -> numpy.ndarray:
        """Reduce a few float64 numbers (loss, norms, counts) over all ranks: sum, max or min."""
        a = numpy.ascontiguousarray(values, dtype=numpy.float64).reshape(-1)
        if self.size == 1:
            return a
        MPI = _mpi()
        mop = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        out = numpy.empty_like(a)
        self._timed("allreduce_scalars", 2 * (self.size - 1) * a.nbytes // self.size,
                    lambda: self.comm.Allreduce(a, out, op=mop))
        return out

    def reduce_scatter(self, sendbuf, recvbuf):
        """recvbuf = this rank's 1/p block (along axis 0) of the sum of every rank's sendbuf."""
        if self.size == 1:
            recvbuf[...] = sendbuf
            return recvbuf
        if sendbuf.shape[0] != recvbuf.shape[0] * self.size:
            raise ValueError(f"reduce_scatter: send axis 0 ({sendbuf.shape[0]}) != "
                             f"size ({self.size}) x recv axis 0 ({recvbuf.shape[0]})")
        MPI = _mpi()
        with host_buffers(sendbuf, recvbuf, writeback=(1,)) as (s, r):
            self._timed("reduce_scatter", (self.size - 1) * sendbuf.nbytes // self.size,
                        lambda: self.comm.Reduce_scatter_block(s, r, op=MPI.SUM))
        return recvbuf

    def allgather(self, sendbuf, recvbuf):
        """recvbuf (axis 0 = p blocks) = every rank's sendbuf, in rank order."""
        if self.size == 1:
            recvbuf[...] = sendbuf.reshape(recvbuf.shape)
            return recvbuf
        if recvbuf.shape[0] != sendbuf.shape[0] * self.size:
            raise ValueError(f"allgather: recv axis 0 ({recvbuf.shape[0]}) != size ({self.size}) "
                             f"x send axis 0 ({sendbuf.shape[0]})")
        with host_buffers(sendbuf, recvbuf, writeback=(1,)) as (s, r):
            self._timed("allgather", (self.size - 1) * recvbuf.nbytes // self.size,
                        lambda: self.comm.Allgather(s, r))
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
                s, dest=dest, sendtag=tag, recvbuf=r, source=source, recvtag=tag))
        return recvbuf

    def isend(self, buf, dest, tag: int = 0) -> Request:
        MPI = _mpi()
        B.sync()
        t0 = time.perf_counter()
        nbytes = 0 if dest == MPI.PROC_NULL else buf.nbytes
        return Request([self.comm.Isend(buf, dest=dest, tag=tag)], self.stats, "isend", nbytes, t0)

    def irecv(self, buf, source, tag: int = 0) -> Request:
        t0 = time.perf_counter()
        return Request([self.comm.Irecv(buf, source=source, tag=tag)], self.stats, "irecv", 0, t0)

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank}/{self.size})"
