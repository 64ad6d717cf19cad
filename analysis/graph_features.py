"""Figure of experiments/graph_features.py, made only from its HDF5 table:

    python analysis/graph_features.py runs/graph_features/results.h5 docs/figures/graph_features.png

Left: the test accuracy (median over the seeds, the bars their range) against the features'
signal-to-noise ratio, the GCN on X alone and on [X, U_k]; right: the gain of the spectral
features (median of the per-seed differences). Printed: the same numbers as a table.
"""
import sys

import numpy as np

from hpcnn import scripts  # noqa: E402
from hpcnn.log.report import save_figure  # noqa: E402
from hpcnn.log.results import load_table  # noqa: E402


def table_and_pyplot(argv, doc: str, name: str):
    """The command line ``RESULTS PNG`` of a graph analysis script (``doc``: its docstring)
    -> (the arguments, the columns and attributes of table ``name`` of RESULTS, pyplot drawing
    without a display)."""
    ap = scripts.parser(doc)
    ap.add_argument("results")
    ap.add_argument("png")
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(a.results, name)
    return a, t, attrs, plt


def main(argv=None) -> int:
    a, t, attrs, plt = table_and_pyplot(argv, __doc__, "features")
    snrs = np.unique(t["snr"])
    ks = np.unique(t["k"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    acc = {}
    for k in ks:
        acc[k] = np.array([[t["test_acc"][(t["snr"] == s) & (t["k"] == k) & (t["seed"] == seed)][0]
                            for seed in np.unique(t["seed"])] for s in snrs])      # (snr, seed)
        med = np.median(acc[k], axis=1)
        err = [med - acc[k].min(axis=1), acc[k].max(axis=1) - med]
        left.errorbar(np.arange(snrs.size), med, yerr=err, marker="o", capsize=3,
                      label="X only" if k == 0 else f"[X, U_{k}] (--spectral_features={k})")
    gain = np.median(acc[ks[-1]] - acc[0], axis=1)
    right.bar(np.arange(snrs.size), gain, color="tab:blue")
    for ax in (left, right):
        ax.set_xticks(np.arange(snrs.size), [f"{s:g}" for s in snrs])
        ax.set_xlabel("feature signal-to-noise ratio")
        ax.grid(alpha=0.3)
    n, b = int(t["nodes"][0]), int(t["blocks"][0])
    left.axhline(1.0 / b, color="gray", ls=":", label="chance")
    left.set_ylabel("test accuracy (median over seeds)")
    left.legend(fontsize=8)
    right.set_ylabel("accuracy gain of the spectral features")
    fig.suptitle(f"2-layer GCN on an SBM of {n} nodes, {b} blocks "
                 f"({np.unique(t['seed']).size} seeds, {attrs.get('steps')} steps, load "
                 f"{attrs.get('load_1min', float('nan')):.1f})", fontsize=10)
    fig.tight_layout()
    save_figure(fig, a.png)
    print("snr   " + "  ".join(f"k={k:<5d}" for k in ks) + "  gain")
    for i, s in enumerate(snrs):
        print(f"{s:<5g} " + "  ".join(f"{np.median(acc[k][i]):.3f}  " for k in ks)
              + f"  {gain[i]:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
