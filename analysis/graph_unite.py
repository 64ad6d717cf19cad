"""Figure of benchmarks/graph_unite.py, made only from its HDF5 tables:

    python analysis/graph_unite.py runs/bench/graph_unite.h5 docs/figures/graph_unite.png

One row of panels per rank count found in the file (tables ``unite_p{P}``, ``history_p{P}``).
Left: the largest relative residual estimate of the k wanted Ritz pairs after each restart
cycle; right: the same against the seconds since the solver started (one round's history; the
legend gives each variant's median time over rounds). Single Lanczos with basis m1 and m2 on all
P ranks, unite and conquer with (m1, m2) on two halves (thick line: the better instance's
estimate, which the exchange makes the state both restart from; thin lines: each instance's).
"""
import sys

import h5py

from hpcnn import scripts  # noqa: E402
from hpcnn.log.report import save_figure  # noqa: E402
from hpcnn.log.results import load_table  # noqa: E402

STYLE = {"single_m1": "tab:gray", "single_m2": "tab:blue", "unite": "tab:red"}


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("results")
    ap.add_argument("png")
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with h5py.File(a.results, "r") as f:
        ranks = sorted(int(k[len("unite_p"):]) for k in f if k.startswith("unite_p"))
    if not ranks:
        raise SystemExit(f"{a.results}: no unite_p* table (run benchmarks/graph_unite.py)")
    fig, axes = plt.subplots(len(ranks), 2, figsize=(10, 3.4 * len(ranks)), squeeze=False)
    for row, p in zip(axes, ranks):
        summary, attrs = load_table(a.results, f"unite_p{p}")
        hist, _ = load_table(a.results, f"history_p{p}")
        for i, v in enumerate(summary["variant"].tolist()):
            m1, m2 = int(summary["m1"][i]), int(summary["m2"][i])
            label = {"single_m1": f"Lanczos m={m1}", "single_m2": f"Lanczos m={m2}",
                     "unite": f"U&C ({m1}, {m2})"}[v]
            label += f": {int(summary['restarts'][i])} restarts, {summary['seconds'][i]:.2f} s"
            sel = hist["variant"] == v
            for ax, x in zip(row, (hist["cycle"][sel], hist["seconds"][sel])):
                ax.semilogy(x, hist["residual"][sel], color=STYLE[v], lw=2, label=label)
                if v == "unite":
                    for col, ls in (("instance_m1", ":"), ("instance_m2", "--")):
                        ax.semilogy(x, hist[col][sel], color=STYLE[v], lw=0.8, ls=ls)
        tol = float(summary["tol"][0])
        title = (f"{p} ranks, SBM Â {int(summary['nodes'][0])} nodes, k={int(summary['k'][0])}, "
                 f"load {float(attrs['load_avg_1min']):.1f}")
        for ax, xl in zip(row, ("restart cycle", "seconds")):
            ax.axhline(tol, color="k", lw=0.6)
            ax.set_xlabel(xl)
            ax.set_ylabel("largest relative residual estimate")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    print(f"wrote {save_figure(fig, a.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
