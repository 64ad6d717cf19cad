"""Allreduce algorithms on point-to-point MPI: the segmented ring and recursive doubling.

Run by :mod:`.algorithms` (the front end: algorithm choice, calibration), which see for the
algorithms' costs. Also the helpers the other algorithms share: :func:`flat_view` and
:func:`split`. The private communicator, tags and scratch buffers are the communicator's
:class:`~.state.Workspace` (``comm.collectives.get_workspace()``).
"""
from __future__ import annotations

import math
import time
from collections import deque

import numpy

from hpcnn import backend
from hpcnn.parallel.collectives.mpi_base import Request, _mpi
from hpcnn.parallel.collectives.watchdog import leave

SEGMENT_BYTES = 1 << 20     # ring segment: 2 x 1 MiB of scratch stay in L2 (4 MiB); 256 KiB was slower
ISEGMENT_BYTES = 8 << 20    # non-blocking ring: a test() call completes about one segment
WINDOW = 2                  # segments in flight: the next transfer runs while one is being summed


def flat_view(buf):
    """``buf`` as a 1-d view; ValueError unless C-contiguous."""
    if not buf.flags.c_contiguous:
        raise ValueError(f"allreduce needs a C-contiguous buffer, got shape {buf.shape} "
                         f"strides {buf.strides}")
    return buf.reshape(-1)


def split(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` pieces of ``n`` elements, the first n % parts one longer."""
    q, r = divmod(n, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


class RingRequest(Request):
    """A segmented ring allreduce as a progress state machine (no threads).

    ``test()`` completes whatever arrived, sums it, posts the next Isend/Irecv pairs and returns
    ``done`` without blocking; ``wait()`` runs it to the end. Seconds recorded in ``comm.stats``
    on completion: the time spent inside ``test()`` and ``wait()`` (the part not hidden).
    """

    def __init__(self, comm, buf, on_done=None, blocking=False):
        p, r = comm.size, comm.rank
        nb = 2 * (p - 1) * buf.nbytes // p
        super().__init__([], comm.stats, "iallreduce", nb, time.perf_counter(), on_done)
        self.where = comm.name
        self._blocking, self._busy = blocking, 0.0
        st = comm.collectives.get_workspace()
        self._st, self._pc, self._tag = st, st.pcomm, st.tag()
        flat = self._buf = flat_view(buf)
        self._left, self._right = (r - 1) % p, (r + 1) % p
        seg = (getattr(comm, "allreduce_segment_bytes", SEGMENT_BYTES) if blocking
               else getattr(comm, "iallreduce_segment_bytes", ISEGMENT_BYTES))
        seg = max(1, seg // flat.itemsize)
        self._cb, self._sb = split(flat.size, p), {}
        self._nseg = max(1, math.ceil(math.ceil(flat.size / p) / seg))
        self._w = min(WINDOW, self._nseg)
        need = self._w * math.ceil(math.ceil(flat.size / p) / self._nseg)
        self._scr = (st.blocking_scratch(flat.dtype, need) if blocking
                     else st.take(flat.dtype, need))
        self._slot = len(self._scr) // self._w
        self._xp = numpy if isinstance(flat, numpy.ndarray) else backend.xp
        self._p, self._r = p, r
        self._total = 2 * (p - 1) * self._nseg if flat.size else 0
        self._next = self._ndone = 0
        self._inflight = deque()
        if self._total == 0:
            self._complete_all(0.0)
        else:
            self._post()

    @property
    def progress(self) -> float:
        """Fraction of the ring's transfers completed so far (1.0 when done)."""
        return self._ndone / self._total if self._total else 1.0

    def _segment(self, chunk, k):
        a, b = self._cb[chunk], self._cb[chunk + 1]
        sb = self._sb.get(b - a)
        if sb is None:
            sb = self._sb[b - a] = split(b - a, self._nseg)
        return self._buf[a + sb[k]:a + sb[k + 1]]

    def _post(self):
        nseg, p, r = self._nseg, self._p, self._r
        while (len(self._inflight) < self._w and self._next < self._total
               and (self._next < nseg or self._ndone > self._next - nseg)):
            i = self._next
            step, k = divmod(i, nseg)
            if step < p - 1:        # reduce-scatter: receive into scratch, sum at completion
                send = self._segment((r - step) % p, k)
                dst = self._segment((r - step - 1) % p, k)
                off = (i % self._w) * self._slot
                recv = self._scr[off:off + dst.size]
            else:                   # all-gather: receive the owner's reduced chunk in place
                s = step - (p - 1)
                send, dst = self._segment((r + 1 - s) % p, k), None
                recv = self._segment((r - s) % p, k)
            reqs = [self._pc.Irecv(recv, self._left, self._tag),
                    self._pc.Isend(send, self._right, self._tag)]
            self._inflight.append((reqs, dst, recv))
            self._next += 1

    def _progress(self, block: bool) -> bool:
        MPI = _mpi()
        while self._inflight:
            reqs, dst, recv = self._inflight[0]
            if block:
                MPI.Request.Waitall(reqs)
            elif not MPI.Request.Testall(reqs):
                return False
            self._inflight.popleft()
            if dst is not None:
                self._xp.add(dst, recv, out=dst)
                backend.sync()
            self._ndone += 1
            self._post()
        return True

    def _complete_all(self, busy):
        if self._blocking:
            self.done = True
        else:
            self._st.pool.append(self._scr)
            self._finish(busy)

    def _run(self, block: bool) -> bool:
        if not self.done:
            t = time.perf_counter()
            fin = self._progress(block)
            self._busy += time.perf_counter() - t
            if fin:
                self._complete_all(self._busy)
        return self.done

    def test(self) -> bool:
        return self._run(block=False)

    def wait(self) -> None:
        prev = self._enter_wait()
        try:
            self._run(block=True)
        finally:
            leave(prev)


def rd(comm, flat) -> None:
    """Recursive doubling in place, on pieces of at most ``SEGMENT_BYTES`` (bounded scratch)."""
    st = comm.collectives.get_workspace()
    xp = numpy if isinstance(flat, numpy.ndarray) else backend.xp
    piece = max(1, getattr(comm, "allreduce_segment_bytes", SEGMENT_BYTES) // flat.itemsize)
    tmp = st.blocking_scratch(flat.dtype, min(piece, flat.size))
    tag = st.tag()
    for a in range(0, flat.size, piece):
        part = flat[a:a + piece]
        _rd_piece(comm, st.pcomm, tag, xp, part, tmp[:part.size])


def _rd_piece(comm, pc, tag, xp, flat, tmp) -> None:
    """One recursive doubling; non-power-of-two p folds the first 2r ranks in pairs."""
    p, r = comm.size, comm.rank
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2
    if r < 2 * rem:                         # fold: odd ranks take their even neighbour's sum
        if r % 2 == 0:
            pc.Send(flat, r + 1, tag)
        else:
            pc.Recv(tmp, r - 1, tag)
            xp.add(tmp, flat, out=flat)     # lower rank first
    if r >= 2 * rem or r % 2:
        me = r // 2 if r < 2 * rem else r - rem
        mask = 1
        while mask < p2:
            q = me ^ mask
            peer = 2 * q + 1 if q < rem else q + rem
            backend.sync()
            pc.Sendrecv(flat, peer, tag, tmp, peer, tag)
            if me < q:
                xp.add(flat, tmp, out=flat)
            else:
                xp.add(tmp, flat, out=flat)
            mask <<= 1
    if r < 2 * rem:                         # unfold: odd ranks hand the result back
        backend.sync()
        if r % 2:
            pc.Send(flat, r - 1, tag)
        else:
            pc.Recv(flat, r + 1, tag)
