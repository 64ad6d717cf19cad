"""Graph data upstream of a GNN: graphs as sparse matrices, row partitions, Krylov eigensolvers.

- :mod:`hpcnn.graph.graphs`: :class:`Graph` (CSR adjacency, features, labels), the normalised
  adjacency Â, the bundled and generated data sets, HDF5 files;
- :mod:`hpcnn.graph.rows`: 1-D row partitions and their halo (send/receive lists);
- :mod:`hpcnn.graph.krylov`: the distributed matvec and thick-restart Lanczos over a Communicator;
- :mod:`hpcnn.graph.unite`: unite and conquer, co-operating Lanczos instances on rank groups.

Nothing here loads MPI at import: the serial path (``comm=None``) makes no MPI call.
"""
from hpcnn.graph.graphs import (Graph, digits_knn, karate_club, largest_component, les_miserables,
                                load_graph, normalized_adjacency, save_graph, sbm)
from hpcnn.graph.krylov import DistributedMatrix, LanczosResult, lanczos
from hpcnn.graph.rows import Halo, RowPartition, build_halo
from hpcnn.graph.unite import UniteResult, unite_and_conquer

__all__ = ["Graph", "digits_knn", "karate_club", "largest_component", "les_miserables",
           "load_graph", "normalized_adjacency", "save_graph", "sbm", "DistributedMatrix",
           "LanczosResult", "lanczos", "Halo", "RowPartition", "build_halo", "UniteResult",
           "unite_and_conquer"]
