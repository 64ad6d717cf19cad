"""Lab 1: a ring allreduce from Sendrecv, and its alpha-beta model.

Copy this file to student.py in this folder, write the three functions, then grade it:

    cp labs/01-collectives/skeleton.py labs/01-collectives/student.py
    make lab N=1          # or: python labs/01-collectives/grade.py

``comm`` is an mpi4py communicator (``MPI.COMM_WORLD`` in the grader). Use its buffer method
``comm.Sendrecv(sendbuf, dest=..., recvbuf=..., source=...)``; nothing else is allowed here.
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
    # Hints: work on a flat view, flat = buf.reshape(-1); chunk c % p is a slice of it, so a
    # received chunk can land in place; n may be smaller than p (some chunks are empty).
    raise NotImplementedError


def ring_model(alpha, beta, nbytes, p):
    """Seconds of a ring allreduce of ``nbytes`` on ``p`` ranks in the alpha-beta model:
    2 (p - 1) messages of alpha seconds each, and 2 (p - 1) / p * nbytes bytes sent at beta
    seconds per byte. ``nbytes`` may be an array."""
    raise NotImplementedError


def fit_alpha_beta(nbytes, seconds, p):
    """Least-squares (alpha, beta) of :func:`ring_model` to measured ``seconds`` at ``nbytes``
    (two arrays of the same length) on ``p`` ranks."""
    # Hint: the model is linear in (alpha, beta): np.linalg.lstsq on two columns.
    raise NotImplementedError
