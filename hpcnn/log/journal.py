"""All-or-nothing updates of an HDF5 file: a rollback journal under h5py's file-object driver.

HDF5 updates a file in place (B-tree nodes, object headers, the superblock's end of file) and
appends data after them; a write cut short (a full disk, SIGKILL, power loss) can leave a file
HDF5 no longer opens. Here h5py opens the file through :class:`JournaledFile`, a Python file
object that keeps every write in memory. :meth:`JournaledFile.commit` then makes them reach the
disk in an order that can always be undone:

1. the *journal* ``<file>-journal`` receives the file's committed size and the original bytes of
   every region about to be overwritten, with a CRC-32 of the whole at its end (and is fsync'ed);
2. the writes go to the file (which is fsync'ed);
3. the journal is emptied: the update is committed.

A journal that is whole (its CRC matches) is *hot*: the file may hold part of an update. Putting
the saved bytes back and cutting the file to the saved size gives the last committed file
exactly; :func:`rollback` does it on disk (the writer, before its next update) and
:func:`committed_view` in memory (readers, which never modify the file). A journal cut short
was never followed by a write to the file, so it is ignored. A failed commit (``OSError``, e.g.
ENOSPC) rolls the file back before raising. Power loss is covered by the two fsyncs (``durable``);
without them a SIGKILL is still covered, since every write that returned is in the OS's cache.
"""
from __future__ import annotations

import os
import struct
import zlib

import numpy as np

MAGIC = b"HPCNNJ1\n"
_HEAD = struct.Struct("<8sQI")         # magic, committed size, number of regions
_REGION = struct.Struct("<QI")         # offset, length (then the original bytes)
_TAIL = struct.Struct("<I")            # CRC-32 of everything before it


def journal_path(path: str) -> str:
    return path + "-journal"


def _write_all(fd: int, data, offset: int) -> None:
    """``pwrite`` until all of ``data`` is written (a short write is retried, an error raised)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _merged(intervals) -> list[tuple[int, int]]:
    """The union of half-open intervals ``(start, end)``, sorted, overlapping ones merged."""
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def encode(size: int, regions: list[tuple[int, bytes]]) -> bytes:
    """A journal: committed ``size`` and the original bytes of each ``(offset, bytes)`` region."""
    parts = [_HEAD.pack(MAGIC, size, len(regions))]
    for off, data in regions:
        parts += [_REGION.pack(off, len(data)), data]
    body = b"".join(parts)
    return body + _TAIL.pack(zlib.crc32(body))


def decode(blob: bytes) -> tuple[int, list[tuple[int, bytes]]] | None:
    """``(size, regions)`` of a whole journal; None if ``blob`` is empty, cut short or damaged."""
    if len(blob) < _HEAD.size + _TAIL.size:
        return None
    body, (crc,) = blob[:-_TAIL.size], _TAIL.unpack(blob[-_TAIL.size:])
    magic, size, count = _HEAD.unpack_from(body)
    if magic != MAGIC or zlib.crc32(body) != crc:
        return None
    regions, pos = [], _HEAD.size
    for _ in range(count):
        off, n = _REGION.unpack_from(body, pos)
        pos += _REGION.size
        regions.append((off, bytes(body[pos:pos + n])))
        pos += n
    return (size, regions) if pos == len(body) else None


def read_journal(path: str):
    """The hot journal of the file at ``path`` as ``(size, regions)``, or None."""
    try:
        with open(journal_path(path), "rb") as f:
            return decode(f.read())
    except FileNotFoundError:
        return None


def rollback(path: str) -> bool:
    """Undo on disk the interrupted update of ``path`` if its journal is hot; True if it was."""
    hot = read_journal(path)
    if hot is not None:
        size, regions = hot
        fd = os.open(path, os.O_RDWR)
        try:
            for off, data in regions:
                _write_all(fd, data, off)
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
    if os.path.exists(journal_path(path)):
        os.truncate(journal_path(path), 0)
    return hot is not None


class _Overlay:
    """Bytes of a base file (up to ``base_size``) with writes laid over them, read at any offset.
    The file-object interface h5py's ``fileobj`` driver uses: seek, tell, readinto, write,
    truncate, flush."""

    def __init__(self, fd: int, base_size: int, writes=()):
        self.fd = fd
        self.base_size = base_size     # base bytes beyond it are not part of the file (zeros)
        self.size = base_size
        self.writes: list[tuple[int, bytes]] = list(writes)
        self.pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset + (0, self.pos, self.size)[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read_into(self, offset: int, buf) -> int:
        """Fill ``buf`` (a writable byte buffer) from ``offset``; returns the bytes read."""
        out = memoryview(buf).cast("B")
        n = max(0, min(len(out), self.size - offset))
        base = max(0, min(n, self.base_size - offset))
        got = os.preadv(self.fd, [out[:base]], offset) if base else 0
        out[got:n] = bytes(n - got)               # beyond the base file: zeros
        for off, data in self.writes:            # in order: a later write wins
            lo, hi = max(off, offset), min(off + len(data), offset + n)
            if lo < hi:
                out[lo - offset:hi - offset] = data[lo - off:hi - off]
        return n

    def read_at(self, offset: int, n: int) -> bytes:
        buf = bytearray(max(0, min(n, self.size - offset)))
        self.read_into(offset, buf)
        return bytes(buf)

    def read(self, n: int = -1) -> bytes:
        data = self.read_at(self.pos, self.size - self.pos if n is None or n < 0 else n)
        self.pos += len(data)
        return data

    def readinto(self, buf) -> int:
        n = self.read_into(self.pos, buf)
        self.pos += n
        return n

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class JournaledFile(_Overlay):
    """An HDF5 file opened for update: every write held in memory until :meth:`commit`.

    ``JournaledFile(path)`` first rolls back an interrupted update (hot journal). Use it as
    ``h5py.File(jf, "r+")``, close the h5py file, then ``jf.commit()``; or ``jf.discard()``.
    """

    def __init__(self, path: str, *, durable: bool = True):
        self.path = os.fspath(path)
        rollback(self.path)
        fd = os.open(self.path, os.O_RDWR)
        super().__init__(fd, os.fstat(fd).st_size)
        self.committed_size = self.base_size
        self.durable = durable

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        self.writes.append((self.pos, data))
        self.pos += len(data)
        self.size = max(self.size, self.pos)
        return len(data)

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else size
        if size < self.size:
            self.writes = [(o, d[:size - o]) for o, d in self.writes if o < size]
            self.base_size = min(self.base_size, size)
        self.size = size
        return size

    def _changes(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """``(writes, saved)``: the bytes this update changes, and the committed bytes they
        replace (to put back on failure), found by comparing with the file. HDF5 rewrites a
        partly filled chunk whole at each append; only its new tail differs, so only that is
        journaled and written."""
        writes, saved = [], []
        for a, b in _merged((o, min(o + len(d), self.size)) for o, d in self.writes):
            if a >= b:
                continue
            new = self.read_at(a, b - a)
            n_old = max(0, min(b, self.committed_size) - a)
            old = os.pread(self.fd, n_old, a) if n_old else b""
            differs = np.flatnonzero(np.frombuffer(new, np.uint8, n_old)
                                     != np.frombuffer(old, np.uint8, len(old)))
            start = int(differs[0]) if differs.size else n_old
            end = b - a if b > self.committed_size else (int(differs[-1]) + 1 if differs.size else 0)
            if start < end:
                writes.append((a + start, new[start:end]))
                if start < len(old):
                    saved.append((a + start, old[start:min(end, len(old))]))
        if self.size < self.committed_size:
            saved.append((self.size, os.pread(self.fd, self.committed_size - self.size, self.size)))
        return writes, saved

    def commit(self) -> None:
        """Journal, write, sync, empty the journal; on OSError the file is rolled back, then raised."""
        writes, saved = self._changes()
        if not writes and self.size == self.committed_size:
            return self.discard()
        jfd = os.open(journal_path(self.path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                blob = encode(self.committed_size, saved)
                _write_all(jfd, blob, 0)
                os.ftruncate(jfd, len(blob))
                if self.durable:
                    os.fsync(jfd)
            except OSError:
                os.ftruncate(jfd, 0)             # the file was not touched: nothing to undo
                raise
            try:
                for off, data in writes:
                    _write_all(self.fd, data, off)
                os.ftruncate(self.fd, self.size)
                if self.durable:
                    os.fsync(self.fd)
            except OSError:
                for off, data in saved:          # in place: needs no new space
                    _write_all(self.fd, data, off)
                os.ftruncate(self.fd, self.committed_size)
                os.ftruncate(jfd, 0)
                raise
            os.ftruncate(jfd, 0)                 # committed
        finally:
            os.close(jfd)
            self.discard()

    def discard(self) -> None:
        """Forget the held writes and close the file (the file on disk stays as committed)."""
        self.writes = []
        self.close()


def committed_view(path: str) -> _Overlay | None:
    """A read-only file object showing the last committed state of ``path`` if its journal is
    hot (for readers: the file is not modified), else None (open the file itself)."""
    hot = read_journal(path)
    if hot is None:
        return None
    size, regions = hot
    view = _Overlay(os.open(path, os.O_RDONLY), size, regions)
    view.size = size
    return view
