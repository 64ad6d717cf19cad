"""How far can a graph be coarsened before a GCN trained on it loses accuracy on the full graph?

What: for an SBM (``--nodes`` nodes, 4 blocks, average degree 10, 16 features of
signal-to-noise ratio ``--snr``) and the 10-NN graph of scikit-learn's digits (1797 nodes, the
64 pixels as features), and each ratio in ``--ratios``, the graph is coarsened to that fraction of
its nodes by heavy-edge matching, spectral clustering (k-means on U_8) or a random assignment
(:mod:`hpcnn.graph.coarsen`, as ``hpcnn train --model=gcn --coarsen=METHOD --reduction=R``
does); a 2-layer GCN (hidden 16, AdamW lr 0.01, ``--steps`` full-batch steps) is trained on the
coarse graph (coarse training nodes: the groups holding a fine training node, their target the
majority label of those; :mod:`hpcnn.graph.nodes`) and evaluated, with the same weights, on the
full graph's test nodes. Ratio 1 is the full-graph run. ``--seeds`` seeds (the split, the
coarsening and the initial weights). Recorded per run: the test accuracy, the coarse node count,
the coarsening's seconds and the training loop's wall time.

Why: the thesis's second claim (REFERENCES.md section 4): the graph processing upstream of the
GNN can reduce the data it trains on while keeping the accuracy; the issue's target is 95 % of
the full-graph accuracy with 30 % of the nodes.

    OMP_NUM_THREADS=1 python experiments/graph_reduction.py
    python analysis/graph_reduction.py runs/graph_reduction/results.h5 docs/figures/graph_reduction.png

Output: ``<out>/results.h5``, table "reduction" (one row per graph, method, ratio and seed); the
runs' logs under ``<out>/logs``.
"""
import os
import sys

from graph_features import train_gcn  # noqa: E402
from hpcnn import scripts  # noqa: E402
from hpcnn.graph.graphs import digits_knn, sbm  # noqa: E402
from hpcnn.graph.nodes import coarsened, from_graph  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402

METHODS = ("spectral", "heavy_edge", "random")


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--out", default="runs/graph_reduction")
    ap.add_argument("--nodes", type=int, default=5000, help="SBM nodes")
    ap.add_argument("--snr", type=float, default=0.5, help="SBM feature signal-to-noise ratio")
    ap.add_argument("--ratios", default="1,0.5,0.3,0.1,0.05")
    ap.add_argument("--graphs", default="sbm,digits_knn")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args(argv)
    makers = {"sbm": lambda: sbm(a.nodes, blocks=4, avg_degree=10.0, features=16, snr=a.snr),
              "digits_knn": lambda: digits_knn(10)}
    rows = []
    for name in a.graphs.split(","):
        graph = makers[name]()
        for seed in range(a.seeds):
            full = from_graph(graph, seed)
            for ratio in [float(r) for r in a.ratios.split(",")]:
                for method in METHODS if ratio < 1 else ("none",):
                    data = full if ratio == 1 else coarsened(full, method, ratio, seed)
                    r = train_gcn(data, name, a.out, seed, a.steps)
                    rows.append({"graph": name, "nodes": full.n_nodes, "method": method,
                                 "ratio": ratio, "seed": seed, "coarse_nodes": data.n_nodes,
                                 "coarse_train_nodes": int(data.train.size),
                                 "coarsen_s": data.record.get("coarsen_s", 0.0),
                                 "test_acc": r["test_acc"], "wall_s": r["wall_s"]})
                    print(f"{name} seed {seed} {method:10s} ratio {ratio:4.2f} "
                          f"({data.n_nodes:5d} nodes): test_acc {r['test_acc']:.3f}, train "
                          f"{r['wall_s']:.2f} s, coarsen {rows[-1]['coarsen_s']:.2f} s", flush=True)
    save_table(os.path.join(a.out, "results.h5"), "reduction", rows,
               {"steps": a.steps, "hidden": 16, "lr": 0.01, "snr": a.snr,
                "load_1min": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
