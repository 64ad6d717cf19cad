"""Distributed sparse matvec and thick-restart Lanczos for a few eigenpairs of a symmetric matrix.

The matrix is split by rows (:mod:`hpcnn.graph.rows`); each rank holds its rows and the
matching entries of every vector. A matvec is one halo exchange (``Alltoallv`` of the precomputed
send/receive lists) then a local sparse product; inner products and norms are local sums followed
by an ``Allreduce``. With ``comm=None`` the same code runs serially on one process, with no MPI call.

Thick-restart Lanczos (Wu and Simon, SIAM J. Matrix Anal. Appl. 22, 2000), with full
reorthogonalisation: a cycle extends an orthonormal basis V (n x m) of a Krylov space by
``w = A v_j``, orthogonalised twice against all of V (classical Gram-Schmidt twice: two allreduces
of j numbers per step, the parallel-friendly choice), so that ``T = Vᵀ A V`` is filled column by
column. The Ritz pairs (θ_i, V s_i) of T are accepted when the residual estimate
``|β_m s_{m,i}| = ||A V s_i - θ_i V s_i||`` is below ``tol * max|θ|``. Otherwise the cycle restarts
from the ``keep`` best Ritz vectors plus the last basis vector: T restarts as diag(θ) bordered by
``β_m s_{m,i}`` (an arrowhead), which the next step recomputes exactly.

Example (``mpiexec -n 2 python -m mpi4py script.py``; without MPI pass ``comm=None``)::

    from hpcnn.graph import DistributedMatrix, karate_club, lanczos, normalized_adjacency
    from hpcnn.parallel.collectives import world
    a = normalized_adjacency(karate_club().adjacency)            # the whole matrix on every rank
    res = lanczos(DistributedMatrix.from_global(a, comm=world()), k=4)
    res.values, res.vectors                                      # (4,), (rows held here, 4)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from hpcnn.graph.rows import Halo, RowPartition, build_halo
from hpcnn.parallel.collectives import as_communicator


def _allreduce(comm, x: np.ndarray, op: str = "sum") -> np.ndarray:
    """``x`` reduced element-wise ("sum", "max" or "min") over the ranks of ``comm`` (``x``
    itself when ``comm`` is None)."""
    return x if comm is None else comm.reduce_array(x, op)


class DistributedMatrix:
    """This rank's rows of a square sparse matrix and the halo exchange its matvec needs.

    ``comm`` is a Communicator or an MPI communicator (or None: one process, no MPI). Counters: ``matvecs``,
    ``bytes_sent`` (halo bytes this rank sent). ``rows`` are the global rows held here.
    """

    def __init__(self, halo: Halo, n_global: int, comm=None):
        self.halo, self.n_global, self.comm = halo, n_global, as_communicator(comm, "graph")
        self.rows = halo.rows
        self.matvecs = 0
        self.bytes_sent = 0
        s, r = halo.send_counts, halo.recv_counts
        self._send_spec = (s, np.concatenate([[0], np.cumsum(s)[:-1]]).astype(np.int64))
        self._recv_spec = (r, np.concatenate([[0], np.cumsum(r)[:-1]]).astype(np.int64))

    @classmethod
    def from_global(cls, a: sp.spmatrix, part: RowPartition | None = None, comm=None):
        """From the whole matrix held on every rank: the contiguous partition by default."""
        comm = as_communicator(comm, "graph")
        size = 1 if comm is None else comm.size
        rank = 0 if comm is None else comm.rank
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
        if self.comm is None or self.comm.size == 1:
            return x_local                      # every rank calls alltoallv, even with nothing to move
        ext = np.empty(self.n_local + h.ghosts.size)
        ext[: self.n_local] = x_local
        send = x_local[h.send_index]                                   # (sum send_counts,)
        recv = ext[self.n_local:]
        self.comm.alltoallv(send, h.send_counts, recv, h.recv_counts)
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


def basis_sizes(n: int, k: int, m: int | None, keep: int | None) -> tuple[int, int]:
    """The basis size m (default ``max(2k + 1, 20)``, at most n - 1) and the Ritz vectors kept at a
    restart (default ``(k + m) // 2``); a ValueError naming them unless 1 <= k <= keep < m < n."""
    m = min(max(2 * k + 1, 20) if m is None else m, n - 1)
    keep = (k + m) // 2 if keep is None else keep
    if not (1 <= k < m <= n - 1 and k <= keep < m):
        raise ValueError(f"lanczos: need 1 <= k={k} <= keep={keep} < m={m} <= n-1={n - 1}")
    return m, keep


class ThickRestartLanczos:
    """The state of one thick-restart Lanczos iteration: basis V, projection T, last Ritz pairs.

    :meth:`cycle` extends the basis to m vectors and computes the Ritz pairs; :meth:`restart`
    keeps the best ``p`` Ritz vectors and the residual direction (own or, in unite and conquer,
    another instance's: :meth:`restart_state` and :meth:`restart_from`).
    """

    def __init__(self, op: DistributedMatrix, k: int, m: int, keep: int, tol: float, seed: int):
        self.op, self.k, self.m, self.keep, self.tol, self.seed = op, k, m, keep, tol, seed
        # (n_local, m+1) the basis, column-major: each basis vector is contiguous for the matvec
        self.V = np.zeros((op.n_local, m + 1), order="F")
        self.T = np.zeros((m, m))                                # Vᵀ A V
        v = op.global_random(seed)
        self.V[:, 0] = v / op.norm(v)
        self.first, self.beta = 0, 0.0
        self.theta = self.S = self.estimates = None

    def cycle(self) -> None:
        """Extend the basis from column ``first`` to m; the Ritz pairs, decreasing."""
        op, V, T = self.op, self.V, self.T
        for j in range(self.first, self.m):
            w, h = _orthogonalize(op, V[:, : j + 1], op.matvec(V[:, j]))
            T[: j + 1, j] = h
            T[j, : j + 1] = h
            self.beta = op.norm(w)
            if self.beta <= 1e-12 * max(1.0, abs(h[j])):         # invariant subspace: a fresh direction
                w, _ = _orthogonalize(op, V[:, : j + 1], op.global_random(self.seed + 1 + j))
                w, _ = _orthogonalize(op, V[:, : j + 1], w)
                V[:, j + 1] = w / op.norm(w)
                self.beta = 0.0                                  # no coupling to the new direction
                continue
            V[:, j + 1] = w / self.beta
        theta, S = np.linalg.eigh(T)
        order = np.argsort(theta)[::-1]
        self.theta, self.S = theta[order], S[:, order]
        self.estimates = np.abs(self.beta * self.S[self.m - 1, :])   # ||A y_i - θ_i y_i||

    def worst(self) -> float:
        """The largest residual estimate of the k wanted pairs over max|θ| (converged: <= tol)."""
        scale = max(np.abs(self.theta).max(), np.finfo(float).tiny)
        return float(self.estimates[: self.k].max() / scale)

    def restart_state(self, p: int | None = None):
        """-> (Y (n_local, p) the best Ritz vectors, r (n_local,) the residual direction, θ (p,))."""
        p = self.keep if p is None else p
        return self.V[:, : self.m] @ self.S[:, :p], self.V[:, self.m].copy(), self.theta[:p].copy()

    def restart_from(self, Y: np.ndarray, r: np.ndarray, theta: np.ndarray) -> None:
        """Restart on Ritz vectors Y with values θ and residual direction r (A Y = Y diag θ + r sᵀ)."""
        p = Y.shape[1]
        self.V[:, :p] = Y
        self.V[:, p] = r
        self.T[:] = 0.0
        self.T[np.arange(p), np.arange(p)] = theta
        self.first = p

    def restart(self) -> None:
        self.restart_from(*self.restart_state())

    def ritz_vectors(self) -> np.ndarray:
        return self.V[:, : self.m] @ self.S[:, : self.k]           # (n_local, k)


def true_residuals(op: DistributedMatrix, values: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """||A v_i - λ_i v_i|| for each column, one matvec each."""
    return np.array([op.norm(op.matvec(vectors[:, i]) - values[i] * vectors[:, i])
                     for i in range(values.size)])


def lanczos(op: DistributedMatrix, k: int, m: int | None = None, tol: float = 1e-10,
            max_restarts: int = 1000, seed: int = 0, keep: int | None = None,
            history: list | None = None) -> LanczosResult:
    """The ``k`` largest algebraic eigenpairs of the symmetric matrix behind ``op``.

    ``m``: the basis size per cycle (default ``max(2k + 1, 20)``, at most n - 1); ``keep``: Ritz
    vectors kept at a restart (default ``(k + m) // 2``); ``tol``: residual over max|θ|; ``seed``:
    the start vector, the same global vector whatever the number of ranks. Every rank must call
    it with the same arguments (the sizes are checked before the first collective). ``history``:
    a list that gets, after every cycle, (seconds since the call, the largest relative residual
    estimate of the k wanted pairs).
    """
    import time
    t0 = time.perf_counter()
    m, keep = basis_sizes(op.n_global, k, m, keep)
    start_matvecs, start_bytes = op.matvecs, op.bytes_sent
    it = ThickRestartLanczos(op, k, m, keep, tol, seed)
    restarts = 0
    while True:
        it.cycle()
        if history is not None:
            history.append((time.perf_counter() - t0, it.worst()))
        converged = it.worst() <= tol
        if converged or restarts == max_restarts:
            break
        restarts += 1
        it.restart()
    values, vectors = it.theta[:k].copy(), it.ritz_vectors()
    matvecs, sent = op.matvecs - start_matvecs, op.bytes_sent - start_bytes
    return LanczosResult(values, vectors, true_residuals(op, values, vectors), restarts, matvecs,
                         converged, sent)
