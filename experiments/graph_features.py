"""Do spectral node features help a GCN, and most when the features are noisy?

What: an SBM (``--nodes`` nodes, ``--blocks`` blocks, average degree 10, 80 % of the edges inside
a block) with 16 features ``X = snr * M[y] + noise`` for each ``snr`` in ``--snrs``; for each, a
2-layer GCN (hidden 16, AdamW lr 0.01, ``--steps`` full-batch steps, 20 training nodes per class)
is trained by :func:`hpcnn.train.train` (the library, as ``hpcnn train --model=gcn`` runs it)
on X alone and with ``--spectral_features=k`` (``[X, U_k]``, U_k the k dominant eigenvectors of
Â, ``--k`` default = the number of blocks), for ``--seeds`` seeds (each seed draws the graph, the
features, the split and the initial weights). Recorded per run: the test accuracy on the other
nodes, the training wall time and the seconds the eigenvectors took.

Why: Q. Petit's thesis (REFERENCES.md section 4) processes the graph upstream of the GNN; the
claim tested is that spectral features raise the accuracy, most when the node features carry
little signal (at snr 0 they carry none: what a GCN learns then comes from the graph alone).

    OMP_NUM_THREADS=1 python experiments/graph_features.py
    python analysis/graph_features.py runs/graph_features/results.h5 docs/figures/graph_features.png

Output: ``<out>/results.h5``, table "features" (one row per snr, k and seed); the runs' logs
under ``<out>/logs``.
"""
import os
import sys

from hpcnn import scripts  # noqa: E402
from hpcnn.config import parse_overrides  # noqa: E402
from hpcnn.graph.graphs import sbm  # noqa: E402
from hpcnn.graph.nodes import from_graph  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.train import train  # noqa: E402


def train_gcn(data, dataset: str, out: str, seed: int, steps: int, *options) -> dict:
    """Train the GCN on ``data`` (``hpcnn train --model=gcn`` with ``options``), its log under
    ``out``; -> {test_acc, wall_s (the training loop), preprocessing record}."""
    name = "-".join([data.name, f"s{seed}", *(o.strip("-").replace("=", "") for o in options)])
    cfg = parse_overrides(["--model=gcn", f"--dataset={dataset}", "--hidden=16", "--lr=0.01",
                           f"--steps={steps}", "--eval_interval=0", "--progress=false",
                           f"--seed={seed}", f"--log={os.path.join(out, 'logs', name + '.h5')}",
                           *options])
    result = train(cfg, data=data)
    return {"test_acc": result["test_acc"], "wall_s": result["wall_s"],
            "preprocessing": _preprocessing(cfg)}


def _preprocessing(cfg) -> dict:
    """The /plan record of the run just logged (what was done to the data, the seconds)."""
    from hpcnn.log import read_run
    return read_run(cfg.log).plan["operator_layout"].get("preprocessing", {})


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--out", default="runs/graph_features")
    ap.add_argument("--nodes", type=int, default=3000)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--snrs", default="0,0.1,0.2,0.5,1,2")
    ap.add_argument("--k", type=int, default=0, help="eigenvectors; 0 = the number of blocks")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args(argv)
    k = a.k or a.blocks
    rows = []
    for snr in [float(s) for s in a.snrs.split(",")]:
        for seed in range(a.seeds):
            g = sbm(a.nodes, blocks=a.blocks, avg_degree=10.0, features=16, snr=snr, seed=seed)
            data = from_graph(g, seed)
            for kk in (0, k):
                r = train_gcn(data, "sbm", a.out, seed, a.steps, f"--spectral_features={kk}")
                rows.append({"snr": snr, "k": kk, "seed": seed, "nodes": a.nodes,
                             "blocks": a.blocks, "test_acc": r["test_acc"], "wall_s": r["wall_s"],
                             "spectral_s": r["preprocessing"].get("spectral_s", 0.0)})
                print(f"snr {snr:4.2f} seed {seed} k {kk}: test_acc {r['test_acc']:.3f} "
                      f"({r['wall_s']:.2f} s)", flush=True)
    save_table(os.path.join(a.out, "results.h5"), "features", rows,
               {"steps": a.steps, "hidden": 16, "lr": 0.01, "avg_degree": 10.0,
                "intra_fraction": 0.8, "features": 16, "load_1min": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
