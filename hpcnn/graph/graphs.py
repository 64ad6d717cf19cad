"""Graphs as sparse matrices: the data sets, the normalised adjacency, HDF5 in and out.

A :class:`Graph` is an undirected graph held as its adjacency matrix ``A`` (SciPy CSR, n x n,
symmetric, float64, no self-loops), node features ``X`` (n x f, float64) and integer labels
(n,). The GCN propagation matrix is :func:`normalized_adjacency`,
``Â = D̃^{-1/2} (A + I) D̃^{-1/2}`` with ``D̃ = diag((A + I) 1)``: its eigenvalues lie in (-1, 1],
the largest is 1 (once per connected component), so its k largest eigenpairs are the k smallest of
the normalised Laplacian ``I - Â``.

Data that ships with the installed packages or is generated, never downloaded:

- :func:`karate_club`: Zachary's karate club (networkx, 34 nodes, 2 factions as labels);
- :func:`les_miserables`: the co-appearance network of Les Misérables (networkx, 77 nodes,
  co-appearance counts as weights; no labels: all zero);
- :func:`digits_knn`: the k-nearest-neighbour graph of scikit-learn's 1797 8x8 digits, the pixels as
  features and the digits as labels;
- :func:`sbm`: a stochastic block model with class-dependent features of a chosen signal-to-noise
  ratio, built with NumPy in O(edges) (10^6 nodes in seconds).

Files (:func:`save_graph`, :func:`load_graph`), one HDF5 file per graph::

    /               attrs: format = "hpcnn-graph", format_version, name, n_nodes, n_edges, saved
                    (UTC), then the caller's attrs (non-scalars as JSON strings)
    /adjacency      indptr (n+1,), indices (nnz,), data (nnz,): the CSR arrays; attr shape
    /features       (n, f) float64
    /labels         (n,) int64
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import h5py
import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

FORMAT = "hpcnn-graph"
FORMAT_VERSION = 1


@dataclass
class Graph:
    """An undirected graph: adjacency (CSR, symmetric, no self-loops), features, labels."""
    adjacency: sp.csr_matrix      # (n, n) float64
    features: np.ndarray          # (n, f) float64
    labels: np.ndarray            # (n,) int64
    name: str = "graph"
    attrs: dict = field(default_factory=dict)

    def __post_init__(self):
        a = self.adjacency
        n = a.shape[0]
        if a.shape != (n, n):
            raise ValueError(f"graph {self.name!r}: adjacency must be square, got {a.shape}")
        if self.features.shape[0] != n or self.labels.shape != (n,):
            raise ValueError(f"graph {self.name!r}: {n} nodes but features {self.features.shape} "
                             f"and labels {self.labels.shape}")

    @property
    def n_nodes(self) -> int:
        return self.adjacency.shape[0]

    @property
    def n_edges(self) -> int:
        """Undirected edges (each stored twice in the symmetric CSR)."""
        return self.adjacency.nnz // 2

    def subgraph(self, nodes: np.ndarray, name: str | None = None) -> "Graph":
        """The graph induced by ``nodes`` (global indices, kept in the given order)."""
        a = self.adjacency[nodes][:, nodes].tocsr()
        return Graph(a, self.features[nodes], self.labels[nodes], name or self.name, dict(self.attrs))


def _symmetric_csr(rows: np.ndarray, cols: np.ndarray, n: int, weights=None) -> sp.csr_matrix:
    """The symmetric 0/1 (or summed weights) CSR of the undirected edges (rows[i], cols[i]),
    self-loops dropped, duplicate edges merged (0/1) or summed (weights)."""
    keep = rows != cols
    rows, cols = rows[keep], cols[keep]
    w = np.ones(rows.size) if weights is None else np.asarray(weights, dtype=np.float64)[keep]
    a = sp.coo_matrix((np.concatenate([w, w]), (np.concatenate([rows, cols]),
                                                np.concatenate([cols, rows]))), shape=(n, n)).tocsr()
    a.sum_duplicates()
    if weights is None:
        a.data[:] = 1.0
    a.sort_indices()
    return a


def normalized_adjacency(a: sp.spmatrix) -> sp.csr_matrix:
    """``Â = D̃^{-1/2} (A + I) D̃^{-1/2}``, D̃ the degrees of A + I (CSR, float64, sorted indices)."""
    n = a.shape[0]
    a_tilde = (sp.csr_matrix(a, dtype=np.float64) + sp.identity(n, format="csr")).tocsr()
    d = np.asarray(a_tilde.sum(axis=1)).ravel()            # (n,) >= 1 when A >= 0
    if np.any(d <= 0):
        raise ValueError(f"normalized_adjacency: {int(np.sum(d <= 0))} rows of A + I have a "
                         "non-positive degree (negative weights?)")
    s = sp.diags(1.0 / np.sqrt(d))
    out = (s @ a_tilde @ s).tocsr()
    out.sort_indices()
    return out


def largest_component(g: Graph) -> Graph:
    """The subgraph induced by the largest connected component (nodes in their original order)."""
    _, comp = connected_components(g.adjacency, directed=False)
    biggest = np.argmax(np.bincount(comp))
    nodes = np.flatnonzero(comp == biggest)
    if nodes.size == g.n_nodes:
        return g
    out = g.subgraph(nodes)
    out.attrs["component_of"] = g.n_nodes
    return out


def _from_networkx(nxg, name: str, label_of) -> Graph:
    nodes = list(nxg.nodes())
    index = {v: i for i, v in enumerate(nodes)}
    e = [(index[u], index[v], d.get("weight", 1.0)) for u, v, d in nxg.edges(data=True)]
    rows, cols, w = (np.array(c) for c in zip(*e))
    weighted = any(x != 1.0 for x in w)
    a = _symmetric_csr(rows.astype(np.int64), cols.astype(np.int64), len(nodes),
                       w if weighted else None)
    labels = np.array([label_of(nxg.nodes[v]) for v in nodes], dtype=np.int64)
    features = np.eye(len(nodes))                 # no node attributes: one-hot identities (GCN's)
    return Graph(a, features, labels, name)


def karate_club() -> Graph:
    """Zachary's karate club: 34 nodes, 78 edges; label 1 for 'Officer', 0 for 'Mr. Hi'."""
    import networkx as nx
    return _from_networkx(nx.karate_club_graph(), "karate_club",
                          lambda d: int(d["club"] == "Officer"))


def les_miserables() -> Graph:
    """Les Misérables co-appearances: 77 nodes, 254 weighted edges; no labels (all 0)."""
    import networkx as nx
    return _from_networkx(nx.les_miserables_graph(), "les_miserables", lambda d: 0)


def digits_knn(k: int = 10) -> Graph:
    """The symmetrised k-nearest-neighbour graph of scikit-learn's 8x8 digits (1797 nodes).

    Features are the 64 pixels scaled to [0, 1], labels the digits 0-9; i and j are joined when
    either is among the other's k nearest neighbours (Euclidean, on the pixels)."""
    from sklearn.datasets import load_digits
    from sklearn.neighbors import NearestNeighbors
    if not 1 <= k < 1797:
        raise ValueError(f"digits_knn: k={k} must be in [1, 1796]")
    d = load_digits()
    x = d.data.astype(np.float64) / 16.0                               # (1797, 64)
    nn = NearestNeighbors(n_neighbors=k + 1).fit(x)
    knn = nn.kneighbors(x, return_distance=False)[:, 1:]               # (1797, k), self dropped
    rows = np.repeat(np.arange(x.shape[0]), k)
    a = _symmetric_csr(rows, knn.ravel(), x.shape[0])
    return Graph(a, x, d.target.astype(np.int64), f"digits_knn{k}", {"k": k})


def sbm(n: int, blocks: int = 4, avg_degree: float = 10.0, intra_fraction: float = 0.8,
        features: int = 16, snr: float = 1.0, seed: int = 0) -> Graph:
    """A stochastic block model drawn in O(edges) with NumPy.

    ``n`` nodes in ``blocks`` classes of (almost) equal size, labels shuffled over the node
    indices. ``n * avg_degree / 2`` edges are drawn independently: one end uniform over the nodes,
    the other uniform inside the same block with probability ``intra_fraction``, uniform over all
    nodes otherwise. Duplicate edges are merged and self-loops dropped (a few per million at
    these densities), so this is the SBM with p_in / p_out ~ (intra_fraction * blocks) /
    (1 - intra_fraction) + 1 up to O(avg_degree / n) corrections.

    Features: ``X = snr * M[y] + E``, M (blocks x features) of random signs, E standard normal:
    ``snr`` is the per-coordinate ratio of the class signal to the noise's standard deviation.
    """
    if n < 2 * blocks or blocks < 1:
        raise ValueError(f"sbm: n={n} must be at least 2 * blocks={2 * blocks} (blocks >= 1)")
    if not 0.0 <= intra_fraction <= 1.0 or avg_degree <= 0 or features < 1 or snr < 0:
        raise ValueError(f"sbm: need 0 <= intra_fraction={intra_fraction} <= 1, avg_degree="
                         f"{avg_degree} > 0, features={features} >= 1, snr={snr} >= 0")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % blocks).astype(np.int64)       # (n,)
    members = np.argsort(labels, kind="stable")                            # nodes grouped by block
    start = np.searchsorted(labels[members], np.arange(blocks))            # (blocks,)
    size = np.bincount(labels, minlength=blocks)                           # (blocks,)
    m = int(round(n * avg_degree / 2))
    src = rng.integers(0, n, m)                                            # (m,)
    intra = rng.random(m) < intra_fraction
    b = labels[src[intra]]
    dst = rng.integers(0, n, m)
    dst[intra] = members[start[b] + (rng.random(b.size) * size[b]).astype(np.int64)]
    a = _symmetric_csr(src, dst, n)
    means = rng.choice([-1.0, 1.0], size=(blocks, features))
    x = snr * means[labels] + rng.standard_normal((n, features))
    return Graph(a, x, labels, f"sbm{n}", {"blocks": blocks, "avg_degree": avg_degree,
                                           "intra_fraction": intra_fraction, "snr": snr, "seed": seed})


def save_graph(path: str, g: Graph, attrs: dict | None = None) -> None:
    """Write ``g`` to one HDF5 file (layout in the module docstring); replaces an existing file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    a = g.adjacency.tocsr()
    with h5py.File(path, "w") as f:
        f.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION, "name": g.name,
                        "n_nodes": g.n_nodes, "n_edges": g.n_edges,
                        "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        for k, v in {**g.attrs, **(attrs or {})}.items():
            if k in f.attrs:
                raise ValueError(f"save_graph: attribute {k!r} would overwrite the file's own")
            if isinstance(v, np.generic):
                v = v.item()
            f.attrs[k] = v if isinstance(v, (int, float, bool, str)) else json.dumps(v)
        adj = f.create_group("adjacency")
        adj.attrs["shape"] = a.shape
        adj.create_dataset("indptr", data=a.indptr.astype(np.int64))
        adj.create_dataset("indices", data=a.indices.astype(np.int64))
        adj.create_dataset("data", data=a.data.astype(np.float64))
        f.create_dataset("features", data=np.asarray(g.features, dtype=np.float64))
        f.create_dataset("labels", data=np.asarray(g.labels, dtype=np.int64))


def load_graph(path: str) -> Graph:
    """Read a graph written by :func:`save_graph`; its extra attributes come back in ``attrs``."""
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"{path}: not an hpcnn graph file (format={f.attrs.get('format')!r})")
        adj = f["adjacency"]
        a = sp.csr_matrix((adj["data"][()], adj["indices"][()], adj["indptr"][()]),
                          shape=tuple(int(s) for s in adj.attrs["shape"]))
        own = {"format", "format_version", "name", "n_nodes", "n_edges", "saved"}
        attrs = {k: (v.item() if isinstance(v, np.generic) else v)
                 for k, v in f.attrs.items() if k not in own}
        return Graph(a, f["features"][()], f["labels"][()], str(f.attrs["name"]), attrs)
