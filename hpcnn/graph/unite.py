"""Unite and conquer: co-operating thick-restart Lanczos instances on disjoint groups of ranks.

After Emad, Petiton and Edjlali's multiple explicitly restarted Arnoldi method (SIAM J. Sci.
Comput. 27, 2005), for a symmetric matrix. The ranks of ``comm`` are split (``comm.split``) into
ℓ = ``len(subspaces)`` equal groups; group g runs :class:`~hpcnn.graph.krylov.ThickRestartLanczos`
with basis size ``subspaces[g]`` and start vector ``seed + g`` over its own row partition of the
matrix. At the end of every cycle the instances compare the largest residual estimate of their k
wanted Ritz pairs (one ``allgather`` of a number per rank); the best instance's restart state
(its ``keep`` best Ritz vectors, their values and the residual direction: a valid thick restart
for any instance) is broadcast to the others, which restart from it instead of their own. All
stop when the best instance has converged and return its eigenpairs.

Our variant is synchronous (cycles in lockstep; the instances wait for the slowest at each
exchange) and sends the whole thick-restart state, ``keep + 1`` vectors, where ERAM sends one
restarting vector. Groups have equal sizes so that rank j of every group owns the same rows:
the exchange is a ``Bcast`` over the "cross" communicator of the ranks j of all groups.

    mpiexec -n 4 python -m mpi4py tests/mpi/graph_unite.py
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from hpcnn.graph.krylov import (DistributedMatrix, ThickRestartLanczos, basis_sizes,
                                true_residuals)
from hpcnn.parallel.collectives import as_communicator


@dataclass
class UniteResult:
    values: np.ndarray        # (k,) largest algebraic eigenvalues, decreasing
    vectors: np.ndarray       # (n_local, k) this rank's rows (of its group's partition)
    residuals: np.ndarray     # (k,) ||A v - λ v||
    cycles: int               # restart cycles (the same for every instance: lockstep)
    adopted: np.ndarray       # (ℓ,) restarts at which each instance took another's state
    matvecs: np.ndarray       # (ℓ,) matvecs of each instance
    exchange_bytes: int       # bytes this rank received in restart-state broadcasts
    group: int                # this rank's group
    converged: bool


def unite_and_conquer(a: sp.spmatrix, comm, k: int, subspaces=(20, 30), tol: float = 1e-10,
                      max_cycles: int = 1000, seed: int = 0,
                      history: list | None = None) -> UniteResult:
    """The ``k`` largest eigenpairs of the symmetric ``a`` (held whole on every rank) by
    ``len(subspaces)`` co-operating Lanczos instances on disjoint rank groups of ``comm``.
    ``history``: a list that gets, after every cycle, (seconds since the call, each instance's
    largest relative residual estimate of the k wanted pairs, before the exchange)."""
    import time

    t0 = time.perf_counter()
    comm = as_communicator(comm, "graph")
    size, rank = comm.size, comm.rank
    count = len(subspaces)
    if count < 1 or size % count:
        raise ValueError(f"unite_and_conquer: {size} ranks cannot form {count} equal groups")
    sizes = [basis_sizes(a.shape[0], k, m, None) for m in subspaces]     # refuses bad k / m alike
    group, member = divmod(rank, size // count)
    local = comm.split(group, member, "graph.group")
    cross = comm.split(member, group, "graph.cross")                  # rank `member` of every group
    op = DistributedMatrix.from_global(a, comm=local)
    m, keep = sizes[group]
    it = ThickRestartLanczos(op, k, m, keep, tol, seed + group)
    adopted, received, cycles = np.zeros(count, dtype=np.int64), 0, 0
    while True:
        it.cycle()
        worst = cross.allgather_objects(it.worst())                      # (ℓ,) the same on every member
        best = int(np.argmin(worst))
        converged = worst[best] <= tol
        if history is not None:
            history.append((time.perf_counter() - t0, [float(w) for w in worst]))
        if converged or cycles == max_cycles:
            break
        cycles += 1
        p = sizes[best][1]
        Y, r, theta = map(np.ascontiguousarray, it.restart_state()) if group == best else (
            np.empty((op.n_local, p)), np.empty(op.n_local), np.empty(p))
        for buf in (Y, r, theta):
            cross.bcast(buf, root=best)
        if group == best:
            it.restart()
        else:
            q = min(p, keep)                                     # at most this instance's keep
            it.restart_from(np.ascontiguousarray(Y[:, :q]), r, theta[:q])
            adopted[group] += 1
            received += Y.nbytes + r.nbytes + theta.nbytes
    values = it.theta[:k].copy() if group == best else np.empty(k)
    vectors = np.ascontiguousarray(it.ritz_vectors()) if group == best else np.empty((op.n_local, k))
    cross.bcast(values, root=best)
    cross.bcast(vectors, root=best)
    residuals = true_residuals(op, values, vectors)
    comm.allreduce_max(adopted)           # each group counted its own
    matvecs = np.array(cross.allgather_objects(op.matvecs - k), dtype=np.int64)
    local.free()
    cross.free()
    return UniteResult(values, vectors, residuals, cycles, adopted, matvecs, received, group,
                       bool(converged))
