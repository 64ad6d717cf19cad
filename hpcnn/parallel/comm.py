"""Named collectives over one MPI communicator, counting bytes and seconds per call.

Every parallel layer calls these, never MPI directly. Each wrapper uses the uppercase buffer
methods on arrays (no pickling), is a no-op (or a local copy) on a communicator of size 1, and on
CuPy synchronises the stream first; when the MPI library is not CUDA-aware
(``HPCNN_CUDA_AWARE`` unset) device arrays are staged through host memory.

Byte counts are what this rank sends under a bandwidth-optimal algorithm, so that they can be
compared with a cost model whatever algorithm the library picks: for ``n`` bytes on ``p`` ranks,
allreduce 2(p-1)/p n, reduce-scatter and all-gather (p-1)/p n (n = the full, unscattered size),
broadcast n on the root, point-to-point the message size. Counters live in a :class:`CommStats`
shared by all the communicators of a process, read into the run log's ``/ranks`` table.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.comm import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.ones(4); c.allreduce(a); print(a, c.stats.bytes_sent)"
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy

from hpcnn import backend as B


class CommStats:
    """Per-operation counters: calls, bytes sent by this rank, seconds spent inside the call."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.seconds = defaultdict(float)

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.calls[op] += 1
        self.bytes[op] += int(nbytes)
        self.seconds[op] += seconds

    @property
    def bytes_sent(self) -> int:
        return sum(self.bytes.values())

    @property
    def comm_seconds(self) -> float:
        return sum(self.seconds.values())

    def snapshot(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "comm_s": self.comm_seconds,
                "calls": dict(self.calls)}


def _mpi():
    from mpi4py import MPI
    return MPI


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
        if self.done:
            return True
        MPI = _mpi()
        if MPI.Request.Testall(self._reqs):
            self._finish(0.0)
        return self.done

    def wait(self) -> None:
        if self.done:
            return
        t = time.perf_counter()
        _mpi().Request.Waitall(self._reqs)
        self._finish(time.perf_counter() - t)

    def _finish(self, waited):
        self.done = True
        self.wait_seconds = waited
        # seconds counted: time blocked in wait (the non-hidden part), bytes: the whole message
        self._stats.add(self._op, self._nbytes, waited)
        if self._on_done is not None:
            self._on_done()


class Communicator:
    """Named, counted collectives on ``comm`` (an ``mpi4py.MPI.Comm``)."""

    def __init__(self, comm, stats: CommStats | None = None, name: str = "comm"):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stats = stats if stats is not None else CommStats()
        self.name = name

    def _timed(self, op, nbytes, fn):
        t = time.perf_counter()
        out = fn()
        self.stats.add(op, nbytes, time.perf_counter() - t)
        return out

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, buf, algorithm: str = "mpi"):
        """Sum ``buf`` over all ranks, in place. ``algorithm``: mpi | ring | rd | auto
        (see :mod:`hpcnn.parallel.allreduce`). Returns ``buf``."""
        if self.size == 1:
            return buf
        p, n = self.size, buf.nbytes
        if algorithm != "mpi":
            from hpcnn.parallel import allreduce as AR
            if algorithm == "auto":             # resolved here: "mpi" then takes the fast path
                algorithm = AR.choose(self, n)
        if algorithm != "mpi":
            return self._timed("allreduce", 2 * (p - 1) * n // p,
                               lambda: AR.allreduce(self, buf, algorithm))
        MPI = _mpi()
        if isinstance(buf, numpy.ndarray):      # no staging to do: skip host_buffers (~3 us a call)
            self._timed("allreduce", 2 * (p - 1) * n // p,
                        lambda: self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))
            return buf
        with host_buffers(buf, writeback=(0,)) as (h,):
            self._timed("allreduce", 2 * (p - 1) * n // p,
                        lambda: self.comm.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM))
        return buf

    def iallreduce(self, buf, on_done=None, algorithm: str = "mpi") -> Request:
        """Start a non-blocking in-place sum of ``buf``; ``wait()`` the returned request.
        ``algorithm``: mpi (the library's Iallreduce) | ring (hpcnn's segmented ring, advanced
        by ``test()`` calls between blocks of compute; faster than the MPICH and Open MPI wheels'
        Iallreduce from ~2 MiB) | auto (see :func:`hpcnn.parallel.allreduce.iallreduce`)."""
        p, n = self.size, buf.nbytes
        t0 = time.perf_counter()
        if self.size == 1:
            r = Request([], self.stats, "iallreduce", 0, t0, on_done)
            r._finish(0.0)
            return r
        if algorithm != "mpi":
            from hpcnn.parallel import allreduce as AR
            return AR.iallreduce(self, buf, algorithm, on_done)
        MPI = _mpi()
        B.sync()
        if B.xp is not numpy and not _cuda_aware():  # pragma: no cover - CuPy staging
            self.allreduce(buf)
            r = Request([], self.stats, "iallreduce", 0, t0, on_done)
            r._finish(0.0)
            return r
        req = self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return Request([req], self.stats, "iallreduce", 2 * (p - 1) * n // p, t0, on_done)

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
