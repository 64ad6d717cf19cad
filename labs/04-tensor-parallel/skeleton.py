"""Lab 4: column- and row-parallel linear layers, their conjugate
collectives, and a parallel MLP block (Megatron-LM).

A weight is ``(n_in, n_out)``: y = x @ w + b, x ``(batch, n_in)``. Each of p ranks keeps a part
of every weight; ``comm`` is an mpi4py communicator over those p ranks. Gradients accumulate
(``dw += ...``) as in any framework: two backwards without zeroing add up.

Copy this file to student.py in this folder, write what raises NotImplementedError, then grade
it: ``make lab N=4`` (or ``python labs/04-tensor-parallel/grade.py``).
"""
import numpy as np
from mpi4py import MPI


def shard_columns(w, p, r):
    """Rank r's part of ``w`` cut by columns (output features): ``w[:, r k:(r+1) k]``, k =
    n_out / p. Also a bias ``(n_out,)``: ``b[r k:(r+1) k]``."""
    raise NotImplementedError


def shard_rows(w, p, r):
    """Rank r's part of ``w`` cut by rows (input features): ``w[r k:(r+1) k, :]``, k = n_in / p."""
    raise NotImplementedError


# Megatron's conjugate pair: f is the identity forward and an allreduce backward; g the reverse.
def f_forward(comm, x):
    """Enter the parallel region: every rank already holds x; return it unchanged."""
    raise NotImplementedError


def f_backward(comm, dx):
    """The input gradient of the parallel region: each rank holds a partial sum; return the
    sum over the ranks (a new array)."""
    raise NotImplementedError


def g_forward(comm, y):
    """Leave the parallel region: each rank holds a partial sum of y; return the sum."""
    raise NotImplementedError


def g_backward(comm, dy):
    """Every rank needs the whole output gradient, which it already holds: return it unchanged."""
    raise NotImplementedError


class ColumnParallelLinear:
    """y_r = x @ w[:, part r] + b[part r]: each rank computes its columns of the output."""

    def __init__(self, comm, w, b):
        p, r = comm.Get_size(), comm.Get_rank()
        self.comm, self.w, self.b = comm, shard_columns(w, p, r), shard_columns(b, p, r)
        self.dw, self.db = np.zeros_like(self.w), np.zeros_like(self.b)

    def forward(self, x):
        """x ``(batch, n_in)``, the same on every rank -> (y_r ``(batch, n_out / p)``, cache)."""
        raise NotImplementedError

    def backward(self, dy, cache):
        """dy_r ``(batch, n_out / p)`` -> dx ``(batch, n_in)``, summed over the ranks;
        accumulates this rank's ``dw`` and ``db``."""
        raise NotImplementedError


class RowParallelLinear:
    """y = sum_r x_r @ w[part r, :] + b: each rank holds a part of the input features."""

    def __init__(self, comm, w, b):
        p, r = comm.Get_size(), comm.Get_rank()
        self.comm, self.w, self.b = comm, shard_rows(w, p, r), np.array(b, copy=True)
        self.dw, self.db = np.zeros_like(self.w), np.zeros_like(self.b)

    def forward(self, x):
        """x_r ``(batch, n_in / p)`` -> (y ``(batch, n_out)``, the same on every rank, cache).
        The bias is added once, after the sum."""
        raise NotImplementedError

    def backward(self, dy, cache):
        """dy ``(batch, n_out)``, the same on every rank -> dx_r ``(batch, n_in / p)``;
        accumulates ``dw`` (this rank's rows) and ``db`` (the whole bias, on every rank)."""
        raise NotImplementedError


class ParallelMLP:
    """Megatron's MLP block: column-parallel (n, h), ReLU on each rank's h / p columns,
    row-parallel (h, n). One allreduce in the forward, one in the backward."""

    def __init__(self, comm, w1, b1, w2, b2):
        self.fc1 = ColumnParallelLinear(comm, w1, b1)
        self.fc2 = RowParallelLinear(comm, w2, b2)

    def forward(self, x):
        """x ``(batch, n)`` -> (y ``(batch, n)``, cache); the same y on every rank."""
        raise NotImplementedError

    def backward(self, dy, cache):
        """dy ``(batch, n)`` -> dx ``(batch, n)``; accumulates both layers' gradients."""
        raise NotImplementedError
