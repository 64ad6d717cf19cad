"""Partitioning a graph's nodes over p ranks for distributed training: who owns which rows.

A distributed GCN layer receives, on every rank, the feature rows of its halo (the neighbours
another rank owns, :func:`hpcnn.graph.rows.build_halo`): a partition that keeps neighbours
together receives less. :func:`~hpcnn.graph.rows.partition_stats` reports the edge cut and
this halo volume. The partitioners here, each returning a
:class:`~hpcnn.graph.rows.RowPartition` whose part sizes are those of
``RowPartition.contiguous(n, p)`` (they differ by at most one node):

- :func:`spectral_bisection`: recursive spectral bisection. A set of nodes destined for q parts
  is split into the nodes destined for the first ``q // 2`` parts and the others, with the sizes
  those parts sum to (proportional sizes, so any p works, not only powers of two): the nodes are
  sorted by their entry of the Fiedler vector of the induced subgraph (the eigenvector of the
  second smallest eigenvalue of its normalised Laplacian ``I - Â``, i.e. the second largest of
  Â; :func:`hpcnn.graph.spectral.spectral_embedding`, sign-normalised; ties by node index) and cut
  at that rank: for q = 2 at the median. Subgraphs of at most ``DENSE`` nodes use a dense
  eigensolver. A disconnected subgraph has the eigenvalue 1 more than once: any vector of that
  eigenspace is returned, it still separates components (cut 0) but not in a chosen way.
- :func:`random_partition`: a balanced random assignment (the baseline of no locality);
- ``RowPartition.contiguous``: blocks of consecutive indices (good only when the numbering
  already follows the graph's structure);
- :func:`metis_partition`: METIS's k-way partition through ``pymetis`` when it is installed
  (:func:`metis_available`; it is not a dependency: the call raises ImportError naming it).
  METIS balances within its own tolerance (3 % by default), not within one node.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from hpcnn.graph.graphs import normalized_adjacency
from hpcnn.graph.rows import RowPartition

DENSE = 256           # subgraphs up to this many nodes: dense eigh instead of Lanczos


def _check(n: int, parts: int, who: str) -> None:
    if not 1 <= parts <= n:
        raise ValueError(f"{who}: need 1 <= parts={parts} <= n={n}")


def fiedler_vector(a: sp.spmatrix, tol: float = 1e-8, seed: int = 0) -> np.ndarray:
    """(n,) the sign-normalised second eigenvector of Â of the adjacency ``a`` (n >= 2)."""
    from hpcnn.graph.spectral import sign_normalize, spectral_embedding
    n = a.shape[0]
    if n <= DENSE:
        _, vecs = np.linalg.eigh(normalized_adjacency(a).toarray())      # increasing values
        return sign_normalize(vecs[:, -2:-1])[:, 0]
    return spectral_embedding(a, 2, tol=tol, seed=seed)[1][:, 1]


def spectral_bisection(a: sp.spmatrix, parts: int, tol: float = 1e-8, seed: int = 0) -> RowPartition:
    """Recursive spectral bisection of the symmetric adjacency ``a`` into ``parts`` parts."""
    a = sp.csr_matrix(a, dtype=np.float64)
    n = a.shape[0]
    _check(n, parts, "spectral_bisection")
    sizes = RowPartition.contiguous(n, parts).counts()               # (parts,) the target sizes
    owner = np.empty(n, dtype=np.int64)

    def split(nodes: np.ndarray, first: int, sizes: np.ndarray) -> None:
        if sizes.size == 1:
            owner[nodes] = first
            return
        half = sizes.size // 2
        left = int(sizes[:half].sum())
        f = fiedler_vector(a[nodes][:, nodes], tol, seed)
        order = np.lexsort((nodes, f))                               # by Fiedler entry, then index
        split(np.sort(nodes[order[:left]]), first, sizes[:half])
        split(np.sort(nodes[order[left:]]), first + half, sizes[half:])

    split(np.arange(n), 0, sizes)
    return RowPartition(owner, parts)


def random_partition(n: int, parts: int, seed: int = 0) -> RowPartition:
    """Every node to a random part, the part sizes those of the contiguous partition."""
    _check(n, parts, "random_partition")
    owner = RowPartition.contiguous(n, parts).owner
    return RowPartition(np.random.default_rng(seed).permutation(owner), parts)


def metis_available() -> bool:
    """Whether the optional package pymetis can be imported."""
    import importlib.util
    return importlib.util.find_spec("pymetis") is not None


def metis_partition(a: sp.spmatrix, parts: int) -> RowPartition:
    """METIS's k-way partition (``pymetis.part_graph``) of the symmetric adjacency ``a``."""
    a = sp.csr_matrix(a)
    _check(a.shape[0], parts, "metis_partition")
    try:
        import pymetis
    except ImportError as e:
        raise ImportError("metis_partition needs the optional package pymetis (not installed; "
                          "the 'data' extra installs it)") from e
    graph = pymetis.CSRAdjacency(a.indptr, a.indices)
    _, membership = pymetis.part_graph(parts, adjacency=graph)
    return RowPartition.from_parts(np.asarray(membership, dtype=np.int64), parts)


PARTITIONERS = ("contiguous", "random", "spectral", "metis")


def partition(a: sp.spmatrix, parts: int, method: str, seed: int = 0) -> RowPartition:
    """One of :data:`PARTITIONERS` by name."""
    n = a.shape[0]
    if method == "contiguous":
        return RowPartition.contiguous(n, parts)
    if method == "random":
        return random_partition(n, parts, seed)
    if method == "spectral":
        return spectral_bisection(a, parts, seed=seed)
    if method == "metis":
        return metis_partition(a, parts)
    raise ValueError(f"partition: method={method!r}, expected one of {PARTITIONERS}")
