"""Lab 4, reference solution: column- and row-parallel linear layers, their conjugate
collectives, and a parallel MLP block (Megatron-LM).

A weight is ``(n_in, n_out)``: y = x @ w + b, x ``(batch, n_in)``. Each of p ranks keeps a part
of every weight; ``comm`` is an mpi4py communicator over those p ranks. Gradients accumulate
(``dw += ...``) as in any framework: two backwards without zeroing add up.

Graded by ``python labs/04-tensor-parallel/grade.py labs/04-tensor-parallel/solution.py``.
"""
import numpy as np
from mpi4py import MPI


def shard_columns(w, p, r):
    """Rank r's part of ``w`` cut by columns (output features): ``w[:, r k:(r+1) k]``, k =
    n_out / p. Also a bias ``(n_out,)``: ``b[r k:(r+1) k]``."""
    k = w.shape[-1] // p
    return w[..., r * k:(r + 1) * k].copy()


def shard_rows(w, p, r):
    """Rank r's part of ``w`` cut by rows (input features): ``w[r k:(r+1) k, :]``, k = n_in / p."""
    k = w.shape[0] // p
    return w[r * k:(r + 1) * k].copy()


# Megatron's conjugate pair: f is the identity forward and an allreduce backward; g the reverse.
def f_forward(comm, x):
    """Enter the parallel region: every rank already holds x; return it unchanged."""
    return x


def f_backward(comm, dx):
    """The input gradient of the parallel region: each rank holds a partial sum; return the
    sum over the ranks (a new array)."""
    out = np.array(dx, copy=True)
    comm.Allreduce(MPI.IN_PLACE, out)
    return out


def g_forward(comm, y):
    """Leave the parallel region: each rank holds a partial sum of y; return the sum."""
    out = np.array(y, copy=True)
    comm.Allreduce(MPI.IN_PLACE, out)
    return out


def g_backward(comm, dy):
    """Every rank needs the whole output gradient, which it already holds: return it unchanged."""
    return dy


class ColumnParallelLinear:
    """y_r = x @ w[:, part r] + b[part r]: each rank computes its columns of the output."""

    def __init__(self, comm, w, b):
        p, r = comm.Get_size(), comm.Get_rank()
        self.comm, self.w, self.b = comm, shard_columns(w, p, r), shard_columns(b, p, r)
        self.dw, self.db = np.zeros_like(self.w), np.zeros_like(self.b)

    def forward(self, x):
        """x ``(batch, n_in)``, the same on every rank -> (y_r ``(batch, n_out / p)``, cache)."""
        x = f_forward(self.comm, x)
        return x @ self.w + self.b, x

    def backward(self, dy, cache):
        """dy_r ``(batch, n_out / p)`` -> dx ``(batch, n_in)``, summed over the ranks;
        accumulates this rank's ``dw`` and ``db``."""
        x = cache
        self.dw += x.T @ dy
        self.db += dy.sum(axis=0)
        return f_backward(self.comm, dy @ self.w.T)


class RowParallelLinear:
    """y = sum_r x_r @ w[part r, :] + b: each rank holds a part of the input features."""

    def __init__(self, comm, w, b):
        p, r = comm.Get_size(), comm.Get_rank()
        self.comm, self.w, self.b = comm, shard_rows(w, p, r), np.array(b, copy=True)
        self.dw, self.db = np.zeros_like(self.w), np.zeros_like(self.b)

    def forward(self, x):
        """x_r ``(batch, n_in / p)`` -> (y ``(batch, n_out)``, the same on every rank, cache).
        The bias is added once, after the sum."""
        return g_forward(self.comm, x @ self.w) + self.b, x

    def backward(self, dy, cache):
        """dy ``(batch, n_out)``, the same on every rank -> dx_r ``(batch, n_in / p)``;
        accumulates ``dw`` (this rank's rows) and ``db`` (the whole bias, on every rank)."""
        x = cache
        dy = g_backward(self.comm, dy)
        self.dw += x.T @ dy
        self.db += dy.sum(axis=0)
        return dy @ self.w.T


class ParallelMLP:
    """Megatron's MLP block: column-parallel (n, h), ReLU on each rank's h / p columns,
    row-parallel (h, n). One allreduce in the forward, one in the backward."""

    def __init__(self, comm, w1, b1, w2, b2):
        self.fc1 = ColumnParallelLinear(comm, w1, b1)
        self.fc2 = RowParallelLinear(comm, w2, b2)

    def forward(self, x):
        """x ``(batch, n)`` -> (y ``(batch, n)``, cache); the same y on every rank."""
        h, c1 = self.fc1.forward(x)               # (batch, h / p)
        a = np.maximum(h, 0.0)                    # (batch, h / p)
        y, c2 = self.fc2.forward(a)               # (batch, n)
        return y, (c1, h, c2)

    def backward(self, dy, cache):
        """dy ``(batch, n)`` -> dx ``(batch, n)``; accumulates both layers' gradients."""
        c1, h, c2 = cache
        da = self.fc2.backward(dy, c2)            # (batch, h / p)
        return self.fc1.backward(da * (h > 0), c1)
