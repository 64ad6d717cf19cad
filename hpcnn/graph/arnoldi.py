"""Explicitly restarted Arnoldi (ERAM) over a row partition, for non-symmetric sparse matrices.

The restarted Arnoldi method of the "unite and conquer" line of work (Emad, Petiton, Edjlali,
SIAM J. Sci. Comput. 2005; ../shared/REFERENCES.md section 4), on the distributed matrix of
:mod:`.krylov` (matvec: one halo exchange and a local sparse product; inner products: one
allreduce). One cycle:

1. an m-step Arnoldi basis V (n x (m+1), classical Gram-Schmidt applied twice) and the Hessenberg
   matrix H ((m+1) x m), the same on every rank (it is built from allreduced dots);
2. the Ritz pairs (theta_i, V_m y_i) of H_m = H[:m, :m], the k of largest real part wanted; the
   residual estimate of pair i is |h_{m+1,m}| |e_m^T y_i| (Saad, "Numerical methods for large
   eigenvalue problems", 2011, section 6.3);
3. stop when every wanted estimate is at most ``tol`` x |theta_i|; else restart from the real
   part of sum_i rho_i u_i (rho_i the residual estimates: the pairs furthest from converged
   weigh most, Saad's choice), normalised.

One restart vector, as in the paper's ERAM (our Lanczos, :mod:`.krylov`, keeps several: thick
restart). The matrix is general: its eigenvalues may be complex; the results are complex arrays
(real where the spectrum is). Every rank must call it with the same arguments.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hpcnn.graph.krylov import DistributedMatrix, _allreduce


@dataclass
class ArnoldiResult:
    values: np.ndarray        # (k,) eigenvalues of largest real part, decreasing real part
    vectors: np.ndarray       # (n_local, k) this rank's rows of the unit eigenvectors (complex)
    residuals: np.ndarray     # (k,) ||A v - λ v||, one more matvec per vector
    restarts: int
    matvecs: int              # in the iteration (the k residual checks not counted)
    converged: bool


def _cycle(op: DistributedMatrix, v0: np.ndarray, m: int):
    """(V, H) of an m-step Arnoldi process from the unit vector v0; a lucky breakdown
    (h_{j+1,j} = 0: an invariant subspace) ends the basis early, H cut to its size."""
    V = np.zeros((op.n_local, m + 1))
    H = np.zeros((m + 1, m))
    V[:, 0] = v0
    for j in range(m):
        w = op.matvec(V[:, j])
        h = _allreduce(op.comm, V[:, : j + 1].T @ w)
        w = w - V[:, : j + 1] @ h
        h2 = _allreduce(op.comm, V[:, : j + 1].T @ w)          # Gram-Schmidt twice
        w = w - V[:, : j + 1] @ h2
        H[: j + 1, j] = h + h2
        H[j + 1, j] = op.norm(w)
        if H[j + 1, j] <= 1e-14 * np.abs(H[: j + 2, : j + 1]).max():
            return V[:, : j + 2], H[: j + 2, : j + 1]
        V[:, j + 1] = w / H[j + 1, j]
    return V, H


def arnoldi(op: DistributedMatrix, k: int, m: int | None = None, tol: float = 1e-10,
            max_restarts: int = 2000, seed: int = 0, history: list | None = None) -> ArnoldiResult:
    """The ``k`` eigenpairs of largest real part of the (general) matrix behind ``op``, by
    explicitly restarted Arnoldi (module docstring). ``m``: the basis size (default
    ``max(2k + 1, 20)``, at most n - 1); ``seed``: the start vector, the same global vector on any
    number of ranks; ``history`` gets (seconds, the largest relative residual estimate) per
    cycle. ValueError naming the sizes unless 1 <= k < m < n."""
    t0 = time.perf_counter()
    n = op.n_global
    m = min(max(2 * k + 1, 20) if m is None else m, n - 1)
    if not 1 <= k < m <= n - 1:
        raise ValueError(f"arnoldi: need 1 <= k={k} < m={m} <= n-1={n - 1}")
    start = op.matvecs
    v = op.global_random(seed)
    v = v / op.norm(v)
    restarts = 0
    while True:
        V, H = _cycle(op, v, m)
        size = H.shape[1]
        theta, Y = np.linalg.eig(H[:size, :size])
        order = np.argsort(-theta.real, kind="stable")[:k]
        theta, Y = theta[order], Y[:, order]
        rho = abs(H[size, size - 1]) * np.abs(Y[-1, :]) if H.shape[0] > size else np.zeros(k)
        worst = float(np.max(rho / np.maximum(np.abs(theta), 1e-300)))
        if history is not None:
            history.append((time.perf_counter() - t0, worst))
        U = V[:, :size] @ Y                                     # (n_local, k), complex
        if worst <= tol or restarts == max_restarts:
            break
        restarts += 1
        v = (U @ (rho if rho.any() else np.ones(k))).real
        v = v / op.norm(v)
    matvecs = op.matvecs - start
    norms = np.sqrt(np.array([float(_allreduce(op.comm, np.array([np.vdot(U[:, i], U[:, i]).real]))[0])
                              for i in range(k)]))
    U = U / norms
    res = np.array([np.sqrt(_complex_norm_sq(op, op.matvec(U[:, i].real) + 1j * op.matvec(U[:, i].imag)
                                              - theta[i] * U[:, i])) for i in range(k)])
    return ArnoldiResult(theta, U, res, restarts, matvecs, worst <= tol)


def _complex_norm_sq(op: DistributedMatrix, z: np.ndarray) -> float:
    return float(_allreduce(op.comm, np.array([np.vdot(z, z).real]))[0])


__all__ = ["ArnoldiResult", "arnoldi"]
