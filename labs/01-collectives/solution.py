"""Lab 1, reference solution: a ring allreduce from Sendrecv, and its alpha-beta model.

Graded by ``python labs/01-collectives/grade.py labs/01-collectives/solution.py``.
"""
import numpy as np


def ring_allreduce(comm, buf):
    """Sum the float64 array ``buf`` over every rank of ``comm`` in place; return ``buf``.

    p ranks in a ring: rank r sends to its right neighbour (r + 1) % p and receives from its
    left neighbour (r - 1) % p, with ``comm.Sendrecv`` only. The buffer is cut into p chunks
    (the first n % p chunks one element longer). Reduce-scatter, p - 1 steps: at step k rank r
    sends chunk r - k and adds the chunk r - k - 1 it receives to its own; after it, rank r
    holds chunk r + 1 summed over all ranks. All-gather, p - 1 steps: at step k rank r sends
    chunk r + 1 - k and receives chunk r - k, already summed.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    flat = buf.reshape(-1)                                 # a view: (n,)
    q, extra = divmod(flat.size, p)
    start = [c * q + min(c, extra) for c in range(p + 1)]  # chunk c: flat[start[c]:start[c+1]]

    def chunk(c):
        c %= p
        return flat[start[c]:start[c + 1]]

    right, left = (r + 1) % p, (r - 1) % p
    got = np.empty(start[1], dtype=flat.dtype)             # the largest chunk: chunk 0
    for k in range(p - 1):                                 # reduce-scatter
        mine = chunk(r - k - 1)
        comm.Sendrecv(chunk(r - k), dest=right, recvbuf=got[:mine.size], source=left)
        mine += got[:mine.size]
    for k in range(p - 1):                                 # all-gather
        comm.Sendrecv(chunk(r + 1 - k), dest=right, recvbuf=chunk(r - k), source=left)
    return buf


def ring_model(alpha, beta, nbytes, p):
    """Seconds of a ring allreduce of ``nbytes`` on ``p`` ranks in the alpha-beta model:
    2 (p - 1) messages of alpha seconds each, and 2 (p - 1) / p * nbytes bytes sent at beta
    seconds per byte. ``nbytes`` may be an array."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * np.asarray(nbytes, dtype=float) * beta


def fit_alpha_beta(nbytes, seconds, p):
    """Least-squares (alpha, beta) of :func:`ring_model` to measured ``seconds`` at ``nbytes``
    (two arrays of the same length) on ``p`` ranks."""
    nbytes = np.asarray(nbytes, dtype=float)
    a = np.column_stack([ring_model(1.0, 0.0, nbytes, p), ring_model(0.0, 1.0, nbytes, p)])
    (alpha, beta), *_ = np.linalg.lstsq(a, np.asarray(seconds, dtype=float), rcond=None)
    return float(alpha), float(beta)
