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
    metis        METIS k-way through pymetis (the ``data`` extra installs it; skipped without it)

and records, from :func:`hpcnn.graph.rows.partition_stats`: the edge cut (undirected edges
between ranks), the halo volume (rows all ranks receive per layer: the sum of the halo sizes
``build_halo`` would compute), the largest halo, the part sizes, and the seconds the partitioner
took (one run, on a shared machine: indicative only).

Why: in a distributed GCN each layer exchanges the halo rows of H (f features: ``8 f`` bytes a
row in float64); the partition sets this volume (REFERENCES.md section 4).

Epoch time: for each training data set of ``--train_graphs`` (``hpcnn train --dataset``), p in
``--train_parts`` and partition kind in ``--kinds``, the script runs
``mpiexec -n p python -m mpi4py -m hpcnn train --model=gcn --dp=p --partition=KIND`` for
``--steps`` full-batch steps (one step = one epoch: every node's rows; ``--hidden``, float32,
no evaluation), the kinds' order reversed every other round (``--rounds``). A run's figure is
its median ``step_time`` after the first 20 % of steps; a case's figure the median over rounds.
Its halo bytes per layer (both directions counted once: the forward exchange), rows per rank
and edge cut come from the run log's ``/plan``. The training data sets keep their own
numbering: the SBMs' node indices are independent of the blocks (contiguous blocks of them are
a random partition in distribution), digits_knn is in scikit-learn's order (digits cycling
0-9, some locality: contiguous blocks cut fewer edges than random ones); ``random`` is what
contiguous blocks of a shuffled numbering are. With p above the cores the ranks share them:
the times then include the oversubscription.

    OMP_NUM_THREADS=1 python experiments/graph_partition.py
    python analysis/graph_partition.py runs/graph_partition/results.h5 docs/figures/graph_partition.png

Output: ``<out>/results.h5``, table "partitions" (one row per graph, p and method) and table
"epochs" (one row per training data set, p and kind), the run logs under ``<out>/runs``.
"""
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from hpcnn import scripts  # noqa: E402
from hpcnn.graph.graphs import digits_knn, largest_component, sbm  # noqa: E402
from hpcnn.graph.rows import partition_stats  # noqa: E402
from hpcnn.graph.partitioners import metis_available, partition  # noqa: E402
from hpcnn.log import read_run  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402



def shuffled(g, seed: int):
    """``g``'s largest component with its nodes renumbered by a seeded random permutation."""
    g = largest_component(g)
    return g.subgraph(np.random.default_rng(seed).permutation(g.n_nodes), g.name)


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--out", default="runs/graph_partition")
    ap.add_argument("--nodes", type=int, default=100000, help="SBM nodes")
    ap.add_argument("--blocks", type=int, default=4, help="SBM blocks")
    ap.add_argument("--parts", default="2,4,8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train_graphs", default="sbm20k,digits_knn",
                    help="hpcnn train data sets timed per partition ('' = none)")
    ap.add_argument("--train_parts", default="2,4")
    ap.add_argument("--kinds", default="contiguous,random,spectral,metis",
                    help="partitions timed in training (metis only where pymetis is installed)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
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
    if a.train_graphs:
        epochs, loads = epoch_times(a)
        save_table(out, "epochs", epochs, attrs={"steps": a.steps, "rounds": a.rounds,
                                                 "hidden": a.hidden, "load_min": min(loads),
                                                 "load_max": max(loads)})
    print(f"wrote {out}")
    return 0


def train_run(graph: str, p: int, kind: str, a, log: str) -> dict:
    """One ``hpcnn train --model=gcn`` on p ranks; its median step time and /plan partition."""
    cmd = scripts.mpi_command(p, [
        "-m", "hpcnn", "train", "--model=gcn", f"--dataset={graph}", f"--dp={p}",
        f"--partition={kind}", f"--steps={a.steps}", f"--hidden={a.hidden}", "--dtype=float32",
        "--eval_interval=0", "--progress=false", "--allreduce=mpi", f"--log={log}"])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    run = read_run(log)
    t = run.metrics["step_time"]
    layout = run.plan["operator_layout"]
    return {"step_s": float(statistics.median(t[len(t) // 5:])),
            "halo_bytes_per_layer": int(layout["halo_bytes_per_layer"][0]),
            "halo_rows": int(sum(layout["halo_rows_per_rank"])),
            "edge_cut": int(layout["edge_cut"]) // 2, "max_part": max(layout["rows_per_rank"]),
            "partition_s": float(layout["partition_seconds"])}


def epoch_times(a) -> tuple[list, list]:
    """Every (training graph, p, kind) trained ``a.rounds`` times, kinds alternating; rows of
    medians and the load averages seen at each round's start."""
    graphs, parts, kinds = a.train_graphs.split(","), [int(p) for p in a.train_parts.split(",")], \
        [k for k in a.kinds.split(",") if k != "metis" or metis_available()]
    folder = os.path.abspath(os.path.join(a.out, "runs"))
    os.makedirs(folder, exist_ok=True)
    got, loads = {}, []
    for r in range(a.rounds):
        loads.append(os.getloadavg()[0])
        for graph in graphs:
            for p in parts:
                for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                    log = os.path.join(folder, f"{graph}-p{p}-{kind}-r{r}.h5")
                    got.setdefault((graph, p, kind), []).append(train_run(graph, p, kind, a, log))
        print(f"round {r + 1}/{a.rounds} done (load {loads[-1]:.2f})", flush=True)
    rows = []
    for (graph, p, kind), runs in got.items():
        first = runs[0]
        row = {"graph": graph, "parts": p, "kind": kind,
               "step_s": float(statistics.median(x["step_s"] for x in runs)),
               "step_min_s": min(x["step_s"] for x in runs),
               "step_max_s": max(x["step_s"] for x in runs),
               "partition_s": float(statistics.median(x["partition_s"] for x in runs)),
               **{k: first[k] for k in ("halo_bytes_per_layer", "halo_rows", "edge_cut",
                                        "max_part")}}
        rows.append(row)
        print(f"  {graph:10s} p={p} {kind:10s} epoch {row['step_s'] * 1e3:7.2f} ms "
              f"(range {row['step_min_s'] * 1e3:.2f}-{row['step_max_s'] * 1e3:.2f})  halo "
              f"{row['halo_bytes_per_layer'] / 1024:8.1f} KiB/layer  cut {row['edge_cut']}  "
              f"partition {row['partition_s']:.2f} s", flush=True)
    return rows, loads


if __name__ == "__main__":
    sys.exit(main())
