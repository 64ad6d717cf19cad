"""Which partition of a graph's rows over p ranks costs a distributed GCN layer the least halo?

What: for an SBM (``--nodes`` nodes, ``--blocks`` blocks, average degree 10, 80 % of the edges
inside a block) and the 10-NN graph of scikit-learn's digits (1797 nodes), each reduced to its
largest connected component and **renumbered by a seeded random permutation** (so that the
contiguous partition does not inherit an order that follows the classes), and for p in
``--parts``, the script partitions the rows with

    contiguous   blocks of consecutive (shuffled) indices: RowPartition.contiguous
    random       a balanced random assignment: partitioners.random_partition (seed + 1: with
                 the shuffle's own seed it would undo the shuffle, i.e. be the original order)
    spectral     recursive spectral bisection (Fiedler vector of each part, cut at the size the
                 sub-parts sum to): partitioners.spectral_bisection
    metis        METIS k-way through pymetis, only when it is installed (it is not a dependency)

and records, from :func:`hpcnn.graph.partition.partition_stats`: the edge cut (undirected edges
between ranks), the halo volume (rows all ranks receive per layer: the sum of the halo sizes
``build_halo`` would compute), the largest halo, the part sizes, and the seconds the partitioner
took (one run, on a shared machine: indicative only).

Why: in a distributed GCN each layer exchanges the halo rows of H (f features: ``8 f`` bytes a
row in float64); the partition sets this volume (REFERENCES.md section 4). The epoch-time
comparison of these partitions needs the distributed GCN and is not measured here.

    OMP_NUM_THREADS=1 python experiments/graph_partition.py
    python analysis/graph_partition.py runs/graph_partition/results.h5 docs/figures/graph_partition.png

Output: ``<out>/results.h5``, table "partitions" (one row per graph, p and method).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hpcnn.graph.data import digits_knn, largest_component, sbm  # noqa: E402
from hpcnn.graph.partition import partition_stats  # noqa: E402
from hpcnn.graph.partitioners import metis_available, partition  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402


def shuffled(g, seed: int):
    """``g``'s largest component with its nodes renumbered by a seeded random permutation."""
    g = largest_component(g)
    return g.subgraph(np.random.default_rng(seed).permutation(g.n_nodes), g.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/graph_partition")
    ap.add_argument("--nodes", type=int, default=100000, help="SBM nodes")
    ap.add_argument("--blocks", type=int, default=4, help="SBM blocks")
    ap.add_argument("--parts", default="2,4,8")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    parts = [int(p) for p in a.parts.split(",")]
    methods = ["contiguous", "random", "spectral"] + (["metis"] if metis_available() else [])
    if "metis" not in methods:
        print("pymetis is not installed: no METIS rows")
    graphs = [shuffled(sbm(a.nodes, blocks=a.blocks, avg_degree=10, seed=a.seed), a.seed),
              shuffled(digits_knn(10), a.seed)]
    rows = []
    for g in graphs:
        print(f"{g.name}: {g.n_nodes} nodes, {g.n_edges} edges")
        for p in parts:
            for method in methods:
                t0 = time.perf_counter()
                part = partition(g.adjacency, p, method, seed=a.seed + 1)   # not the shuffle's
                seconds = time.perf_counter() - t0
                s = partition_stats(g.adjacency, part)
                rows.append({"graph": g.name, "nodes": g.n_nodes, "edges": g.n_edges, "parts": p,
                             "method": method, "edge_cut": s["edge_cut"],
                             "cut_fraction": s["edge_cut"] / g.n_edges,
                             "halo_volume": s["halo_volume"],
                             "halo_per_node": s["halo_volume"] / g.n_nodes,
                             "max_halo": s["max_halo"], "max_part": s["max_part"],
                             "min_part": s["min_part"], "seconds": seconds})
                print(f"  p={p} {method:10s} cut {s['edge_cut']:7d} ({s['edge_cut'] / g.n_edges:5.1%})"
                      f"  halo volume {s['halo_volume']:7d} ({s['halo_volume'] / g.n_nodes:.2f}/node)"
                      f"  parts {s['min_part']}-{s['max_part']}  {seconds:.2f} s", flush=True)
    out = os.path.join(a.out, "results.h5")
    save_table(out, "partitions", rows, attrs={"sbm_nodes": a.nodes, "sbm_blocks": a.blocks,
                                               "seed": a.seed, "metis": "metis" in methods,
                                               "load": os.getloadavg()[0]})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
