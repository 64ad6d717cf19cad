"""Spectral node features: the k dominant eigenvectors U_k of Â, as or with the input features.

``U_k`` holds the eigenvectors of the k largest eigenvalues of ``Â = D̃^{-1/2}(A + I)D̃^{-1/2}``
(the k smallest of the normalised Laplacian ``I - Â``): row i is a k-dimensional embedding of node
i in which nodes of a densely connected group lie close together (the basis of spectral
clustering). :func:`spectral_features` returns ``[X, U_k]`` (``mode="concat"``) or ``U_k``
(``mode="replace"``), computed by :func:`hpcnn.graph.krylov.lanczos` on one process
(``comm=None``) or on the ranks of ``comm`` (each rank gets the rows it owns).

An eigenvector is defined up to its sign, and Lanczos returns either sign depending on the start
vector and the rounding. :func:`sign_normalize` fixes it: in each column, the entry of largest
magnitude (the first one, by global index, among those within a relative 1e-8 of the largest, so
that exactly tied entries as in symmetric graphs are decided by index, not by rounding) is made
positive. Runs with the same graph then give the same features whatever the seed or the number of
ranks, up to the solver tolerance. This does not fix a repeated eigenvalue (a graph with several
components has the eigenvalue 1 once per component, an SBM of b equal blocks b - 1 nearly equal
ones): there any rotation of the eigenspace is an answer; take the largest component first
(:func:`hpcnn.graph.graphs.largest_component`) or treat such columns as a subspace.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from hpcnn.graph.graphs import Graph, normalized_adjacency
from hpcnn.graph.krylov import DistributedMatrix, _allreduce, lanczos
from hpcnn.graph.rows import RowPartition
from hpcnn.parallel.collectives import as_communicator

TIE = 1e-8            # entries within this relative distance of the largest magnitude count as tied


def sign_normalize(vectors: np.ndarray, rows: np.ndarray | None = None, comm=None) -> np.ndarray:
    """A copy of ``vectors`` (n_local, k) with each column's sign fixed (module docstring).

    ``rows``: the global index of each local row (default 0 .. n_local-1, the serial case);
    ``comm``: the ranks holding the other rows (three allreduces of k numbers)."""
    comm = as_communicator(comm, "graph")
    v = np.array(vectors, dtype=np.float64)
    n_local, k = v.shape
    rows = np.arange(n_local) if rows is None else np.asarray(rows)
    mag = np.abs(v)
    biggest = _allreduce(comm, mag.max(axis=0) if n_local else np.zeros(k), "max")      # (k,)
    big = np.iinfo(np.int64).max
    first = np.full(k, big, dtype=np.int64)
    for i in range(k):
        near = np.flatnonzero(mag[:, i] >= (1 - TIE) * biggest[i])
        if near.size:
            first[i] = rows[near].min()
    first = _allreduce(comm, first, "min")                                                # (k,)
    sign = np.zeros(k)
    for i in range(k):
        at = np.flatnonzero(rows == first[i])
        if at.size:
            sign[i] = 1.0 if v[at[0], i] >= 0 else -1.0
    sign = _allreduce(comm, sign)                                   # only the owner contributes
    return v * sign


def spectral_embedding(a: sp.spmatrix, k: int, comm=None, part: RowPartition | None = None,
                       tol: float = 1e-10, seed: int = 0, m: int | None = None):
    """The k largest eigenpairs of Â of the adjacency ``a`` (the whole matrix on every rank).

    -> (values (k,) decreasing, this rank's rows of U_k (n_local, k) sign-normalised, the global
    rows held here, the :class:`~hpcnn.graph.krylov.LanczosResult`). ``part``: the row partition
    over the ranks of ``comm`` (contiguous by default). A ValueError names k and n unless
    1 <= k < n - 1 (Lanczos needs a basis larger than k)."""
    n = a.shape[0]
    if not 1 <= k < n - 1:
        raise ValueError(f"spectral_embedding: need 1 <= k={k} < n - 1 = {n - 1}")
    op = DistributedMatrix.from_global(normalized_adjacency(a), part=part, comm=comm)
    res = lanczos(op, k, m=m, tol=tol, seed=seed)
    return res.values, sign_normalize(res.vectors, op.rows, comm), op.rows, res


def spectral_features(g: Graph, k: int, mode: str = "concat", comm=None,
                      part: RowPartition | None = None, tol: float = 1e-10, seed: int = 0) -> np.ndarray:
    """Node features with the graph's k dominant eigenvectors of Â: ``[X, U_k]`` (n, f + k) for
    ``mode="concat"``, ``U_k`` (n, k) for ``mode="replace"``; with ``comm``, this rank's rows
    (those of ``part``, contiguous by default), in increasing global order."""
    if mode not in ("concat", "replace"):
        raise ValueError(f"spectral_features: mode={mode!r}, expected 'concat' or 'replace'")
    _, u, rows, _ = spectral_embedding(g.adjacency, k, comm, part, tol, seed)
    return u if mode == "replace" else np.hstack([g.features[rows], u])
