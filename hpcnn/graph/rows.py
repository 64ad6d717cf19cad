"""1-D row partition of a sparse matrix across ranks, and its halo.

Rank r owns a set of rows (nodes) of the n x n matrix A; a distributed vector holds on rank r the
entries of its rows, in increasing global order. To compute its rows of ``A x``, rank r also needs
the entries ``x[j]`` of every column j its rows reference that another rank owns: its **halo**
(ghost) columns. The halo is computed once per matrix and partition:

- ``recv[q]``: the global indices rank r receives from rank q (the ghosts q owns, sorted);
- ``send[q]``: the *local* positions of r's entries that rank q needs (q's ``recv[r]``).

The local matrix has its columns renumbered: r's own rows first (0 .. n_local-1), then the ghosts,
grouped by owner rank in rank order, so that the receive buffer of a halo exchange is the tail of
the extended vector ``[x_local, ghosts]`` (see :class:`hpcnn.graph.krylov.DistributedMatrix`).

Example: a path 0-1-2-3-4-5 on 2 ranks, contiguous blocks {0,1,2} and {3,4,5}: rank 0's halo is
{3} (row 2 references column 3), rank 1's is {2}; rank 0 sends its local entry 2 (global 2) to
rank 1 and receives global 3 from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from hpcnn.parallel.collectives import as_communicator


@dataclass(frozen=True)
class RowPartition:
    """Which rank owns each row: ``owner`` (n,) int64 in [0, size)."""
    owner: np.ndarray
    size: int

    def __post_init__(self):
        o = self.owner
        if o.ndim != 1 or (o.size and (o.min() < 0 or o.max() >= self.size)):
            raise ValueError(f"RowPartition: owners must be a vector in [0, {self.size}), got "
                             f"shape {o.shape} range [{o.min() if o.size else '-'}, "
                             f"{o.max() if o.size else '-'}]")

    @classmethod
    def contiguous(cls, n: int, size: int) -> "RowPartition":
        """Blocks of consecutive rows, the first ``n % size`` ranks one row more."""
        if size < 1 or n < size:
            raise ValueError(f"RowPartition.contiguous: need 1 <= size={size} <= n={n}")
        counts = np.full(size, n // size)
        counts[: n % size] += 1
        return cls(np.repeat(np.arange(size), counts).astype(np.int64), size)

    @classmethod
    def from_parts(cls, parts, size: int | None = None) -> "RowPartition":
        """From an explicit part vector (e.g. a graph partitioner's output): row i goes to rank
        ``parts[i]``. Every rank must own at least one row."""
        parts = np.asarray(parts, dtype=np.int64)
        size = int(parts.max()) + 1 if size is None else size
        p = cls(parts, size)
        empty = np.flatnonzero(np.bincount(parts, minlength=size) == 0)
        if empty.size:
            raise ValueError(f"RowPartition.from_parts: ranks {empty.tolist()} own no rows")
        return p

    @property
    def n(self) -> int:
        return self.owner.size

    def rows(self, rank: int) -> np.ndarray:
        """The global rows ``rank`` owns, increasing."""
        return np.flatnonzero(self.owner == rank)

    def counts(self) -> np.ndarray:
        return np.bincount(self.owner, minlength=self.size)

    def local_index(self) -> np.ndarray:
        """(n,) the position of each global row in its owner's local vector."""
        pos = np.empty(self.n, dtype=np.int64)
        for r in range(self.size):
            rows = self.rows(r)
            pos[rows] = np.arange(rows.size)
        return pos

    def edge_cut(self, a: sp.spmatrix) -> int:
        """Stored entries (i, j) with i and j on different ranks (2x the cut edges of a graph)."""
        coo = sp.coo_matrix(a)
        return int(np.count_nonzero(self.owner[coo.row] != self.owner[coo.col]))


@dataclass
class Halo:
    """One rank's halo: the renumbered local matrix and the send/receive lists of an exchange."""
    rank: int
    rows: np.ndarray                 # (n_local,) global rows owned
    local: sp.csr_matrix             # (n_local, n_local + n_ghost) columns renumbered
    ghosts: np.ndarray               # (n_ghost,) global index of each ghost column, by owner rank
    recv_counts: np.ndarray          # (size,) ghosts received from each rank
    send_index: np.ndarray           # (sum send_counts,) local positions to send, grouped by rank
    send_counts: np.ndarray          # (size,) entries sent to each rank

    @property
    def n_local(self) -> int:
        return self.rows.size

    def exchange_bytes(self, itemsize: int = 8, columns: int = 1) -> int:
        """Bytes this rank sends in one halo exchange of a vector (or ``columns`` vectors)."""
        return int(self.send_counts.sum()) * itemsize * columns


def _local_rows_halo(a_rows: sp.csr_matrix, part: RowPartition, rank: int):
    """Renumber the columns of rank's rows; -> (local csr, ghosts, recv lists per rank)."""
    cols = np.unique(a_rows.indices)
    ghosts = cols[part.owner[cols] != rank]
    ghosts = ghosts[np.lexsort((ghosts, part.owner[ghosts]))]           # by owner, then index
    new = np.full(part.n, -1, dtype=np.int64)
    rows = part.rows(rank)
    new[rows] = np.arange(rows.size)
    new[ghosts] = rows.size + np.arange(ghosts.size)
    local = sp.csr_matrix((a_rows.data, new[a_rows.indices], a_rows.indptr),
                          shape=(rows.size, rows.size + ghosts.size))
    local.sort_indices()
    recv_counts = np.bincount(part.owner[ghosts], minlength=part.size)
    recv = np.split(ghosts, np.cumsum(recv_counts)[:-1])
    return local, ghosts, recv_counts, recv


def build_halo(a: sp.spmatrix, part: RowPartition, rank: int, comm=None) -> Halo:
    """Rank ``rank``'s halo of the square matrix ``a`` under ``part``.

    ``a`` may be the whole matrix or only this rank's rows (``len(part.rows(rank))`` x n, in the
    order of ``part.rows(rank)``). The receive lists are local; the send lists come from the other
    ranks' receive lists with one ``alltoall`` of index arrays over ``comm`` (a Communicator or
    an MPI communicator of ``part.size`` ranks). With ``comm=None`` every rank's rows must be in ``a``
    and the send lists are computed locally (the serial path, and a reference for tests).
    """
    a = sp.csr_matrix(a)
    rows = part.rows(rank)
    if a.shape[1] != part.n or a.shape[0] not in (part.n, rows.size):
        raise ValueError(f"build_halo: matrix {a.shape} does not fit a partition of {part.n} rows "
                         f"(rank {rank} owns {rows.size})")
    position = part.local_index()
    a_rows = a[rows] if a.shape[0] == part.n and rows.size != part.n else a
    local, ghosts, recv_counts, recv = _local_rows_halo(a_rows, part, rank)
    comm = as_communicator(comm, "graph")
    if comm is not None:
        if comm.size != part.size or comm.rank != rank:
            raise ValueError(f"build_halo: communicator rank {comm.rank} of "
                             f"{comm.size} does not match rank {rank} of {part.size}")
        wanted = comm.alltoall_objects(recv)                      # wanted[q]: globals rank q needs from me
    else:
        if a.shape[0] != part.n:
            raise ValueError("build_halo: without a communicator the whole matrix is needed")
        wanted = []
        for q in range(part.size):
            if q == rank:
                wanted.append(np.zeros(0, dtype=np.int64))
                continue
            cols = np.unique(a[part.rows(q)].indices)
            wanted.append(cols[part.owner[cols] == rank])
    send_counts = np.array([w.size for w in wanted], dtype=np.int64)
    send_index = position[np.concatenate(wanted)] if wanted else np.zeros(0, dtype=np.int64)
    return Halo(rank, rows, local, ghosts, recv_counts.astype(np.int64),
                send_index.astype(np.int64), send_counts)


def halo_sizes(a: sp.spmatrix, part: RowPartition) -> np.ndarray:
    """(size,) each rank's halo size: the distinct columns its rows reference that another rank
    owns (``build_halo(a, part, r).ghosts.size`` for every r, in one pass over the entries)."""
    coo = sp.coo_matrix(a)
    own_row, own_col = part.owner[coo.row], part.owner[coo.col]
    away = own_row != own_col
    pairs = np.unique(own_row[away] * np.int64(part.n) + coo.col[away])      # (rank, column)
    return np.bincount(pairs // part.n, minlength=part.size).astype(np.int64)


def partition_stats(a: sp.spmatrix, part: RowPartition) -> dict:
    """What a partition costs a distributed GCN layer, from the symmetric ``a`` (``A`` or ``Â``:
    the same off-diagonal pattern): ``edge_cut`` (undirected edges between ranks),
    ``halo_volume`` (rows received per layer by all ranks together, the sum of the halo sizes;
    a layer of f features moves ``8 f halo_volume`` bytes in float64), ``max_halo``,
    ``max_part``, ``min_part`` and ``imbalance`` (max part over the mean)."""
    counts = part.counts()
    halos = halo_sizes(a, part)
    return {"parts": part.size, "edge_cut": part.edge_cut(a) // 2,
            "halo_volume": int(halos.sum()), "max_halo": int(halos.max()),
            "max_part": int(counts.max()), "min_part": int(counts.min()),
            "imbalance": float(counts.max() / counts.mean())}
