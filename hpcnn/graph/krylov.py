"""Distributed sparse matvec and thick-restart Lanczos for a few eigenpairs of a symmetric matrix.

The matrix is split by rows (:mod:`hpcnn.graph.partition`); each rank holds its rows and the
matching entries of every vector. A matvec is one halo exchange (``Alltoallv`` of the precomputed
send/receive lists) then a local sparse product; inner products and norms are local sums followed
by an ``Allreduce``. With ``comm=None`` the same code runs serially on one process, without MPI.

Thick-restart Lanczos (Wu and Simon, SIAM J. Matrix Anal. Appl. 22, 2000), with full
reorthogonalisation: a cycle extends an orthonormal basis V (n x m) of a Krylov space by
``w = A v_j``, orthogonalised twice against all of V (classical Gram-Schmidt twice: two allreduces
of j numbers per step, the parallel-friendly choice), so that ``T = Vᵀ A V`` is filled column by
column. The Ritz pairs (θ_i, V s_i) of T are accepted when the residual estimate
``|β_m s_{m,i}| = ||A V s_i - θ_i V s_i||`` is below ``tol * max|θ|``. Otherwise the cycle restarts
from the ``keep`` best Ritz vectors plus the last basis vector: T restarts as diag(θ) bordered by
``β_m s_{m,i}`` (an arrowhead), which the next step recomputes exactly.

    mpiexec -n 2 python -m mpi4py -c "..."     # see tests/mpi/graph_lanczos.py for a full use
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from hpcnn.graph.partition import Halo, RowPartition, build_halo


def _allreduce(comm, x: np.ndarray) -> np.ndarray:
    """Sum of ``x`` over the ranks of ``comm`` (``x`` itself when ``comm`` is None)."""
    if comm is None:
        return x
    from mpi4py import MPI
    out = np.empty_like(x)
    comm.Allreduce(np.ascontiguousarray(x), out, op=MPI.SUM)
    return out


class DistributedMatrix:
    """This rank's rows of a square sparse matrix and the halo exchange its matvec needs.

    ``comm`` is an mpi4py communicator (or None: one process, no MPI). Counters: ``matvecs``,
    ``bytes_sent`` (halo bytes this rank sent). ``rows`` are the global rows held here.
    """

    def __init__(self, halo: Halo, n_global: int, comm=None):
        self.halo, self.n_global, self.comm = halo, n_global, comm
        self.rows = halo.rows
        self.matvecs = 0
        self.bytes_sent = 0
        s, r = halo.send_counts, halo.recv_counts
        self._send_spec = (s, np.concatenate([[0], np.cumsum(s)[:-1]]).astype(np.int64))
        self._recv_spec = (r, np.concatenate([[0], np.cumsum(r)[:-1]]).astype(np.int64))

    @classmethod
    def from_global(cls, a: sp.spmatrix, part: RowPartition | None = None, comm=None):
        """From the whole matrix held on every rank: the contiguous partition by default."""
        size = 1 if comm is None else comm.Get_size()
        rank = 0 if comm is None else comm.Get_rank()
        part = part or RowPartition.contiguous(a.shape[0], size)
        if part.size != size:
            raise ValueError(f"DistributedMatrix: partition of {part.size} ranks on {size} ranks")
        return cls(build_halo(a, part, rank, comm), a.shape[0], comm)

    @property
    def n_local(self) -> int:
        return self.rows.size

    def exchange(self, x_local: np.ndarray) -> np.ndarray:
        """``[x_local, ghosts]``: this rank's entries then the halo received from the others."""
        h = self.halo
        if h.ghosts.size == 0 and h.send_index.size == 0:
            return x_local
        from mpi4py import MPI
        ext = np.empty(self.n_local + h.ghosts.size)
        ext[: self.n_local] = x_local
        send = x_local[h.send_index]                                   # (sum send_counts,)
        recv = ext[self.n_local:]
        self.comm.Alltoallv([send, self._send_spec, MPI.DOUBLE], [recv, self._recv_spec, MPI.DOUBLE])
        self.bytes_sent += send.nbytes
        return ext

    def matvec(self, x_local: np.ndarray) -> np.ndarray:
        """This rank's rows of ``A x`` (x given by its local entries)."""
        self.matvecs += 1
        return self.halo.local @ self.exchange(x_local)

    def dot(self, a: np.ndarray, b: np.ndarray) -> float:
        return float(_allreduce(self.comm, np.array([a @ b]))[0])

    def norm(self, a: np.ndarray) -> float:
        return float(np.sqrt(self.dot(a, a)))

    def global_random(self, seed: int) -> np.ndarray:
        """This rank's entries of a standard normal n-vector: the same vector on any rank count."""
        return np.random.default_rng(seed).standard_normal(self.n_global)[self.rows]


@dataclass
class LanczosResult:
    values: np.ndarray        # (k,) largest algebraic eigenvalues, decreasing
    vectors: np.ndarray       # (n_local, k) this rank's rows of the eigenvectors (orthonormal)
    residuals: np.ndarray     # (k,) ||A v - λ v|| computed with one more matvec per vector
    restarts: int
    matvecs: int              # in the iteration (the k residual checks not counted)
    converged: bool
    bytes_sent: int           # halo bytes this rank sent during the iteration


def _orthogonalize(op: DistributedMatrix, basis: np.ndarray, w: np.ndarray):
    """w minus its projection on the orthonormal columns of ``basis``, twice; -> (w, coefficients)."""
    h = _allreduce(op.comm, basis.T @ w)                      # (j,)
    w = w - basis @ h
    h2 = _allreduce(op.comm, basis.T @ w)
    return w - basis @ h2, h + h2


def lanczos(op: DistributedMatrix, k: int, m: int | None = None, tol: float = 1e-10,
            max_restarts: int = 1000, seed: int = 0, keep: int | None = None) -> LanczosResult:
    """The ``k`` largest algebraic eigenpairs of the symmetric matrix behind ``op``.

    ``m``: the basis size per cycle (default ``max(2k + 1, 20)``, at most n - 1); ``keep``: Ritz
    vectors kept at a restart (default ``(k + m) // 2``); ``tol``: residual over max|θ|; ``seed``:
    the start vector, the same global vector whatever the number of ranks. Every rank must call
    it with the same arguments (checked before the first collective on each rank alike).
    """
    n = op.n_global
    m = min(max(2 * k + 1, 20) if m is None else m, n - 1)
    keep = (k + m) // 2 if keep is None else keep
    if not (1 <= k < m <= n - 1 and k <= keep < m):
        raise ValueError(f"lanczos: need 1 <= k={k} <= keep={keep} < m={m} <= n-1={n - 1}")
    start_matvecs, start_bytes = op.matvecs, op.bytes_sent
    V = np.zeros((op.n_local, m + 1))                        # (n_local, m+1) the basis
    T = np.zeros((m, m))                                     # Vᵀ A V
    v = op.global_random(seed)
    V[:, 0] = v / op.norm(v)
    first, beta, restarts, converged = 0, 0.0, 0, False
    while True:
        for j in range(first, m):
            w, h = _orthogonalize(op, V[:, : j + 1], op.matvec(V[:, j]))
            T[: j + 1, j] = h
            T[j, : j + 1] = h
            beta = op.norm(w)
            if beta <= 1e-12 * max(1.0, abs(h[j])):           # invariant subspace: a fresh direction
                w, _ = _orthogonalize(op, V[:, : j + 1], op.global_random(seed + 1 + j))
                w, _ = _orthogonalize(op, V[:, : j + 1], w)
                V[:, j + 1] = w / op.norm(w)
                beta = 0.0                                    # no coupling to the new direction
                continue
            V[:, j + 1] = w / beta
        theta, S = np.linalg.eigh(T)
        order = np.argsort(theta)[::-1]
        theta, S = theta[order], S[:, order]
        estimates = np.abs(beta * S[m - 1, :])
        scale = max(np.abs(theta).max(), np.finfo(float).tiny)
        converged = bool(np.all(estimates[:k] <= tol * scale))
        if converged or restarts == max_restarts:
            break
        restarts += 1
        V[:, :keep] = V[:, :m] @ S[:, :keep]                 # thick restart: the best Ritz vectors
        V[:, keep] = V[:, m]
        T[:] = 0.0
        T[np.arange(keep), np.arange(keep)] = theta[:keep]
        first = keep
    vectors = V[:, :m] @ S[:, :k]                            # (n_local, k)
    matvecs, sent = op.matvecs - start_matvecs, op.bytes_sent - start_bytes
    residuals = np.array([op.norm(op.matvec(vectors[:, i]) - theta[i] * vectors[:, i])
                          for i in range(k)])
    return LanczosResult(theta[:k].copy(), vectors, residuals, restarts, matvecs, converged, sent)
