"""Spectral features on several ranks equal the one-process ones, row for row.

    mpiexec -n N python -m mpi4py tests/mpi/graph_spectral.py

Les Misérables and an SBM (largest component), contiguous and round-robin row partitions: each
rank's rows of ``[X, U_k]`` equal the serial features' rows to 1e-8 (the same sign whatever the
rank count and start vector: :func:`hpcnn.graph.spectral.sign_normalize`).
"""
import numpy as np
from mpi4py import MPI

from hpcnn.graph import RowPartition, largest_component, les_miserables, sbm
from hpcnn.graph.spectral import spectral_features

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

for g in (les_miserables(), largest_component(sbm(2000, blocks=3, avg_degree=8, seed=4))):
    serial = spectral_features(g, 3, seed=1)                     # one process, no MPI
    for part in (None, RowPartition.from_parts(np.arange(g.n_nodes) % size, size)):
        local = spectral_features(g, 3, comm=comm, part=part, seed=2)
        rows = (part or RowPartition.contiguous(g.n_nodes, size)).rows(rank)
        err = np.abs(local - serial[rows]).max()
        assert err < 1e-8, (g.name, rank, err)
comm.Barrier()
if rank == 0:
    print(f"OK on {size} ranks")
