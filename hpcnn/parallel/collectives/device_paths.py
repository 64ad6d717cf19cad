"""How the collectives reduce device arrays (``--gpu_comm``): staged, CUDA-aware MPI, or NCCL.

A :class:`~.comm.Communicator` with a path (``comm.device_path``, set by
:func:`.gpu.attach`) hands it every ``allreduce`` and ``iallreduce`` of a device array, and
under NCCL also its ``allgather`` and ``reduce_scatter``; host arrays keep the host algorithms
(``--allreduce``), and the other collectives go through MPI (staged or CUDA-aware, as
:func:`.mpi_base.set_cuda_aware` declared).

- :class:`StagedPath`: the buffer copied to host memory (one counted device-to-host transfer),
  the library's ``Allreduce``/``Iallreduce`` on the copy, the result copied back when it
  completes (one host-to-device transfer): the two transfers a path through host memory needs.
- :class:`MpiPath` (CUDA-aware MPI): the compute stream synchronised (MPI sees finished
  buffers), then the library's call on the device buffer itself: no transfer.
- :class:`NcclPath`: NCCL's ``allReduce`` (``cupy.cuda.nccl.NcclCommunicator``, its unique id
  broadcast over MPI) on the path's own stream. The host never waits: an event recorded on the
  compute stream orders the communication stream after the gradients are written, and the
  request's ``wait()`` makes the compute stream wait (device side) for an event recorded after
  the collective.

Overlap on a GPU: the data-parallel engine (:mod:`hpcnn.parallel.data.bucketed`) starts a
bucket's ``iallreduce`` as soon as its blocks' backward is queued; under NCCL the reduction runs
on the communication stream while the compute stream goes on with the earlier blocks' backward,
and ``finish`` only orders the optimizer's kernels after it. With a CUDA-aware MPI each launch
first synchronises the compute stream, so the overlap is MPI's progress while the host queues
the next blocks; staged, each launch copies its bucket out (a synchronisation) and the copy back
happens when the request completes.

The NCCL calls follow CuPy's documented API (``NcclCommunicator(ndev, commId, rank)``,
``allReduce(sendbuf, recvbuf, count, datatype, op, stream)`` with pointers and NCCL's enums).
They have run here only against a test double of that interface (tests/nccl_double.py) under
the strict backend, never on a GPU.
"""
from __future__ import annotations

import time

import numpy

from hpcnn import backend
from hpcnn.parallel.collectives.mpi_base import Request, _mpi, device_view

_perf = time.perf_counter


class StagedPath:
    """Device buffers reduced through host copies (MPI that cannot read device memory)."""

    name = "staged"
    gathers = False              # allgather / reduce_scatter: the Communicator's staged MPI

    def allreduce(self, comm, buf):
        """Sum ``buf`` over ``comm`` in place: one copy out, the library's Allreduce, one back."""
        h = backend.to_host(buf)                     # (synchronises: finished values)
        MPI = _mpi()
        comm.comm.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM)
        buf[...] = backend.to_device(h)
        return buf

    def iallreduce(self, comm, buf, on_done=None) -> Request:
        """Start the sum of ``buf``'s host copy; ``buf`` is written when the request completes."""
        t0, h = _perf(), backend.to_host(buf)
        MPI = _mpi()

        def back():
            buf[...] = backend.to_device(h)
            if on_done is not None:
                on_done()
        req = comm.comm.Iallreduce(MPI.IN_PLACE, h, op=MPI.SUM)
        return Request([req], comm.stats, "iallreduce", _sent(comm, buf), t0,
                       on_done=back).at(comm.name)

    def free(self) -> None:
        """Nothing held."""


class MpiPath(StagedPath):
    """Device buffers handed to a CUDA-aware MPI in place (``HPCNN_CUDA_AWARE=1`` or the
    library's own report)."""

    name = "mpi"

    def allreduce(self, comm, buf):
        backend.sync()                               # MPI reads what the stream has written
        MPI = _mpi()
        comm.comm.Allreduce(MPI.IN_PLACE, device_view(buf), op=MPI.SUM)
        return buf

    def iallreduce(self, comm, buf, on_done=None) -> Request:
        t0 = _perf()
        backend.sync()
        MPI = _mpi()
        req = comm.comm.Iallreduce(MPI.IN_PLACE, device_view(buf), op=MPI.SUM)
        return Request([req], comm.stats, "iallreduce", _sent(comm, buf), t0,
                       on_done=on_done).at(comm.name)


def _sent(comm, buf) -> int:
    return 2 * (comm.size - 1) * buf.nbytes // comm.size


class StreamRequest(Request):
    """A collective queued on a communication stream: ``wait()`` orders the current (compute)
    stream after ``event`` (recorded after the collective), device side: the host goes on."""

    def __init__(self, event, cuda, stats, op, nbytes, on_done=None):
        super().__init__([], stats, op, nbytes, _perf(), on_done)
        self._event, self._cuda = event, cuda

    def test(self) -> bool:
        if not self.done and self._event.done:
            self._finish(0.0)
        return self.done

    def wait(self) -> None:
        if not self.done:
            self._cuda.get_current_stream().wait_event(self._event)
            self._finish(0.0)


class NcclPath:
    """NCCL collectives of device buffers on a stream of their own (see the module docstring).

    ``nccl`` is ``cupy.cuda.nccl`` (or, in tests, a double of its interface) and ``cuda``
    ``cupy.cuda`` (or the strict backend's stand-in, :data:`hpcnn.strict.cuda`). Collective:
    rank 0 makes the unique id, every rank receives it by ``comm.bcast_object``, then every
    rank joins the NCCL communicator with its rank in ``comm``."""

    name = "nccl"
    gathers = True

    def __init__(self, comm, nccl, cuda):
        self.nccl, self.cuda = nccl, cuda
        uid = nccl.get_unique_id() if comm.rank == 0 else None
        uid = comm.bcast_object(uid, root=0)
        self.comm = nccl.NcclCommunicator(comm.size, uid, comm.rank)
        self.stream = cuda.Stream(non_blocking=True)
        self.codes = {numpy.dtype(numpy.float16): nccl.NCCL_FLOAT16,
                      numpy.dtype(numpy.float32): nccl.NCCL_FLOAT32,
                      numpy.dtype(numpy.float64): nccl.NCCL_FLOAT64}

    def code(self, a) -> int:
        """NCCL's datatype code of ``a`` (C-contiguous float16, float32 or float64)."""
        if a.dtype not in self.codes or not a.flags.c_contiguous:
            raise ValueError(f"NCCL path: a {a.dtype} array of shape {a.shape} "
                             f"({'' if a.flags.c_contiguous else 'not '}contiguous); expected a "
                             f"contiguous float16, float32 or float64 array")
        return self.codes[a.dtype]

    def _queued(self, call):
        """``call(stream_ptr)`` queued on the path's stream after the work queued so far on the
        current stream; returns the event recorded after it."""
        ready = self.cuda.Event(disable_timing=True)
        ready.record(self.cuda.get_current_stream())
        self.stream.wait_event(ready)
        call(self.stream.ptr)
        done = self.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return done

    def _reduce(self, buf):
        code, n = self.code(buf), buf.size
        return self._queued(lambda s: self.comm.allReduce(buf.data.ptr, buf.data.ptr, n, code,
                                                          self.nccl.NCCL_SUM, s))

    def allreduce(self, comm, buf):
        """Sum ``buf`` in place; the current stream waits for it (device side)."""
        self.cuda.get_current_stream().wait_event(self._reduce(buf))
        return buf

    def iallreduce(self, comm, buf, on_done=None) -> Request:
        return StreamRequest(self._reduce(buf), self.cuda, comm.stats, "iallreduce",
                             _sent(comm, buf), on_done).at(comm.name)

    def allgather(self, comm, sendbuf, recvbuf):
        """``recvbuf`` (p blocks in rank order) = every rank's ``sendbuf`` (NCCL allGather)."""
        code, n = self.code(sendbuf), sendbuf.size
        self.code(recvbuf)
        done = self._queued(lambda s: self.comm.allGather(sendbuf.data.ptr, recvbuf.data.ptr,
                                                          n, code, s))
        self.cuda.get_current_stream().wait_event(done)
        return recvbuf

    def reduce_scatter(self, comm, sendbuf, recvbuf):
        """``recvbuf`` = this rank's block of the sum of every rank's ``sendbuf`` (NCCL
        reduceScatter, ``recvbuf.size`` elements a rank)."""
        code, n = self.code(sendbuf), recvbuf.size
        self.code(recvbuf)
        done = self._queued(lambda s: self.comm.reduceScatter(
            sendbuf.data.ptr, recvbuf.data.ptr, n, code, self.nccl.NCCL_SUM, s))
        self.cuda.get_current_stream().wait_event(done)
        return recvbuf

    def free(self) -> None:
        """Destroy the NCCL communicator (once every collective on it has been waited for)."""
        if self.comm is not None:
            self.stream.synchronize()
            self.comm.destroy()
            self.comm = None
