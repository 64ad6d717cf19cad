"""Unite and conquer (two co-operating Lanczos instances) against ARPACK and against one instance.

    mpiexec -n N python -m mpi4py tests/mpi/graph_unite.py        # N even

On the normalised adjacency of an SBM: the k largest eigenvalues equal eigsh's to 1e-8 relative
with small true residuals on every rank of both groups; the instances exchanged restart states;
the co-operation needs no more cycles than the better instance alone, and the result is the same
for groups of one rank (N=2) and of two (N=4).
"""
import numpy as np
import scipy.sparse.linalg as sla
from mpi4py import MPI

from hpcnn.graph import (DistributedMatrix, lanczos, largest_component, normalized_adjacency, sbm,
                         unite_and_conquer)

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
K, TOL, SUBSPACES = 4, 1e-10, (10, 16)

a = normalized_adjacency(largest_component(sbm(1500, blocks=4, avg_degree=8, seed=2)).adjacency)
ref = np.sort(sla.eigsh(a, K, which="LA", tol=TOL)[0])[::-1]
history = []
res = unite_and_conquer(a, comm, K, subspaces=SUBSPACES, tol=TOL, seed=1, history=history)
assert res.converged
assert len(history) == res.cycles + 1 and min(history[-1][1]) <= TOL, history[-1]
assert all(min(h[1]) > TOL and len(h[1]) == len(SUBSPACES) for h in history[:-1])
assert np.max(np.abs(res.values - ref) / np.abs(ref)) < 1e-8, (res.values, ref)
assert res.residuals.max() < 1e-8, res.residuals
assert res.adopted.sum() > 0, res.adopted                               # states were exchanged
alone = [lanczos(DistributedMatrix.from_global(a), K, m=m, tol=TOL, seed=1 + g).restarts
         for g, m in enumerate(SUBSPACES)]
assert res.cycles <= min(alone), (res.cycles, alone)
gram = np.empty((K, K))
group_comm = comm.Split(color=res.group, key=rank)
group_comm.Allreduce(res.vectors.T @ res.vectors, gram)
assert np.allclose(gram, np.eye(K), atol=1e-10)
if rank == 0:
    print(f"values {res.values.tolist()} cycles {res.cycles} (alone {alone}) adopted "
          f"{res.adopted.tolist()} matvecs {res.matvecs.tolist()} received {res.exchange_bytes} B")
    print(f"OK on {size} ranks")
