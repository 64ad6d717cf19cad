"""Graph reduction by coarsening: merge nodes into n_c super-nodes, train on the small graph.

A coarsening is an assignment ``assign`` (n,) of every fine node to one of n_c coarse nodes, i.e.
the sparse n x n_c matrix ``P`` with ``P[i, assign[i]] = 1`` (each row sums to 1). The coarse graph
(:meth:`Coarsening.apply`) is

- adjacency ``A_c = Pᵀ A P`` **without its diagonal**: ``A_c[c, d]`` (c != d) is the total weight
  of the edges between the groups c and d. The diagonal (twice the weight inside group c) is
  dropped because a :class:`~hpcnn.graph.graphs.Graph` has no self-loops and the GCN adds its own;
  :meth:`Coarsening.internal_weight` returns it: ``sum(A_c) + sum(internal_weight) = sum(A)``;
- features ``X_c = D_P^{-1} Pᵀ X``, ``D_P = diag(group sizes)``: each group's mean feature row;
- labels: each group's majority label (ties: the smallest label).

:meth:`Coarsening.lift` maps predictions on the coarse nodes back to the fine ones,
``y_fine = y_coarse[assign]``: train on the coarse graph, evaluate on the full graph.

Three ways to choose the groups, each for a target ratio ``r = n_c / n``:

- :func:`heavy_edge_matching`: repeated matching (as in METIS's coarsening phase). One level
  visits the nodes in a seeded random order and merges an unmatched node with its unmatched
  neighbour of heaviest edge (ties: the smallest index); each level at most halves the node count
  and weighs its edges as the coarse graph does, so later levels merge the most connected groups.
  The last level stops at ``round(r n)`` nodes, unless no unmatched neighbours are left (isolated
  nodes, stars), which is then said in ``levels``.
- :func:`spectral_clustering`: k-means (scikit-learn, fixed seed) on the unit-normalised rows of
  U_k, the k dominant eigenvectors of Â (Ng, Jordan and Weiss, NIPS 2001), into ``round(r n)``
  clusters (possibly fewer distinct ones), renumbered 0 .. n_c - 1.
- :func:`random_assignment`: a balanced random assignment to ``round(r n)`` groups (the baseline).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from hpcnn.graph.graphs import Graph


@dataclass
class Coarsening:
    """An assignment of n fine nodes to ``n_coarse`` groups, every group non-empty."""
    assign: np.ndarray            # (n,) int64 in [0, n_coarse)
    n_coarse: int
    method: str = "given"
    levels: list = field(default_factory=list)   # heavy-edge matching: node count after each level

    def __post_init__(self):
        a = self.assign = np.asarray(self.assign, dtype=np.int64)
        if a.ndim != 1 or (a.size and (a.min() < 0 or a.max() >= self.n_coarse)):
            raise ValueError(f"Coarsening: assign must be a vector in [0, {self.n_coarse}), got "
                             f"shape {a.shape}")
        empty = np.flatnonzero(np.bincount(a, minlength=self.n_coarse) == 0)
        if empty.size:
            raise ValueError(f"Coarsening: coarse nodes {empty[:10].tolist()} have no fine node")

    @property
    def n(self) -> int:
        return self.assign.size

    @property
    def ratio(self) -> float:
        return self.n_coarse / self.n

    def matrix(self) -> sp.csr_matrix:
        """P (n x n_coarse): ``P[i, assign[i]] = 1``."""
        return sp.csr_matrix((np.ones(self.n), (np.arange(self.n), self.assign)),
                             shape=(self.n, self.n_coarse))

    def sizes(self) -> np.ndarray:
        """(n_coarse,) fine nodes per group: the diagonal of D_P = PᵀP."""
        return np.bincount(self.assign, minlength=self.n_coarse)

    def coarse_adjacency(self, a: sp.spmatrix) -> sp.csr_matrix:
        """``PᵀAP`` without its diagonal (CSR, sorted indices, no stored zeros)."""
        p = self.matrix()
        ac = (p.T @ sp.csr_matrix(a, dtype=np.float64) @ p).tocsr()
        ac.setdiag(0.0)
        ac.eliminate_zeros()
        ac.sort_indices()
        return ac

    def internal_weight(self, a: sp.spmatrix) -> np.ndarray:
        """(n_coarse,) the diagonal of ``PᵀAP`` that :meth:`coarse_adjacency` drops: the summed
        weight of the stored entries inside each group (twice its internal edges' weight)."""
        coo = sp.coo_matrix(a)
        inside = self.assign[coo.row] == self.assign[coo.col]
        return np.bincount(self.assign[coo.row[inside]], weights=coo.data[inside],
                           minlength=self.n_coarse)

    def mean_features(self, x: np.ndarray) -> np.ndarray:
        """``D_P^{-1} Pᵀ X`` (n_coarse, f): each group's mean feature row."""
        return (self.matrix().T @ np.asarray(x, dtype=np.float64)) / self.sizes()[:, None]

    def majority_labels(self, labels: np.ndarray) -> np.ndarray:
        """(n_coarse,) each group's most frequent label; ties go to the smallest label."""
        values, index = np.unique(np.asarray(labels), return_inverse=True)
        counts = sp.csr_matrix((np.ones(self.n), (self.assign, index.ravel())),
                               shape=(self.n_coarse, values.size)).toarray()
        return values[np.argmax(counts, axis=1)]            # argmax: the first (smallest) of ties

    def apply(self, g: Graph) -> Graph:
        """The coarse graph of ``g`` (module docstring)."""
        if g.n_nodes != self.n:
            raise ValueError(f"Coarsening of {self.n} nodes applied to graph {g.name!r} of "
                             f"{g.n_nodes}")
        return Graph(self.coarse_adjacency(g.adjacency), self.mean_features(g.features),
                     self.majority_labels(g.labels).astype(np.int64),
                     f"{g.name}_{self.method}{self.n_coarse}",
                     {**g.attrs, "coarsened_from": g.n_nodes, "coarsening": self.method})

    def lift(self, y_coarse: np.ndarray) -> np.ndarray:
        """Per-coarse-node values (predictions, logits rows) mapped to the fine nodes."""
        y_coarse = np.asarray(y_coarse)
        if y_coarse.shape[0] != self.n_coarse:
            raise ValueError(f"lift: {y_coarse.shape[0]} coarse values for {self.n_coarse} "
                             "coarse nodes")
        return y_coarse[self.assign]

    def then(self, other: "Coarsening") -> "Coarsening":
        """This coarsening followed by ``other`` (a coarsening of the coarse nodes)."""
        if other.n != self.n_coarse:
            raise ValueError(f"then: {other.n} nodes after {self.n_coarse} coarse nodes")
        return Coarsening(other.assign[self.assign], other.n_coarse, other.method,
                          self.levels + other.levels)


def _target(n: int, ratio: float) -> int:
    """round(ratio n), checked to be a coarse node count in [1, n]."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"coarsening ratio={ratio} must be in (0, 1]")
    return min(n, max(1, int(round(ratio * n))))


def match_once(a: sp.csr_matrix, merges: int, rng: np.random.Generator) -> np.ndarray:
    """One level of heavy-edge matching, at most ``merges`` pairs merged; -> assign (n,) with the
    groups numbered in order of their first node."""
    a = sp.csr_matrix(a)
    n = a.shape[0]
    mate = np.arange(n)                            # mate[i] = i: unmatched (or alone)
    matched = np.zeros(n, dtype=bool)
    indptr, indices, data = a.indptr, a.indices, a.data
    done = 0
    for u in rng.permutation(n):
        if done >= merges:
            break
        if matched[u]:
            continue
        nb = indices[indptr[u]:indptr[u + 1]]
        w = data[indptr[u]:indptr[u + 1]]
        free = ~matched[nb] & (nb != u)
        if not free.any():
            continue
        nb, w = nb[free], w[free]
        best = nb[w == w.max()].min()                            # heaviest; ties: smallest index
        mate[u], mate[best] = best, u
        matched[u] = matched[best] = True
        done += 1
    leader = np.minimum(np.arange(n), mate)                      # each pair named by its first node
    _, assign = np.unique(leader, return_inverse=True)
    return assign.ravel().astype(np.int64)


def heavy_edge_matching(a: sp.spmatrix, ratio: float, seed: int = 0,
                        max_levels: int = 64) -> Coarsening:
    """Repeated heavy-edge matching down to ``round(ratio n)`` nodes (module docstring)."""
    n = a.shape[0]
    target = _target(n, ratio)
    rng = np.random.default_rng(seed)
    total = Coarsening(np.arange(n), n, "heavy_edge")
    current = sp.csr_matrix(a, dtype=np.float64)
    for _ in range(max_levels):
        if total.n_coarse <= target:
            break
        assign = match_once(current, total.n_coarse - target, rng)
        step = Coarsening(assign, int(assign.max()) + 1, "heavy_edge", [int(assign.max()) + 1])
        if step.n_coarse == total.n_coarse:
            break                                                # nothing left to merge
        current = step.coarse_adjacency(current)
        total = total.then(step)
    return total


def spectral_clustering(a: sp.spmatrix, ratio: float, k: int = 8, seed: int = 0,
                        n_init: int = 1, vectors: np.ndarray | None = None) -> Coarsening:
    """k-means on the unit-normalised rows of U_k into ``round(ratio n)`` groups.

    ``vectors``: U_k already computed (n, k), e.g. by
    :func:`hpcnn.graph.spectral.spectral_embedding`; by default computed here (serial Lanczos)."""
    from sklearn.cluster import KMeans
    n = a.shape[0]
    target = _target(n, ratio)
    if vectors is None:
        from hpcnn.graph.spectral import spectral_embedding
        vectors = spectral_embedding(a, k, seed=seed)[1]
    rows = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-300)
    km = KMeans(n_clusters=target, n_init=n_init, random_state=seed).fit(rows)
    _, assign = np.unique(km.labels_, return_inverse=True)
    assign = assign.ravel()
    return Coarsening(assign, int(assign.max()) + 1, "spectral")


def random_assignment(n: int, n_coarse: int, seed: int = 0) -> Coarsening:
    """Every fine node to a random group, the group sizes balanced (they differ by at most 1)."""
    if not 1 <= n_coarse <= n:
        raise ValueError(f"random_assignment: need 1 <= n_coarse={n_coarse} <= n={n}")
    rng = np.random.default_rng(seed)
    return Coarsening(rng.permutation(np.arange(n) % n_coarse), n_coarse, "random")
