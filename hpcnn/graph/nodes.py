"""Semi-supervised node classification: the graph data sets of ``hpcnn train --model=gcn``
(the task that trains on them: :class:`hpcnn.task.GraphTask`).

One step is one full-batch pass over the graph: every node's features go through the GCN
(:mod:`hpcnn.nn.gcn`), the loss is the mean cross-entropy over the **training nodes** (a seeded,
class-balanced choice: ``min(20, max(1, class size // 5))`` nodes per class), the rest are the
test nodes the evaluation scores. Under MPI the graph's rows are split over the data-parallel
ranks (``--dp`` = the number of ranks; which rows each holds: ``--partition``, by default
contiguous blocks of the graph's own node order): each rank runs its rows, the GCN
layers exchange halo rows, and the data-parallel gradient allreduce sums the ranks' weight
gradients into the full-batch gradient.

Data sets (built, never downloaded; :mod:`hpcnn.graph.data`): ``karate`` (34 nodes, 2 factions),
``lesmis`` (77 nodes, no labels: one class, a halo-volume example only), ``digits_knn`` (1797
nodes, 10 digits, the 10-NN graph of the pixels), ``sbm`` (2000 nodes, 4 blocks, 16 noisy
features of signal-to-noise ratio 0.5), ``sbm20k`` (the same model with 20000 nodes). The SBMs'
labels are drawn independently of the node numbering, so their contiguous blocks are as good as
a random partition; digits_knn keeps scikit-learn's order (the digits cycle 0-9).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy
import scipy.sparse as sp

from hpcnn.config import GRAPH_DATASETS



@dataclass
class GraphData:
    """A graph for node classification: Â, features, labels and the node split."""
    name: str
    a_hat: sp.csr_matrix          # (n, n) normalised adjacency
    features: numpy.ndarray       # (n, f) float64
    labels: numpy.ndarray         # (n,) int64
    train: numpy.ndarray          # sorted node indices whose labels the loss sees
    test: numpy.ndarray           # sorted node indices the evaluation scores
    n_classes: int

    @property
    def n_nodes(self) -> int:
        return self.labels.size

    def targets(self) -> numpy.ndarray:
        """The loss's targets: the label on training nodes, -1 (ignored) elsewhere."""
        t = numpy.full(self.n_nodes, -1, dtype=numpy.int64)
        t[self.train] = self.labels[self.train]
        return t


def node_split(labels: numpy.ndarray, seed: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """(train, test) node indices: per class ``min(20, max(1, size // 5))`` nodes drawn with
    ``seed`` for training, all the others for testing."""
    rng = numpy.random.default_rng([int(seed), 7])
    train = []
    for c in numpy.unique(labels):
        members = numpy.flatnonzero(labels == c)
        k = min(20, max(1, members.size // 5))
        train.append(rng.choice(members, size=k, replace=False))
    train = numpy.sort(numpy.concatenate(train))
    return train, numpy.setdiff1d(numpy.arange(labels.size), train)


def graph_data(name: str, seed: int = 0) -> GraphData:
    """The graph data set ``name`` (one of :data:`GRAPH_DATASETS`), split with ``seed``."""
    from hpcnn.graph import data as g
    makers = {"karate": g.karate_club, "lesmis": g.les_miserables,
              "digits_knn": lambda: g.digits_knn(10),
              "sbm": lambda: g.sbm(2000, blocks=4, avg_degree=10.0, features=16, snr=0.5, seed=0),
              "sbm20k": lambda: g.sbm(20000, blocks=4, avg_degree=10.0, features=16, snr=0.5,
                                      seed=0)}
    if name not in makers:
        raise ValueError(f"graph data set {name!r}: expected one of {', '.join(GRAPH_DATASETS)}")
    graph = makers[name]()
    train, test = node_split(graph.labels, seed)
    return GraphData(name, g.normalized_adjacency(graph.adjacency), graph.features,
                     graph.labels, train, test, int(graph.labels.max()) + 1)
