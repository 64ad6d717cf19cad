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
takes a lean path: the optional C module (:mod:`hpcnn.parallel.lean_build`) when built, a
counted in-place ``MPI_Allreduce`` that is 1.1-1.2x a bare mpi4py ``Allreduce`` at 8 B-4 KiB on
2 ranks (it skips mpi4py's argument parsing); else a Python closure, 0.85-0.90x there. Counters
and the sampling of small calls' seconds: :mod:`hpcnn.parallel.stats`.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.comm import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.ones(4); c.allreduce(a); print(a, c.stats.bytes_sent)"
"""
from __future__ import annotations

import time

import numpy

from hpcnn import backend
from hpcnn.parallel import allreduce as algorithms     # the algorithms behind allreduce(...)
from hpcnn.parallel.mpi_base import Request, _cuda_aware, _mpi, host_buffers  # noqa: F401
from hpcnn.parallel.stats import SAMPLE_EVERY, SAMPLED_BELOW, CommStats, _c_lean

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
            t = _perf()
            self._req.Wait()
            self._finish(_perf() - t)


def _lean_allreduce(com):
    """``com.allreduce``'s hot path: the C module's ``Lean`` when it is built (and the counter is
    its ``Counter``), else a closure over the bound ``Allreduce``, constants and counter (cell
    loads instead of attribute loads: about half the per-call cost of the method). The
    difference matters only next to a bare ``Allreduce`` of a few KiB (~3-5 us here)."""
    lean = _c_lean()
    general = Communicator.allreduce.__get__(com)
    if lean is not None and type(com._ar) is lean.Counter:
        fast = lean.Lean(com.comm, com._ar, general, _ndarray, SAMPLED_BELOW, SAMPLE_EVERY)
        fast.auto_below = com._lim[0]
        return fast
    Allreduce, IN_PLACE, SUM = com._Allreduce, com._IN_PLACE, com._SUM
    c, lim, ndarray = com._ar, com._lim, _ndarray
    sampled, every = SAMPLED_BELOW, SAMPLE_EVERY - 1

    def allreduce(buf, algorithm: str = "mpi"):
        if type(buf) is ndarray:
            n = buf.nbytes
            if algorithm == "mpi" or algorithm == "auto" and n < lim[0]:
                c.calls += 1
                c.raw += n
                if n < sampled and c.calls & every:
                    Allreduce(IN_PLACE, buf, SUM)                  # untimed (sampled)
                    return buf
                t = _perf()
                Allreduce(IN_PLACE, buf, SUM)
                c.seconds += (_perf() - t) * (every + 1 if n < sampled else 1)
                return buf
        return general(buf, algorithm)
    allreduce.__doc__ = Communicator.allreduce.__doc__
    return allreduce


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
        self._lim = [0]                     # allreduce "auto" is "mpi" below _lim[0] (once known)
        self.stats = stats if stats is not None else CommStats()
        self.allreduce_table = None

    @property
    def stats(self) -> CommStats:
        return self._stats

    @stats.setter
    def stats(self, stats: CommStats) -> None:
        self._stats = stats
        self._ar = stats.counter("allreduce", 2 * (self.size - 1), self.size)
        self._iar = stats.counter("iallreduce", 2 * (self.size - 1), self.size)
        if self._lean:                      # the hot path, bound to this counter
            self.allreduce = _lean_allreduce(self)

    @property
    def _auto_mpi_below(self) -> int:
        return self._lim[0]

    @_auto_mpi_below.setter
    def _auto_mpi_below(self, nbytes: int) -> None:
        self._lim[0] = nbytes
        if hasattr(self.__dict__.get("allreduce"), "auto_below"):
            self.allreduce.auto_below = nbytes              # the C path keeps its own copy
            self.allreduce.private_below = 0                # until _set_private_auto

    def _set_private_auto(self, nbytes: int, shared_ranges: list) -> None:
        """C path only: ``auto`` also runs the library below ``nbytes`` for a buffer outside
        ``shared_ranges`` ((start, stop) addresses of the shared windows)."""
        fast = self.__dict__.get("allreduce")
        if hasattr(fast, "private_below"):
            fast.shared = list(shared_ranges)
            fast.private_below = nbytes

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

        On more than one rank this method is shadowed by a closure (:func:`_lean_allreduce`):
        a NumPy buffer reduced by the library (``mpi``, or ``auto`` below its first other
        choice) then costs a type and a size check, two counter increments and the bound
        ``Allreduce`` (timed one call in ``SAMPLE_EVERY`` below ``SAMPLED_BELOW`` bytes).
        """
        if self.size == 1:
            return buf
        t = _perf()
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
        auto (see :func:`hpcnn.parallel.allreduce.choose_nonblocking`)."""
        if type(buf) is _ndarray and self._lean:
            n = buf.nbytes
            if algorithm == "mpi" or algorithm == "auto" and n < self._iauto_mpi_below:
                return _LeanRequest(self._Iallreduce(self._IN_PLACE, buf, self._SUM), self._iar,
                                    n, on_done)
        if self.size > 1 and algorithm != "mpi":
            return algorithms.iallreduce(self, buf, algorithm, on_done)
        r = Request([], self._stats, "iallreduce", 0, _perf(), on_done)
        backend.sync()
        # one rank, or CuPy without CUDA-aware MPI (staged through the host): blocking
        if self.size == 1 or backend.xp is not numpy and not _cuda_aware():
            self.allreduce(buf)
            r._finish(0.0)
            return r
        MPI = _mpi()
        r._reqs = [self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)]
        r._nbytes = 2 * (self.size - 1) * buf.nbytes // self.size
        return r

    def shared_zeros(self, shape, dtype=numpy.float32):
        """A zero-filled array that ``allreduce``/``iallreduce`` with ``shm`` (or ``auto``)
        reduce in place without copying it in: in shared memory when all ranks are on one node,
        else a plain array (see :func:`hpcnn.parallel.allreduce.shared_zeros`). Collective."""
        return algorithms.shared_zeros(self, shape, dtype)

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

    def allreduce_max(self, buf):
        """Element-wise maximum of ``buf`` over all ranks, in place; returns ``buf``.

        Counted under op ``allreduce_max`` as an allreduce (2(p-1)/p of the bytes, floored on
        the total). ``buf`` must be contiguous. Identity on one rank.
        """
        if self.size == 1:
            return buf
        MPI = _mpi()
        counter = self.stats.counter("allreduce_max", 2 * (self.size - 1), self.size)
        t = _perf()
        with host_buffers(buf, writeback=(0,)) as (h,):
            self.comm.Allreduce(MPI.IN_PLACE, h, op=MPI.MAX)
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
        backend.sync()
        t0 = time.perf_counter()
        nbytes = 0 if dest == MPI.PROC_NULL else buf.nbytes
        return Request([self.comm.Isend(buf, dest=dest, tag=tag)], self.stats, "isend", nbytes, t0)

    def irecv(self, buf, source, tag: int = 0) -> Request:
        t0 = time.perf_counter()
        return Request([self.comm.Irecv(buf, source=source, tag=tag)], self.stats, "irecv", 0, t0)

    def __repr__(self) -> str:
        return f"Communicator({self.name}, rank {self.rank}/{self.size})"
