"""Allreduce algorithms on point-to-point MPI: segmented ring, recursive doubling, auto.

Called by :meth:`hpcnn.parallel.comm.Communicator.allreduce` (which times and counts them)::

    comm.allreduce(buf, algorithm="ring")      # mpi | ring | rd | auto; in place, sums
    comm.allreduce_table = calibrate(comm)     # once at start-up: "auto" then uses the table
    req = comm.iallreduce(buf, algorithm="ring")
    ...; req.test(); ...                       # between blocks of compute: advances the ring
    req.wait()

``ring``: reduce-scatter then all-gather, p-1 steps each, on p chunks of the flat buffer (sizes
differ by at most one element), each chunk split into the same number of segments of at most
``comm.allreduce_segment_bytes`` (default :data:`SEGMENT_BYTES`) so that a window of
:data:`WINDOW` segments is in flight while the previous one is summed from a cached scratch buffer
(Patarasuk & Yuan, J. Parallel Distrib. Comput. 69, 2009; Thakur et al., IJHPCA 19, 2005, sec. 4).
Cost 2(p-1) nseg alpha + 2(p-1)/p n beta. The non-blocking ring (:class:`RingRequest`) segments
by ``comm.iallreduce_segment_bytes`` (:data:`ISEGMENT_BYTES`): a ``test()`` call completes about
one segment, so fewer, larger segments go further between blocks of compute.
``rd``: recursive doubling, log2 p exchanges (Thakur et al., sec. 4) on pieces of at most the
segment size; for p not a power of two the first 2r ranks fold in pairs first
(r = p - 2^floor(log2 p)) and get the result back at the end. Cost log2 p (alpha + n beta).
``mpi``: the library's Allreduce. ``auto``: per message size, from ``comm.allreduce_table``
(:func:`calibrate`) or else :data:`DEFAULT_TABLE`.

Sums are taken in the buffer's dtype, in another order than the library's, so results agree with
``mpi`` to rounding; but every rank ends with bitwise the same array (the ring's all-gather copies
each reduced chunk from one owner; rd adds the lower rank's operand first and IEEE addition is
commutative). Traffic goes over a private duplicate of the communicator, made on first use (call
:func:`free` to release it), with one tag per call so that several non-blocking rings can be in
flight at once; like any collective, calls must be made in the same order on every rank.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.comm import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.arange(5.0); c.allreduce(a, algorithm='ring'); print(a)"
"""
from __future__ import annotations

import math
import time
from collections import deque

import numpy

from hpcnn import backend as B
from hpcnn.parallel.comm import Request, _cuda_aware, _mpi, host_buffers

ALGORITHMS = ("mpi", "ring", "rd", "auto")
SEGMENT_BYTES = 1 << 20     # ring segment: 2 x 1 MiB of scratch stay in L2 (4 MiB); 256 KiB was slower
ISEGMENT_BYTES = 8 << 20    # non-blocking ring: a test() call completes about one segment
WINDOW = 2                  # segments in flight: the next transfer runs while one is being summed
MARGIN = 0.03               # calibrate: another algorithm must beat mpi by 3 % to be chosen
# Without calibration: the nearest size in log2 wins, so mpi below 8 MiB, ring from 8 MiB. Measured
# (benchmarks/allreduce.py, MPICH and Open MPI wheels, 2 and 4 ranks): mpi is fastest up to 4 MiB
# (Python costs ~20 us a ring step), the ring is on par at 16 MiB and 1.4-1.9x faster from 64 MiB.
DEFAULT_TABLE = {"sizes": [1 << 10, 1 << 22, 1 << 24], "choice": ["mpi", "mpi", "ring"]}
IALLREDUCE_RING_BYTES = 2 << 20   # iallreduce "auto": the ring from 2 MiB (library's below)
_TAGS = 30000               # MPI guarantees tags up to 32767


class _State:
    """Per-Communicator state: the private communicator, the tag counter, scratch buffers."""

    def __init__(self, comm):
        self.pcomm, self.seq = comm.comm.Dup(), 0
        self.scratch, self.pool = {}, []    # dtype -> array for blocking calls; free arrays

    def tag(self) -> int:
        self.seq += 1
        return 1 + self.seq % _TAGS

    def blocking_scratch(self, dtype, n):
        a = self.scratch.get(dtype)
        if a is None or a.size < n:
            a = self.scratch[dtype] = B.xp.empty(max(n, 1), dtype)
        return a[:n]

    def take(self, dtype, n):
        for i, a in enumerate(self.pool):
            if a.dtype == dtype and a.size >= n:
                return self.pool.pop(i)
        return B.xp.empty(max(n, 1), dtype)


def _state(comm) -> _State:
    st = getattr(comm, "_allreduce_state", None)
    if st is None:
        st = comm._allreduce_state = _State(comm)
    return st


def free(comm) -> None:
    """Free the private communicator and scratch buffers made for ``comm`` (collective)."""
    st = getattr(comm, "_allreduce_state", None)
    if st is not None:
        st.pcomm.Free()
        comm._allreduce_state = None


def _flat(buf):
    if not buf.flags.c_contiguous:
        raise ValueError(f"allreduce needs a C-contiguous buffer, got shape {buf.shape} "
                         f"strides {buf.strides}")
    return buf.reshape(-1)


def _split(n: int, parts: int) -> list[int]:
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
        self._blocking, self._busy = blocking, 0.0
        st = _state(comm)
        self._st, self._pc, self._tag = st, st.pcomm, st.tag()
        flat = self._buf = _flat(buf)
        self._left, self._right = (r - 1) % p, (r + 1) % p
        seg = (getattr(comm, "allreduce_segment_bytes", SEGMENT_BYTES) if blocking
               else getattr(comm, "iallreduce_segment_bytes", ISEGMENT_BYTES))
        seg = max(1, seg // flat.itemsize)
        self._cb, self._sb = _split(flat.size, p), {}
        self._nseg = max(1, math.ceil(math.ceil(flat.size / p) / seg))
        self._w = min(WINDOW, self._nseg)
        need = self._w * math.ceil(math.ceil(flat.size / p) / self._nseg)
        self._scr = (st.blocking_scratch(flat.dtype, need) if blocking
                     else st.take(flat.dtype, need))
        self._slot = len(self._scr) // self._w
        self._xp = numpy if isinstance(flat, numpy.ndarray) else B.xp
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
            sb = self._sb[b - a] = _split(b - a, self._nseg)
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
                B.sync()
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
        self._run(block=True)


def _rd(comm, flat) -> None:
    """Recursive doubling in place, on pieces of at most ``SEGMENT_BYTES`` (bounded scratch)."""
    st = _state(comm)
    xp = numpy if isinstance(flat, numpy.ndarray) else B.xp
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
            B.sync()
            pc.Sendrecv(flat, peer, tag, tmp, peer, tag)
            if me < q:
                xp.add(flat, tmp, out=flat)
            else:
                xp.add(tmp, flat, out=flat)
            mask <<= 1
    if r < 2 * rem:                         # unfold: odd ranks hand the result back
        B.sync()
        if r % 2:
            pc.Send(flat, r - 1, tag)
        else:
            pc.Recv(flat, r + 1, tag)


def choose(comm, nbytes: int) -> str:
    """The algorithm ``auto`` runs for ``nbytes``: the choice at the nearest size (in log2) of
    ``comm.allreduce_table`` if set (see :func:`calibrate`), else of :data:`DEFAULT_TABLE`."""
    table = getattr(comm, "allreduce_table", None) or DEFAULT_TABLE
    cache = getattr(comm, "_allreduce_choices", None)
    if cache is None or cache[0] is not table:      # a new table: forget the cached choices
        cache = comm._allreduce_choices = (table, {})
    alg = cache[1].get(nbytes)
    if alg is None:
        x = math.log2(max(nbytes, 1))
        i = min(range(len(table["sizes"])),
                key=lambda j: (abs(math.log2(table["sizes"][j]) - x), j))
        alg = cache[1][nbytes] = table["choice"][i]
    return alg


def allreduce(comm, buf, algorithm: str = "auto"):
    """Sum ``buf`` (C-contiguous, any shape) over ``comm`` (a Communicator) in place; returns it."""
    if algorithm == "auto":
        algorithm = choose(comm, buf.nbytes)
    elif algorithm not in ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    flat = _flat(buf)
    if comm.size == 1 or flat.size == 0:
        return buf
    MPI = _mpi()
    if algorithm == "mpi" and isinstance(buf, numpy.ndarray):   # the small-message fast path
        comm.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf
    with host_buffers(flat, writeback=(0,)) as (h,):
        if algorithm == "mpi":
            comm.comm.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM)
        elif algorithm == "rd":
            _rd(comm, h)
        else:
            RingRequest(comm, h, blocking=True).wait()
    return buf


def iallreduce(comm, buf, algorithm: str = "ring", on_done=None) -> Request:
    """Start a non-blocking in-place sum: ``"ring"`` (:class:`RingRequest`), ``"mpi"`` (the
    library's Iallreduce) or ``"auto"`` (ring from :data:`IALLREDUCE_RING_BYTES`)."""
    if algorithm == "auto":
        algorithm = "ring" if buf.nbytes >= IALLREDUCE_RING_BYTES else "mpi"
    if algorithm not in ("ring", "mpi"):
        raise ValueError(f"unknown iallreduce algorithm {algorithm!r}; expected ring, mpi or auto")
    if algorithm == "mpi" or comm.size == 1:
        return comm.iallreduce(buf, on_done=on_done)
    B.sync()
    if B.xp is not numpy and not _cuda_aware():  # pragma: no cover - CuPy staging: blocking
        t0 = time.perf_counter()
        allreduce(comm, buf, "ring")
        r = Request([], comm.stats, "iallreduce", 0, t0, on_done)
        r._finish(time.perf_counter() - t0)
        return r
    return RingRequest(comm, buf, on_done)


def iallreduce_ring(comm, buf, on_done=None) -> RingRequest:
    """Start a segmented ring allreduce of ``buf`` in place; progress it with ``test()``."""
    return iallreduce(comm, buf, "ring", on_done)


def calibrate(comm, sizes=None, repeats=None, algorithms=("mpi", "ring", "rd"),
              dtype=numpy.float32) -> dict:
    """Time each algorithm at each size (bytes) and return the table ``auto`` reads.

    Every rank's median is reduced with MAX before choosing, so all ranks choose alike; an
    algorithm other than ``mpi`` is chosen only if it beats ``mpi`` by :data:`MARGIN`. Repeats
    (default: fewer for big sizes) are interleaved across algorithms to share drifts. Returns
    ``{"sizes", "choice", "times": {algorithm: max-median seconds}, "p"}``; store it as
    ``comm.allreduce_table``.
    """
    MPI = _mpi()
    sizes = list(sizes or [1 << k for k in range(10, 27, 2)])
    algorithms = list(algorithms)
    t = numpy.zeros((len(sizes), len(algorithms)))
    for i, nbytes in enumerate(sizes):
        buf = B.xp.zeros(max(1, nbytes // numpy.dtype(dtype).itemsize), dtype)
        reps = repeats or max(5, min(200, (1 << 25) // max(nbytes, 1)))  # ~1 s at p=2
        ts = [[] for _ in algorithms]
        for rep in range(reps + 1):
            for j, a in enumerate(algorithms):
                comm.comm.Barrier()
                t0 = time.perf_counter()
                allreduce(comm, buf, a)
                if rep:                     # the first round warms up
                    ts[j].append(time.perf_counter() - t0)
        t[i] = [numpy.median(x) for x in ts]
    comm.comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    best = [algorithms[int(numpy.argmin(ti))] for ti in t]
    if "mpi" in algorithms:                 # keep mpi unless clearly beaten
        m = t[:, algorithms.index("mpi")]
        best = [a if ti.min() <= (1 - MARGIN) * mi else "mpi" for a, ti, mi in zip(best, t, m)]
    choice = best
    return {"sizes": sizes, "choice": choice, "p": comm.size,
            "times": {a: t[:, j].tolist() for j, a in enumerate(algorithms)}}
