"""Semi-supervised node classification: the graph data sets of ``hpcnn train --model=gcn``
(the task that trains on them: :class:`hpcnn.task.GraphTask`).

One step is one full-batch pass over the graph: every node's features go through the GCN
(:mod:`hpcnn.nn.gcn`), the loss is the mean cross-entropy over the **training nodes** (a seeded,
class-balanced choice: ``min(20, max(1, class size // 5))`` nodes per class), the rest are the
test nodes the evaluation scores. Under MPI the graph's rows are split over the data-parallel
ranks (``--dp``; which rows: ``--partition``, by default contiguous blocks of the graph's node
order); the GCN layers exchange halo rows and the gradient allreduce sums the ranks' weight
gradients into the full-batch gradient.

Data sets (built, never downloaded; :mod:`hpcnn.graph.graphs`): ``karate`` (34 nodes, 2 factions),
``lesmis`` (77 nodes, one class: a halo-volume example only), ``digits_knn`` (1797 nodes, 10
digits, the 10-NN graph of the pixels, in scikit-learn's order), ``sbm`` (2000 nodes, 4 blocks,
16 noisy features of signal-to-noise ratio 0.5), ``sbm20k`` (the same with 20000 nodes; the SBMs'
labels are independent of the numbering, so contiguous blocks are as good as a random partition).

Graph reduction (``--coarsen=heavy_edge|spectral|random --reduction=R``,
:mod:`hpcnn.graph.coarsen`): :func:`graph_data` returns the **coarse** graph to train on, with
the full graph in ``full`` to evaluate on (a GCN's weights do not depend on the node count). A
coarse node is a training node when its group holds a fine training node, its target the
majority label **of those training nodes** (ties: the smallest), never a test node's label; the
others carry -1, ignored by the loss. The split is the full graph's (same ``seed``), so a reduced
run is scored on the same test nodes. Spectral features (``--spectral_features=K``) are appended
in :func:`hpcnn.task.build_graph_task`: U_k of the full graph's Â, group means on a coarse graph.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy
import scipy.sparse as sp

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
    adjacency: sp.csr_matrix | None = None   # A (unnormalised), for the spectral features
    full: "GraphData | None" = None      # the graph to evaluate on, when this one is its coarsening
    coarsening: object = None            # the hpcnn.graph.coarsen.Coarsening from full to this graph
    record: dict = field(default_factory=dict)    # what was done to the data, for the log's /plan

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


def coarsened(data: GraphData, method: str, reduction: float, seed: int = 0) -> GraphData:
    """``data`` coarsened by ``method`` (heavy_edge, spectral or random) to ``round(reduction
    n)`` nodes; the full graph kept in ``full`` (module docstring: the coarse training nodes and
    their targets)."""
    from hpcnn.graph import coarsen
    from hpcnn.graph.graphs import normalized_adjacency
    t0 = time.perf_counter()
    n, adjacency = data.n_nodes, data.adjacency
    if method == "heavy_edge":
        c = coarsen.heavy_edge_matching(adjacency, reduction, seed=seed)
    elif method == "spectral":
        c = coarsen.spectral_clustering(adjacency, reduction, k=min(8, n - 2), seed=seed)
    elif method == "random":
        c = coarsen.random_assignment(n, coarsen._target(n, reduction), seed=seed)
    else:
        raise ValueError(f"coarsen={method!r}: expected heavy_edge, spectral or random")
    groups = c.assign[data.train]
    votes = numpy.zeros((c.n_coarse, data.n_classes), dtype=numpy.int64)
    numpy.add.at(votes, (groups, data.labels[data.train]), 1)
    train = numpy.unique(groups)
    labels = numpy.full(c.n_coarse, -1, dtype=numpy.int64)
    labels[train] = votes[train].argmax(axis=1)          # argmax: ties go to the smallest label
    seconds = time.perf_counter() - t0
    record = {"coarsen": method, "reduction": float(reduction), "nodes": n,
              "coarse_nodes": c.n_coarse, "coarse_ratio": c.ratio,
              "coarse_train_nodes": int(train.size), "train_nodes": int(data.train.size),
              "coarsen_s": seconds}
    a_coarse = c.coarse_adjacency(adjacency)
    return GraphData(f"{data.name}_{method}{c.n_coarse}", normalized_adjacency(a_coarse),
                     c.mean_features(data.features), labels, train,
                     numpy.setdiff1d(numpy.arange(c.n_coarse), train), data.n_classes,
                     a_coarse, full=data, coarsening=c, record=record)


def from_graph(graph, seed: int = 0) -> GraphData:
    """The node-classification data of a :class:`hpcnn.graph.graphs.Graph`, split with ``seed``."""
    from hpcnn.graph.graphs import normalized_adjacency
    train, test = node_split(graph.labels, seed)
    return GraphData(graph.name, normalized_adjacency(graph.adjacency), graph.features,
                     graph.labels, train, test, int(graph.labels.max()) + 1, graph.adjacency)


def makers() -> dict:
    """Each graph data set's name (``--dataset`` of ``--model=gcn``: config.GRAPH_DATASETS) ->
    a function building its :class:`~hpcnn.graph.graphs.Graph`."""
    from hpcnn.graph import graphs
    return {"karate": graphs.karate_club, "lesmis": graphs.les_miserables,
            "digits_knn": lambda: graphs.digits_knn(10),
            "sbm": lambda: graphs.sbm(2000, blocks=4, avg_degree=10.0, features=16, snr=0.5,
                                      seed=0),
            "sbm20k": lambda: graphs.sbm(20000, blocks=4, avg_degree=10.0, features=16,
                                         snr=0.5, seed=0)}


def graph_data(name: str, seed: int = 0, coarsen: str = "none", reduction: float = 1.0
               ) -> GraphData:
    """The graph data set ``name`` (one of :func:`makers`), split with ``seed``;
    with ``coarsen`` (not "none"), its coarsening to ``reduction`` of the nodes
    (:func:`coarsened`, seeded by ``seed``)."""
    built = makers()
    if name not in built:
        raise ValueError(f"graph data set {name!r}: expected one of {', '.join(built)}")
    data = replace(from_graph(built[name](), seed), name=name)
    if coarsen == "none":
        return data
    return coarsened(data, coarsen, reduction, seed)
