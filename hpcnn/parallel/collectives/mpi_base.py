"""What every collective module needs from MPI, below the Communicator and the algorithms.

The lazily imported ``mpi4py.MPI`` (never at import: docs/architecture.md), host staging of device
buffers for an MPI that cannot read GPU memory, and :class:`Request`, a pending non-blocking
operation that counts its bytes and the time spent waiting for it. :mod:`.comm` (the Communicator)
and the algorithms it dispatches to (:mod:`.algorithms`, :mod:`.ring`, :mod:`.shm`, :mod:`.cma`)
all build on this module, so the algorithms need not import the Communicator's module back.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import numpy

from hpcnn import backend
from hpcnn import strict as _strict
from hpcnn.parallel.collectives.watchdog import enter, leave

_perf = time.perf_counter
_MPI = None                 # mpi4py.MPI once imported (never at import: docs/architecture.md)


def _mpi():
    global _MPI
    if _MPI is None:
        from mpi4py import MPI
        _MPI = MPI
    return _MPI


_DECLARED = [None]          # the run's CUDA-awareness (set_cuda_aware); None: HPCNN_CUDA_AWARE


def env_cuda_aware() -> bool | None:
    """``HPCNN_CUDA_AWARE`` read: True (1), False (0), None (unset or empty)."""
    v = os.environ.get("HPCNN_CUDA_AWARE", "").strip().lower()
    return None if v == "" else v not in ("0", "false", "no")


def set_cuda_aware(flag: bool | None) -> None:
    """Declare for this process whether MPI reads device buffers (the run's ``--gpu_comm``
    decides: :func:`hpcnn.parallel.collectives.gpu.start`); None: back to
    ``HPCNN_CUDA_AWARE``."""
    _DECLARED[0] = flag


def _cuda_aware() -> bool:
    flag = _DECLARED[0]
    return bool(env_cuda_aware()) if flag is None else flag


def device_view(a):
    """What a CUDA-aware MPI is handed for the array ``a``: a host or CuPy array itself (mpi4py
    reads a CuPy array's ``__cuda_array_interface__``), a strict device array's memory in
    place, as a CUDA-aware MPI reads device memory (no host transfer: nothing counted)."""
    return _strict.unwrap(a) if type(a) is _strict.StrictArray else a


def staged(buf) -> bool:
    """Whether ``buf`` is a device array this MPI cannot read (no CUDA-aware MPI declared):
    its message goes through a host copy."""
    return backend.xp is not numpy and not _cuda_aware() and not isinstance(buf, numpy.ndarray)


def host_side(buf, copy: bool = False):
    """(the buffer MPI receives into, its ``on_done``): ``buf`` itself and None, or for a
    :func:`staged` one a host buffer (``copy``: holding ``buf``'s values, for an operation in
    place) and the copy of it back to ``buf`` once received."""
    if not staged(buf):
        return device_view(buf), None
    h = backend.to_host(buf) if copy else numpy.empty(buf.shape, buf.dtype)

    def back():
        buf[...] = backend.to_device(h)
    return h, back


def mpi_buffers(op: str, *arrays):
    """``arrays`` as given, once checked that MPI can read them: host arrays, or device arrays
    with a CUDA-aware MPI (declared by ``HPCNN_CUDA_AWARE=1``); any other device array raises
    :class:`hpcnn.backend.DeviceBufferError` naming ``op`` (stage it: :func:`host_buffers`)."""
    if backend.xp is not numpy and not _cuda_aware():
        for a in arrays:
            if a is not None and not isinstance(a, numpy.ndarray):
                raise backend.DeviceBufferError(
                    f"a device buffer handed to MPI in {op} ({type(a).__name__} {a.shape}): "
                    "this MPI is not declared CUDA-aware (HPCNN_CUDA_AWARE=1); stage it "
                    "through host memory (mpi_base.host_buffers, backend.to_host/to_device)")
    return tuple(device_view(a) for a in arrays)


@contextmanager
def host_buffers(*arrays, writeback=(), fresh=()):
    """Yield buffers MPI can read: the arrays themselves on NumPy or CUDA-aware MPI, else host
    copies; arrays whose index is in ``writeback`` are copied back to the device afterwards,
    and those in ``fresh`` (outputs whose values MPI does not read) are not copied over but
    given as empty host arrays: a staged call moves only what it needs."""
    backend.sync()
    if backend.xp is numpy or _cuda_aware():
        yield tuple(device_view(a) for a in arrays)
        return
    # a device without CUDA-aware MPI (CuPy, or the strict backend): its arrays copied over
    hosts = tuple((numpy.empty(a.shape, a.dtype) if i in fresh else backend.to_host(a))
                  if staged(a) else a for i, a in enumerate(arrays))
    yield hosts
    for i in writeback:
        if hosts[i] is not arrays[i]:
            arrays[i][...] = backend.to_device(hosts[i])


class Request:
    """A pending non-blocking operation; ``wait()`` completes it and records its time.

    Its wait is recorded for the watchdog (:mod:`.watchdog`) as ``wait <op>`` on the
    communicator ``where`` with ``peer`` (set by :meth:`at`; -1: a collective)."""

    where, peer, _shown_bytes = "", -1, None

    def __init__(self, reqs, stats, op, nbytes, t0, on_done=None):
        self._reqs, self._counter, self._nbytes = reqs, stats.counter(op), nbytes
        self._on_done, self.done, self.wait_seconds = on_done, False, 0.0
        self._op = op

    def at(self, where: str, peer: int = -1, nbytes: int | None = None) -> "Request":
        """Name the communicator and peer (and the bytes, if not those counted) its wait is
        recorded with; returns the request."""
        self.where, self.peer, self._shown_bytes = where, peer, nbytes
        return self

    def _enter_wait(self):
        """Record the start of this request's blocking wait (see :func:`.watchdog.enter`)."""
        n = self._nbytes if self._shown_bytes is None else self._shown_bytes
        return enter("wait " + getattr(self, "_op", "request"), self.where, self.peer, n)

    def test(self) -> bool:
        if not self.done and (_MPI or _mpi()).Request.Testall(self._reqs):
            self._finish(0.0)
        return self.done

    def wait(self) -> None:
        if not self.done:
            prev = self._enter_wait()
            t = _perf()
            try:
                _mpi().Request.Waitall(self._reqs)
            finally:
                leave(prev)
            self._finish(_perf() - t)

    def _finish(self, waited):
        self.done, self.wait_seconds = True, waited
        # seconds counted: time blocked in wait (the non-hidden part), bytes: the whole message
        c = self._counter
        c.calls += 1
        c.raw += self._nbytes
        c.seconds += waited
        if self._on_done is not None:
            self._on_done()
