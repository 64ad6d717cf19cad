"""Offload channel: move a block's cache out of working memory and back while compute continues.

Activation offloading as in Beaumont, Eyraud-Dubois, Shilova, "Efficient Combination of
Rematerialization and Offloading for Training DNNs" (NeurIPS 2021): ``OFF(x)`` frees working memory
when its copy ends (``offload``/``wait_offload``); ``PRE(x)`` brings ``x`` back and must end
before the backward that needs it (``prefetch``/``fetch``). Transfers run one at a time, in issue
order, on one background thread, so ``PRE`` may be issued before its ``OFF`` has ended::

    with OffloadChannel() as ch:
        ch.offload(3, cache); del cache         # OFF: memory is freed when the copy ends
        ...                                     # forward of the next blocks
        ch.prefetch(3)                          # PRE, overlapped with the backward of block 4
        cache = ch.fetch(3)                     # restored, bit for bit

A cache is a nested structure of tuples (named tuples too), lists and dicts whose leaves are arrays
or plain values. Plain leaves (ints, floats, None, shape tuples, NumPy scalars, any other object)
stay in the channel as they are; only arrays move. The same array object appearing twice is moved
once and restored as one object (identity kept); two *different* arrays sharing memory (``a`` and a
view of ``a``) are moved and restored independently: values are right, the sharing is lost.
"""
from __future__ import annotations

import copy
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
import weakref

import numpy

from hpcnn import backend

KINDS = ("auto", "file", "pinned")


class OffloadError(RuntimeError):
    """A transfer failed on the worker; raised in the caller with the key named."""


class _Slot(int):
    """Placeholder for the i-th array of a flattened cache."""


class _Entry:
    """One key: the cache skeleton, its arrays (until the copy out ends) and transfer states."""

    def __init__(self, key, seq, skeleton, arrays, meta, ready=None):
        self.key, self.seq, self.skeleton = key, seq, skeleton
        self.arrays = arrays            # source arrays; None once the copy out has ended
        self.meta = meta                # [(shape, dtype, on_device)] per array
        self.nbytes = sum(backend.nbytes(s, d) for s, d, _ in meta)
        self.ready = ready              # CuPy event: the compute stream has produced the arrays
        self.ready_in = None            # CuPy event: the destination arrays are free to write
        self.store = None               # file path or list of pinned host arrays
        self.stored = False             # True while the bytes are held outside working memory
        self.restored = None            # list of arrays once the copy in has ended
        self.out_done, self.in_done = threading.Event(), threading.Event()
        self.error = None               # (direction, exception) raised on the worker
        self.reported = self.prefetched = False


def _map(obj, leaf):
    """Rebuild the tuples (named too), lists and dicts of ``obj`` with ``leaf`` applied to leaves."""
    if isinstance(obj, dict):
        out = copy.copy(obj)                              # keeps dict subclasses (defaultdict)
        out.update((k, _map(v, leaf)) for k, v in obj.items())
        return out
    if isinstance(obj, (tuple, list)):
        items = [_map(v, leaf) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return leaf(obj)


def _flatten(obj, array_types):
    """Cache -> (skeleton with a :class:`_Slot` per array, the distinct arrays in slot order)."""
    arrays, ids = [], {}

    def leaf(a):
        if not isinstance(a, array_types):
            return a
        if a.dtype.hasobject:
            raise TypeError(f"cannot offload an array of dtype {a.dtype} (holds Python objects)")
        if id(a) not in ids:                              # same object twice: one slot
            ids[id(a)] = len(arrays)
            arrays.append(a)
        return _Slot(ids[id(a)])
    return _map(obj, leaf), arrays


def _unflatten(skeleton, arrays):
    """Skeleton + restored arrays -> the cache."""
    return _map(skeleton, lambda x: arrays[x] if type(x) is _Slot else x)


class _FileIO:
    """Host arrays -> one file per key in ``directory`` -> fresh heap arrays (``readinto``)."""

    def __init__(self, directory):
        self.directory = directory
        self.array_types = ((numpy.ndarray,) if backend.xp is numpy
                            else (numpy.ndarray, backend.xp.ndarray))

    def put(self, e):
        path = os.path.join(self.directory, f"{e.seq}.bin")
        e.store = path
        with open(path, "wb") as f:
            for a in e.arrays:
                if a.size:
                    host = numpy.ascontiguousarray(backend.to_host(a))
                    f.write(host.reshape(-1).view(numpy.uint8))

    def get(self, e):
        out = []
        with open(e.store, "rb") as f:
            for shape, dtype, on_device in e.meta:
                a = numpy.empty(shape, dtype)
                if a.size:
                    n = f.readinto(a.reshape(-1).view(numpy.uint8))
                    if n != a.nbytes:
                        raise OSError(f"short read from {e.store}: {n} of {a.nbytes} bytes")
                out.append(backend.to_device(a) if on_device else a)
        os.remove(e.store)
        return out


class _PinnedIO:  # pragma: no cover - needs a GPU; verified by construction only
    """Device arrays -> pinned host memory -> fresh device arrays, on a non-blocking stream.

    The copy stream waits for an event recorded on the caller's (compute) stream at ``offload``,
    so it copies finished data. Destinations are allocated at ``prefetch`` in the caller's thread,
    on its stream (so the memory pool keeps them in that stream's arena when the caller frees
    them), and the copy in waits for an event recorded after that allocation. The worker thread
    blocks on an event recorded after the copies, so ``fetch`` returns complete arrays.
    """

    def __init__(self):
        import cupy
        import cupyx
        self.cp, self.cpx = cupy, cupyx
        self.device = cupy.cuda.Device().id
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.array_types = (cupy.ndarray,)      # host arrays in a CuPy cache stay where they are

    def put(self, e):
        with self.cp.cuda.Device(self.device), self.stream:
            self.stream.wait_event(e.ready)
            hosts = []
            for a in e.arrays:
                a = self.cp.ascontiguousarray(a)                   # on the copy stream
                h = self.cpx.empty_pinned(a.shape, a.dtype)
                a.get(stream=self.stream, out=h)
                hosts.append(h)
            self.stream.record().synchronize()
        e.store = hosts

    def reserve(self, e):
        """Caller thread, at ``prefetch``: allocate the destinations on the compute stream."""
        e.restored = [self.cp.empty(shape, dtype) for shape, dtype, _ in e.meta]
        e.ready_in = self.cp.cuda.get_current_stream().record()

    def get(self, e):
        with self.cp.cuda.Device(self.device), self.stream:
            self.stream.wait_event(e.ready_in)
            for d, h in zip(e.restored, e.store):
                d.set(h, stream=self.stream)
            self.stream.record().synchronize()
        e.store = e.ready_in = None
        return e.restored


def _work(jobs, io, bandwidth, stats):
    """Worker loop: run ``("out"|"in", entry)`` jobs in order until ``None``."""
    while True:
        job = jobs.get()
        if job is None:
            return
        direction, e = job
        t0 = time.perf_counter()
        try:
            if e.error is not None:                       # the copy out failed: nothing to read
                continue
            if direction == "out":
                io.put(e)
                e.stored = True
            else:
                e.restored = io.get(e)
                e.stored = False
            dt = time.perf_counter() - t0
            if bandwidth is not None and e.nbytes / bandwidth > dt:
                time.sleep(e.nbytes / bandwidth - dt)
            stats[f"bytes_{direction}"] += e.nbytes
            stats["transfers"] += 1
        except Exception as exc:
            traceback.clear_frames(exc.__traceback__)     # the frames' locals hold the sources
            e.error = (direction, exc)
        finally:
            if direction == "out":
                e.arrays = e.ready = None                 # drop every reference to the sources
                e.out_done.set()
            else:
                e.in_done.set()
            stats[f"seconds_{direction}"] += time.perf_counter() - t0
            job = e = None


def _shutdown(jobs, thread, directory):
    """Stop the worker after the queued transfers and delete the spill directory."""
    jobs.put(None)
    thread.join()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class OffloadChannel:
    """One transfer at a time, in issue order, on a background worker (a single thread on NumPy; a
    dedicated CUDA stream on CuPy, driven by that thread).

    Parameters: ``kind`` is ``"file"`` (host arrays -> a file on disk -> fresh heap arrays),
    ``"pinned"`` (CuPy: device -> pinned host memory, async copies on a separate stream) or
    ``"auto"`` (``"pinned"`` on CuPy, else ``"file"``). ``directory``: the file channel makes its own
    spill directory *inside* it (default: the system temp dir); :meth:`close` removes that spill
    directory (``self.directory``), never the given one. ``bandwidth``: bytes/s to emulate (the
    worker sleeps ``max(0, n/bandwidth - t)`` after a transfer of ``n`` bytes that took ``t`` s).

    ``stats``: ``bytes_out``, ``bytes_in``, ``seconds_out``, ``seconds_in`` (worker busy time per
    direction, emulated sleeps included) and ``transfers``.
    """

    def __init__(self, kind: str = "auto", directory: str | None = None,
                 bandwidth: float | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown offload kind {kind!r}; expected one of {KINDS}")
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
        if kind == "auto":
            kind = "file" if backend.xp is numpy else "pinned"
        if kind == "pinned" and backend.xp is numpy:
            raise ValueError("offload kind 'pinned' needs the CuPy backend (device 'gpu')")
        self.kind, self.bandwidth = kind, bandwidth
        self.directory = None
        if kind == "file":
            self.directory = tempfile.mkdtemp(prefix="hpcnn-offload-", dir=directory)
            self._io = _FileIO(self.directory)
        else:  # pragma: no cover - CuPy
            self._io = _PinnedIO()
        self.stats = {"bytes_out": 0, "bytes_in": 0, "seconds_out": 0.0, "seconds_in": 0.0,
                      "transfers": 0}
        self._entries, self._seq, self._closed = {}, 0, False
        self._jobs = queue.SimpleQueue()
        thread = threading.Thread(target=_work, name="hpcnn-offload", daemon=True,
                                  args=(self._jobs, self._io, bandwidth, self.stats))
        thread.start()
        self._finalize = weakref.finalize(self, _shutdown, self._jobs, thread, self.directory)

    def offload(self, key, obj) -> None:
        """Start moving the arrays of ``obj`` out; ``key`` (hashable) must not be held already."""
        self._check_open()
        if key in self._entries:
            raise ValueError(f"offload key {key!r} is already held by the channel")
        skeleton, arrays = _flatten(obj, self._io.array_types)
        meta = [(a.shape, a.dtype, not isinstance(a, numpy.ndarray)) for a in arrays]
        ready = None if self.kind == "file" else backend.xp.cuda.get_current_stream().record()
        e = _Entry(key, self._seq, skeleton, arrays, meta, ready)
        self._seq += 1
        self._entries[key] = e
        self._jobs.put(("out", e))

    def offloaded(self, key) -> bool:
        """True once the copy out of ``key`` has ended (the sources are then no longer referenced)."""
        return self._entry(key).out_done.is_set()

    def wait_offload(self, key) -> None:
        """Block until the copy out of ``key`` has ended; raise :class:`OffloadError` if it failed."""
        e = self._entry(key)
        e.out_done.wait()
        self._raise(e)

    def prefetch(self, key) -> None:
        """Start bringing ``key`` back (runs after every transfer issued before it); idempotent."""
        e = self._entry(key)
        if not e.prefetched:
            e.prefetched = True
            if self.kind == "pinned":  # pragma: no cover - CuPy
                self._io.reserve(e)
            self._jobs.put(("in", e))

    def fetch(self, key):
        """Wait for the prefetch of ``key`` (issued here if it was not) and return the cache.

        Same structure, dtypes, shapes and values bit for bit, in fresh C-contiguous arrays (heap
        ndarrays on NumPy, not memmaps); the key is then forgotten.
        """
        self.prefetch(key)
        e = self._entries[key]
        e.in_done.wait()
        del self._entries[key]
        self._raise(e)
        return _unflatten(e.skeleton, e.restored)

    def held_bytes(self) -> int:
        """Bytes held outside working memory: copies out ended, copies back not yet ended."""
        self._check_open()
        return sum(e.nbytes for e in list(self._entries.values()) if e.stored)

    def close(self) -> None:
        """Wait for outstanding transfers, stop the worker, delete the spill files; idempotent.

        Raises :class:`OffloadError` for a failed transfer that no wait/fetch has reported yet.
        """
        if self._closed:
            return
        self._closed = True
        self._finalize()
        pending = [e for e in self._entries.values() if e.error is not None and not e.reported]
        self._entries.clear()
        if pending:
            self._raise(pending[0])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("offload channel is closed")

    def _entry(self, key):
        self._check_open()
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"offload key {key!r} is not held by the channel "
                           f"(never offloaded, or already fetched)") from None

    def _raise(self, e):
        if e.error is not None:
            direction, exc = e.error
            e.reported = True
            raise OffloadError(f"offload channel: copy {direction} of key {e.key!r} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
