"""hpcnn.graph upstream processing: spectral features, coarsening, partitioners and their cost."""
import numpy as np
import pytest
import scipy.sparse as sp

from hpcnn.graph import RowPartition, build_halo, digits_knn, karate_club, normalized_adjacency, sbm
from hpcnn.graph.coarsen import (Coarsening, heavy_edge_matching, random_assignment,
                                 spectral_clustering)
from hpcnn.graph.graphs import Graph, _symmetric_csr, largest_component
from hpcnn.graph.rows import partition_stats
from hpcnn.graph.partitioners import (metis_available, metis_partition, partition,
                                      random_partition, spectral_bisection)
from hpcnn.graph.spectral import sign_normalize, spectral_embedding, spectral_features
from mpi_util import run_mpi


def edges(pairs, n, weights=None):
    pairs = np.array(pairs)
    return _symmetric_csr(pairs[:, 0], pairs[:, 1], n, weights)


def two_triangles() -> Graph:
    """Triangles {0, 1, 2} and {3, 4, 5} joined by the edge 2-3."""
    a = edges([(0, 1), (1, 2), (0, 2), (3, 4), (4, 5), (3, 5), (2, 3)], 6)
    x = np.arange(12, dtype=float).reshape(6, 2)
    return Graph(a, x, np.array([0, 0, 1, 1, 1, 0]), "two_triangles")


# ---------------------------------------------------------------- coarsening, by hand

def test_coarsening_of_two_triangles_by_hand():
    g = two_triangles()
    c = Coarsening([0, 0, 0, 1, 1, 1], 2)
    cg = c.apply(g)
    assert cg.adjacency.toarray().tolist() == [[0, 1], [1, 0]]            # the edge 2-3; loops dropped
    assert c.internal_weight(g.adjacency).tolist() == [6, 6]               # 3 edges inside, twice each
    assert np.allclose(cg.features, [[2, 3], [8, 9]])                     # rows 0-2 and 3-5 averaged
    assert cg.labels.tolist() == [0, 1]                                   # majorities 0,0,1 and 1,1,0
    assert c.lift(np.array([7, 9])).tolist() == [7, 7, 7, 9, 9, 9]
    p = c.matrix().toarray()
    assert np.array_equal(p.T @ g.adjacency.toarray() @ p, [[6, 1], [1, 6]])
    # ties go to the smallest label: group 0 holds labels 2 and 1 once each
    assert Coarsening([0, 0, 1, 1], 2).majority_labels(np.array([2, 1, 3, 3])).tolist() == [1, 3]
    with pytest.raises(ValueError, match=r"coarse nodes \[1\] have no fine node"):
        Coarsening([0, 0, 2], 3)
    with pytest.raises(ValueError, match="3 coarse values for 2"):
        c.lift(np.zeros(3))


def test_heavy_edge_matching_of_a_weighted_path_by_hand():
    """Path 0-1-2-3 with weights 3, 1, 3: whatever the visiting order, 0-1 and 2-3 merge."""
    a = edges([(0, 1), (1, 2), (2, 3)], 4, weights=[3.0, 1.0, 3.0])
    for seed in range(6):
        c = heavy_edge_matching(a, 0.5, seed=seed)
        assert c.assign.tolist() == [0, 0, 1, 1] and c.levels == [2]
        assert c.coarse_adjacency(a).toarray().tolist() == [[0, 1], [1, 0]]
    one = heavy_edge_matching(a, 0.25)
    assert one.n_coarse == 1 and one.levels == [2, 1]                    # two levels
    three = heavy_edge_matching(a, 0.75)                                  # stops after one merge
    assert three.n_coarse == 3
    assert heavy_edge_matching(sp.csr_matrix((3, 3)), 0.5).n_coarse == 3  # nothing to merge
    with pytest.raises(ValueError, match="ratio=1.5"):
        heavy_edge_matching(a, 1.5)


# ---------------------------------------------------------------- coarsening, invariants

def check_invariants(g: Graph, c: Coarsening):
    p = c.matrix()
    assert np.array_equal(np.asarray(p.sum(axis=1)).ravel(), np.ones(g.n_nodes))
    cg = c.apply(g)
    ac = cg.adjacency
    assert (ac != ac.T).nnz == 0 and ac.diagonal().max() == 0
    assert np.isclose(ac.sum() + c.internal_weight(g.adjacency).sum(), g.adjacency.sum())
    for group in (0, c.n_coarse // 2, c.n_coarse - 1):
        members = np.flatnonzero(c.assign == group)
        assert np.allclose(cg.features[group], g.features[members].mean(axis=0))
        counts = np.bincount(g.labels[members])
        assert cg.labels[group] == np.argmax(counts)
    return cg


@pytest.fixture(scope="module")
def small_sbm():
    return largest_component(sbm(3000, blocks=4, avg_degree=8, seed=2))


@pytest.fixture(scope="module")
def digits():
    return digits_knn(10)


@pytest.mark.parametrize("ratio", [0.5, 0.1])
def test_coarsenings_reach_the_ratio_and_keep_the_invariants(small_sbm, digits, ratio):
    for g in (small_sbm, digits):
        target = round(ratio * g.n_nodes)
        u = spectral_embedding(g.adjacency, 8)[1]
        made = {"heavy_edge": heavy_edge_matching(g.adjacency, ratio, seed=1),
                "spectral": spectral_clustering(g.adjacency, ratio, seed=1, vectors=u),
                "random": random_assignment(g.n_nodes, target, seed=1)}
        for name, c in made.items():
            assert abs(c.ratio - ratio) <= 0.01 * ratio, (g.name, name, c.ratio)
            check_invariants(g, c)
        # structure pays: the lifted majority labels of heavy-edge groups agree with the fine
        # labels more than those of random groups (digits k-NN: mostly same-digit neighbours)
        lifted = {k: np.mean(c.lift(c.majority_labels(g.labels)) == g.labels)
                  for k, c in made.items()}
        assert lifted["heavy_edge"] > lifted["random"] and lifted["spectral"] > lifted["random"]
    again = heavy_edge_matching(digits.adjacency, ratio, seed=1)
    assert np.array_equal(again.assign, made["heavy_edge"].assign)          # seeded: reproducible


# ---------------------------------------------------------------- spectral features

def test_sign_normalize_rule_and_ties():
    v = np.array([[-0.5, 0.1], [0.5, -0.7], [0.1, 0.2]])
    out = sign_normalize(v)
    assert out.tolist() == [[0.5, -0.1], [-0.5, 0.7], [-0.1, -0.2]]       # first of tied, then max
    assert np.array_equal(sign_normalize(-v), out)


def test_spectral_features_are_eigenvectors_and_reproducible():
    g = karate_club()
    u = spectral_features(g, 4, mode="replace", seed=0)
    ah = normalized_adjacency(g.adjacency).toarray()
    lam = np.linalg.eigvalsh(ah)[::-1][:4]
    assert np.allclose(ah @ u, u * lam, atol=1e-9) and np.allclose(u.T @ u, np.eye(4), atol=1e-10)
    other = spectral_features(g, 4, mode="replace", seed=5)                # another start vector
    assert np.allclose(other, u, atol=1e-8)
    both = spectral_features(g, 4)
    assert both.shape == (34, 38) and np.array_equal(both[:, :34], g.features)
    with pytest.raises(ValueError, match="mode='both'"):
        spectral_features(g, 4, mode="both")
    with pytest.raises(ValueError, match="k=40"):
        spectral_features(g, 40)


def test_distributed_spectral_features_match_serial():
    assert "OK on 2 ranks" in run_mpi("graph_spectral", 2)


# ---------------------------------------------------------------- partitioners

def two_cliques(size=10, seed=0):
    """Two cliques of ``size`` nodes joined by one edge, node numbers shuffled."""
    perm = np.random.default_rng(seed).permutation(2 * size)
    pairs = [(i, j) for c in (0, size) for i in range(c, c + size) for j in range(i + 1, c + size)]
    pairs.append((size - 1, size))
    return edges([(perm[i], perm[j]) for i, j in pairs], 2 * size), perm[:size]


def test_spectral_bisection_finds_the_cut_between_two_cliques():
    for size in (10, 150):                                 # dense eigh and Lanczos (> DENSE nodes)
        a, first = two_cliques(size)
        part = spectral_bisection(a, 2)
        assert partition_stats(a, part)["edge_cut"] == 1
        assert len(set(part.owner[first])) == 1
        assert contiguous_cut(a) > 1                       # the shuffled numbering is no help


def contiguous_cut(a):
    return partition_stats(a, RowPartition.contiguous(a.shape[0], 2))["edge_cut"]


def test_partition_stats_match_build_halo_and_balance(small_sbm):
    a = small_sbm.adjacency
    for parts in (3, 4):
        for method in ("contiguous", "random", "spectral"):
            part = partition(a, parts, method, seed=1)
            s = partition_stats(a, part)
            halos = [build_halo(a, part, r).ghosts.size for r in range(parts)]
            assert s["halo_volume"] == sum(halos) and s["max_halo"] == max(halos)
            assert s["edge_cut"] == part.edge_cut(a) // 2
            assert s["max_part"] - s["min_part"] <= 1, (method, s)
        spectral = partition_stats(a, partition(a, parts, "spectral"))
        rand = partition_stats(a, random_partition(a.shape[0], parts, seed=1))
        assert spectral["edge_cut"] < 0.8 * rand["edge_cut"]
        assert spectral["halo_volume"] < rand["halo_volume"]
    with pytest.raises(ValueError, match="parts=5000"):
        spectral_bisection(a, 5000)
    with pytest.raises(ValueError, match="method='kl'"):
        partition(a, 2, "kl")


def test_metis_partition_or_a_clear_refusal():
    a, first = two_cliques(10)
    if metis_available():
        part = metis_partition(a, 2)
        assert partition_stats(a, part)["edge_cut"] == 1
    else:
        with pytest.raises(ImportError, match="pymetis"):
            metis_partition(a, 2)
