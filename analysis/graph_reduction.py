"""Figure of experiments/graph_reduction.py, made only from its HDF5 table:

    python analysis/graph_reduction.py runs/graph_reduction/results.h5 docs/figures/graph_reduction.png

One row of panels per graph. Left: the full graph's test accuracy of the GCN trained on the
coarse graph, relative to the full-graph run (median over the seeds of the per-seed ratio; the
dotted line: the target, 95 %), against the fraction of nodes kept; right: the training loop's
wall time relative to the full-graph run's. One line per coarsening method. Printed: the
median accuracies and time ratios, and per graph and method whether the target holds at 30 %.
"""
import sys

import numpy as np

from graph_features import table_and_pyplot  # noqa: E402
from hpcnn.log.report import save_figure  # noqa: E402

STYLE = {"spectral": ("tab:blue", "o"), "heavy_edge": ("tab:green", "^"),
         "random": ("tab:red", "x")}
TARGET = 0.95


def relative(t, on, method, column):
    """(ratios, per-ratio median over seeds of column / the same seed's full-graph value)."""
    full = {int(s): v for s, v in zip(t["seed"][on & (t["ratio"] == 1)],
                                      t[column][on & (t["ratio"] == 1)])}
    sel = on & (t["method"] == method)
    ratios = np.unique(t["ratio"][sel])[::-1]
    med = [np.median([v / full[int(s)] for s, v in zip(t["seed"][sel & (t["ratio"] == r)],
                                                        t[column][sel & (t["ratio"] == r)])])
           for r in ratios]
    return np.concatenate([[1.0], ratios]), np.concatenate([[1.0], med])


def main(argv=None) -> int:
    a, t, attrs, plt = table_and_pyplot(argv, __doc__, "reduction")
    graphs = list(dict.fromkeys(t["graph"].tolist()))
    fig, axes = plt.subplots(len(graphs), 2, figsize=(10, 3.4 * len(graphs)), squeeze=False)
    for (acc_ax, time_ax), g in zip(axes, graphs):
        on = t["graph"] == g
        full_acc = np.median(t["test_acc"][on & (t["ratio"] == 1)])
        print(f"{g} ({int(t['nodes'][on][0])} nodes): full-graph accuracy {full_acc:.3f}")
        for method in STYLE:
            if not (on & (t["method"] == method)).any():
                continue
            color, marker = STYLE[method]
            ratios, acc = relative(t, on, method, "test_acc")
            _, wall = relative(t, on, method, "wall_s")
            acc_ax.plot(ratios, acc, marker=marker, color=color, label=method)
            time_ax.plot(ratios, wall, marker=marker, color=color, label=method)
            at = dict(zip(ratios[1:], acc[1:]))
            print(f"  {method:10s} " + "  ".join(f"r={r:g}: {v:.3f} acc, {w:.2f} time"
                                                  for r, v, w in zip(ratios, acc, wall))
                  + (f"  | target at 0.3: {'holds' if at[0.3] >= TARGET else 'fails'}"
                     if 0.3 in at else ""))
        acc_ax.axhline(TARGET, color="gray", ls=":", label="95 % target")
        acc_ax.axvline(0.3, color="gray", ls="--", lw=0.8)
        acc_ax.set_ylabel("accuracy / full-graph accuracy")
        acc_ax.set_title(f"{g}: full-graph accuracy {full_acc:.3f}", fontsize=9)
        time_ax.set_ylabel("training time / full graph's")
        for ax in (acc_ax, time_ax):
            ax.set_xscale("log")
            ax.set_xlabel("coarse nodes / nodes")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.suptitle(f"GCN trained on the coarse graph, scored on the full graph "
                 f"({np.unique(t['seed']).size} seeds, {attrs.get('steps')} steps, load "
                 f"{attrs.get('load_1min', float('nan')):.1f})", fontsize=10)
    fig.tight_layout()
    save_figure(fig, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
