"""Distributed thick-restart Lanczos against ARPACK, and the halo lists against the serial ones.

    mpiexec -n N python -m mpi4py tests/mpi/graph_lanczos.py

On an SBM (largest component) and on Les Misérables, contiguous blocks and an explicit part
vector: the halo built with one alltoall equals the one built from the whole matrix; the
distributed matvec equals the serial product; the k largest eigenvalues of Â equal eigsh's to
1e-8 relative, with small true residuals, and equal the one-process run (same start vector);
explicitly restarted Arnoldi's on a non-symmetric random-walk matrix equal scipy's eigs to 1e-8.
"""
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as sla
from mpi4py import MPI

from hpcnn.graph import (DistributedMatrix, RowPartition, build_halo, lanczos, largest_component,
                         les_miserables, normalized_adjacency, sbm)

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
K, TOL = 4, 1e-10


def check(name, a, part):
    halo = build_halo(a, part, rank, comm)
    serial = build_halo(a, part, rank, None)
    from_rows = build_halo(a[part.rows(rank)], part, rank, comm)        # only this rank's rows
    assert (from_rows.local != halo.local).nnz == 0, name
    assert np.array_equal(halo.ghosts, serial.ghosts), name
    assert np.array_equal(halo.send_index, serial.send_index), name
    assert np.array_equal(halo.send_counts, serial.send_counts), name
    assert comm.allreduce(int(halo.send_counts.sum())) == comm.allreduce(halo.ghosts.size), name
    assert comm.allreduce(halo.ghosts.size) == sum(
        np.unique(a[part.rows(r)].indices[part.owner[a[part.rows(r)].indices] != r]).size
        for r in range(size)), name
    op = DistributedMatrix(halo, a.shape[0], comm)
    x = np.random.default_rng(7).standard_normal(a.shape[0])
    assert np.allclose(op.matvec(x[op.rows]), (a @ x)[op.rows], rtol=0, atol=1e-13), name

    ref = np.sort(sla.eigsh(a, K, which="LA", tol=TOL)[0])[::-1]
    res = lanczos(op, K, tol=TOL, seed=3)
    one = lanczos(DistributedMatrix.from_global(a), K, tol=TOL, seed=3)   # one process, no MPI
    assert res.converged, (name, res.restarts)
    rel = np.abs(res.values - ref) / np.abs(ref)
    assert rel.max() < 1e-8, (name, res.values, ref)
    assert np.abs(res.values - one.values).max() < 1e-12, (name, res.values, one.values)
    assert res.residuals.max() < 1e-8, (name, res.residuals)
    gram = np.empty((K, K))
    comm.Allreduce(res.vectors.T @ res.vectors, gram)
    assert np.allclose(gram, np.eye(K), atol=1e-10), name
    bytes_sent = comm.allreduce(res.bytes_sent)
    expect = res.matvecs * comm.allreduce(int(halo.send_counts.sum())) * 8
    assert bytes_sent == expect, (name, bytes_sent, expect)
    if rank == 0:
        print(f"{name}: rel err {rel.max():.1e}, residual {res.residuals.max():.1e}, "
              f"{res.restarts} restarts, {res.matvecs} matvecs, {bytes_sent} halo bytes")


g = largest_component(sbm(1200, blocks=4, avg_degree=8, seed=5))
a = normalized_adjacency(g.adjacency)
check("sbm contiguous", a, RowPartition.contiguous(a.shape[0], size))
check("sbm by label", a, RowPartition.from_parts(g.labels % size, size))
lm = normalized_adjacency(les_miserables().adjacency)
check("les_miserables", lm, RowPartition.from_parts(np.arange(lm.shape[0]) % size, size))
if size >= 3:
    # rank 0 owns a whole component and exchanges nothing: the products stay right on every rank
    two = sp.block_diag([lm, a], format="csr")
    parts = np.concatenate([np.zeros(lm.shape[0], int), 1 + np.arange(a.shape[0]) % (size - 1)])
    part = RowPartition.from_parts(parts, size)
    op = DistributedMatrix(build_halo(two, part, rank, comm), two.shape[0], comm)
    assert (rank == 0) == (op.halo.ghosts.size == 0 and op.halo.send_index.size == 0)
    x = np.random.default_rng(8).standard_normal(two.shape[0])
    for _ in range(3):
        assert np.allclose(op.matvec(x[op.rows]), (two @ x)[op.rows], rtol=0, atol=1e-13)
# explicitly restarted Arnoldi on a non-symmetric matrix: the random walk D~^-1 (A + I) of the
# SBM, against scipy's eigs (ARPACK), to 1e-8, with small true residuals, on every rank count
from hpcnn.graph.arnoldi import arnoldi  # noqa: E402
walk = largest_component(sbm(600, blocks=4, avg_degree=8.0, features=4, snr=0.5, seed=1))
walk = walk.adjacency + sp.eye(walk.n_nodes)
walk = sp.csr_matrix(sp.diags(1 / np.asarray(walk.sum(1)).ravel()) @ walk)
assert abs(walk - walk.T).max() > 1e-3                                  # not symmetric
ar = arnoldi(DistributedMatrix.from_global(walk, None, comm), K, m=30, tol=1e-12, seed=3)
ref = sla.eigs(walk, K, which="LR", tol=1e-14)[0]
ref = ref[np.argsort(-ref.real)]
rel = np.abs(ar.values - ref) / np.abs(ref)
assert ar.converged and rel.max() < 1e-8, (ar.values, ref)
assert ar.residuals.max() < 1e-8, ar.residuals
comm.Barrier()
if rank == 0:
    print(f"arnoldi: rel err {rel.max():.1e}, residual {ar.residuals.max():.1e}, "
          f"{ar.restarts} restarts")
    print(f"OK on {size} ranks")
