"""The ring allreduce written out with Sendrecv, for reading: the twin of :mod:`.ring`.

p ranks in a ring, the buffer cut into p chunks (the first n % p one element longer). A
reduce-scatter of p-1 steps: at step k, rank r sends chunk r-k to its right neighbour and adds
chunk r-k-1 from its left to its own, so that after the last step rank r holds chunk r+1 summed
over every rank. Then an all-gather of p-1 steps passes the finished chunks around the ring.
Each rank sends and receives 2 (p-1) n / p elements, whatever p.

Each element is summed in the order of :class:`.ring.RingRequest` (its own value plus the
partial sum from the left), so the result is bit-for-bit the fast path's
(``Communicator.allreduce(buf, algorithm="ring")``, which segments the chunks and overlaps the
transfers); the library's ``MPI_Allreduce`` may add in another order (``tests/mpi/plain_twins.py``).
Nothing in the package uses this module.
"""
from __future__ import annotations

from hpcnn import backend


def allreduce(comm, buf):
    """Sum ``buf`` (C-contiguous) over the Communicator ``comm`` in place; returns ``buf``."""
    p, r = comm.size, comm.rank
    flat = buf.reshape(-1)                                 # a view: (n,)
    q, extra = divmod(flat.size, p)
    start = [c * q + min(c, extra) for c in range(p + 1)]  # chunk c: flat[start[c]:start[c+1]]

    def chunk(c):
        c %= p
        return flat[start[c]:start[c + 1]]

    left, right = (r - 1) % p, (r + 1) % p
    got = backend.xp.empty(start[1], dtype=flat.dtype)     # the largest chunk: chunk 0
    for k in range(p - 1):                   # reduce-scatter
        mine = chunk(r - k - 1)
        comm.sendrecv(chunk(r - k), right, got[:mine.size], left)
        mine += got[:mine.size]              # its own value + the partial sum from the left
    for k in range(p - 1):                   # all-gather: chunk r+1 is complete here
        comm.sendrecv(chunk(r + 1 - k), right, chunk(r - k), left)
    return buf
