"""hpcnn.graph: data sets, normalised adjacency, HDF5, row partitions and halos, Lanczos."""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from hpcnn.graph import (DistributedMatrix, RowPartition, build_halo, digits_knn, karate_club,
                         lanczos, largest_component, les_miserables, load_graph,
                         normalized_adjacency, save_graph, sbm)
from mpi_util import CaseRuns


def test_bundled_graphs_have_their_known_sizes():
    k = karate_club()
    assert (k.n_nodes, k.n_edges, int(k.labels.sum())) == (34, 78, 17)
    m = les_miserables()
    assert (m.n_nodes, m.n_edges) == (77, 254) and m.adjacency.max() == 31   # the heaviest co-appearance
    d = digits_knn(5)
    assert d.n_nodes == 1797 and d.features.shape == (1797, 64)
    assert np.all(np.diff(d.adjacency.indptr) >= 5)                          # own 5 neighbours
    for g in (k, m, d):
        assert (g.adjacency != g.adjacency.T).nnz == 0 and g.adjacency.diagonal().max() == 0
    # a k-NN graph of digits links mostly images of the same digit
    coo = d.adjacency.tocoo()
    assert np.mean(d.labels[coo.row] == d.labels[coo.col]) > 0.9


def test_normalized_adjacency_matches_its_formula():
    a = les_miserables().adjacency
    dense = a.toarray() + np.eye(a.shape[0])
    s = np.diag(1 / np.sqrt(dense.sum(1)))
    h = normalized_adjacency(a)
    assert np.allclose(h.toarray(), s @ dense @ s, atol=1e-15)
    assert np.isclose(np.linalg.eigvalsh(h.toarray()).max(), 1.0)            # connected: one 1


def test_sbm_blocks_degree_and_feature_snr():
    g = sbm(20000, blocks=4, avg_degree=10, intra_fraction=0.8, features=8, snr=2.0, seed=1)
    a = g.adjacency
    assert (a != a.T).nnz == 0 and a.diagonal().max() == 0
    assert abs(a.nnz / g.n_nodes - 10) < 0.1                                 # duplicates are rare
    coo = a.tocoo()
    same = np.mean(g.labels[coo.row] == g.labels[coo.col])
    assert abs(same - (0.8 + 0.2 / 4)) < 0.01                                # intra + chance
    assert np.all(np.bincount(g.labels) == 5000)
    class_means = np.array([g.features[g.labels == c].mean(0) for c in range(4)])
    assert np.allclose(np.abs(class_means), 2.0, atol=0.1)                   # snr * (+-1)
    assert abs((g.features - class_means[g.labels]).std() - 1.0) < 0.02     # unit noise
    assert np.array_equal(sbm(500, seed=3).adjacency.indices, sbm(500, seed=3).adjacency.indices)


def test_graph_hdf5_round_trip(tmp_path):
    g = largest_component(digits_knn(4))
    path = str(tmp_path / "g.h5")
    save_graph(path, g, attrs={"note": "knn", "blocks": [1, 2]})
    back = load_graph(path)
    assert back.name == g.name and (back.adjacency != g.adjacency).nnz == 0
    assert np.array_equal(back.features, g.features) and np.array_equal(back.labels, g.labels)
    assert back.attrs["note"] == "knn" and back.attrs["blocks"] == "[1, 2]" and back.attrs["k"] == 4
    with pytest.raises(ValueError, match="overwrite"):
        save_graph(path, g, attrs={"name": "x"})


def test_halo_of_a_path():
    """The module docstring's example: a path of 6 on 2 ranks."""
    a = sp.diags([np.ones(5), np.ones(5)], [-1, 1], format="csr")
    part = RowPartition.contiguous(6, 2)
    h0, h1 = build_halo(a, part, 0), build_halo(a, part, 1)
    assert h0.ghosts.tolist() == [3] and h1.ghosts.tolist() == [2]
    assert h0.send_index.tolist() == [2] and h1.send_index.tolist() == [0]
    assert h0.recv_counts.tolist() == [0, 1] and h0.send_counts.tolist() == [0, 1]
    assert part.edge_cut(a) == 2
    odd = RowPartition.from_parts([0, 1, 0, 1, 0, 1])                        # every edge is cut
    assert odd.edge_cut(a) == 10 and build_halo(a, odd, 0).ghosts.tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match=r"ranks \[2\] own no rows"):
        RowPartition.from_parts([0, 1, 0, 1, 3, 1])


@pytest.mark.parametrize("graph", [karate_club, les_miserables])
def test_serial_lanczos_matches_arpack(graph):
    a = normalized_adjacency(graph().adjacency)
    history = []
    res = lanczos(DistributedMatrix.from_global(a), 4, tol=1e-12, history=history)
    ref = np.sort(sla.eigsh(a, 4, which="LA", tol=1e-12)[0])[::-1]
    assert res.converged and np.max(np.abs(res.values - ref) / np.abs(ref)) < 1e-10
    assert len(history) == res.restarts + 1 and history[-1][1] <= 1e-12     # one entry a cycle
    assert all(h[1] > 1e-12 for h in history[:-1]) and history[-1][0] >= history[0][0] > 0
    assert res.residuals.max() < 1e-10 and res.bytes_sent == 0
    assert np.allclose(res.vectors.T @ res.vectors, np.eye(4), atol=1e-12)


def test_lanczos_refuses_bad_sizes():
    op = DistributedMatrix.from_global(normalized_adjacency(karate_club().adjacency))
    with pytest.raises(ValueError, match="k=30"):
        lanczos(op, 30, m=20)


@pytest.fixture(scope="module")
def graph_runs():
    """Lanczos and unite and conquer on the same number of ranks share one job."""
    return CaseRuns([(n, "graph_lanczos", ()) for n in (1, 2, 3, 4)]
                    + [(n, "graph_unite", ()) for n in (2, 4)])


@pytest.mark.parametrize("n", [1, 2, pytest.param(3, marks=pytest.mark.long),
                               pytest.param(4, marks=pytest.mark.long)])
def test_distributed_lanczos_matches_arpack(n, graph_runs):
    assert f"OK on {n} ranks" in graph_runs.stdout(n, "graph_lanczos")


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long)])
def test_unite_and_conquer_matches_arpack(n, graph_runs):
    assert f"OK on {n} ranks" in graph_runs.stdout(n, "graph_unite")


def test_arnoldi_on_a_non_symmetric_matrix_and_its_refusals():
    """Explicitly restarted Arnoldi (hpcnn.graph.arnoldi) on one process: a non-symmetric matrix
    (a diagonal plus a directed cycle, complex eigenvalues at the bottom of its spectrum), against
    the dense eigenvalues; bad sizes named."""
    from hpcnn.graph.arnoldi import arnoldi
    n = 40
    a = sp.diags(np.linspace(0.0, 1.0, n) ** 4) + sp.csr_matrix(
        (np.full(n, 0.05), (np.arange(n), (np.arange(n) + 1) % n)), shape=(n, n))
    res = arnoldi(DistributedMatrix.from_global(sp.csr_matrix(a)), 3, m=25, tol=1e-12)
    dense = np.linalg.eigvals(a.toarray())
    ref = dense[np.argsort(-dense.real)][:3]
    assert res.converged and res.residuals.max() < 1e-9
    assert np.allclose(np.sort_complex(res.values), np.sort_complex(ref), rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="k=5 < m=4"):
        arnoldi(DistributedMatrix.from_global(sp.csr_matrix(a)), 5, m=4)
