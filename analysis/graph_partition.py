"""Figure of experiments/graph_partition.py, made only from its HDF5 table:

    python analysis/graph_partition.py runs/graph_partition/results.h5 docs/figures/graph_partition.png

One row of panels per graph. Left: the edge cut as a fraction of the edges against the number of
parts p; right: the halo volume (rows all ranks receive per GCN layer) per node. One line per
partitioner (contiguous, random, spectral bisection, METIS when it was run). When the results
hold the "epochs" table, a last row: the median epoch (full-batch step) time of
``hpcnn train --model=gcn --partition=KIND`` (left; the bars: the range over rounds) and its
halo bytes per layer (right) against p, one line per kind, solid for the first training data
set, dashed for the second, dotted for a third.
"""
import sys

import numpy as np

from hpcnn import scripts  # noqa: E402
from hpcnn.log.report import save_figure  # noqa: E402
from hpcnn.log.results import load_table  # noqa: E402

STYLE = {"contiguous": ("tab:gray", "s"), "random": ("tab:red", "x"),
         "spectral": ("tab:blue", "o"), "metis": ("tab:green", "^")}


def epoch_panels(row, t, attrs) -> None:
    """Epoch time and halo bytes per layer against p, per training graph and partition kind."""
    dashes = ("-", "--", ":")
    for gi, g in enumerate(dict.fromkeys(t["graph"].tolist())):
        for kind in dict.fromkeys(t["kind"].tolist()):
            sel = (t["graph"] == g) & (t["kind"] == kind)
            order = np.argsort(t["parts"][sel])
            p = t["parts"][sel][order]
            color, marker = STYLE.get(kind, ("k", "."))
            ms = 1e3 * t["step_s"][sel][order]
            err = [ms - 1e3 * t["step_min_s"][sel][order], 1e3 * t["step_max_s"][sel][order] - ms]
            style = dict(color=color, marker=marker, linestyle=dashes[gi % 3], label=f"{g} {kind}")
            row[0].errorbar(p, ms, yerr=err, capsize=3, **style)
            row[1].plot(p, t["halo_bytes_per_layer"][sel][order] / 2**10, **style)
    load = f"load {float(attrs['load_min']):.1f}-{float(attrs['load_max']):.1f}"
    row[0].set_title(f"hpcnn train --model=gcn: median epoch, {int(attrs['rounds'])} rounds, {load}",
                     fontsize=9)
    row[0].set_ylabel("epoch (full-batch step) ms")
    row[1].set_title(f"halo per layer (hidden {int(attrs['hidden'])}, float32, one direction)",
                     fontsize=9)
    row[1].set_ylabel("KiB (log scale)")
    row[1].set_yscale("log")
    row[0].set_ylim(bottom=0)
    for ax in row:
        ax.set_xlabel("ranks p")
        ax.set_xticks(sorted(set(t["parts"].tolist())))
        ax.grid(alpha=0.3)
    row[0].legend(fontsize=7)


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("results")
    ap.add_argument("png")
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import h5py
    t, attrs = load_table(a.results, "partitions")
    with h5py.File(a.results, "r") as f:
        has_epochs = "epochs" in f
    graphs = list(dict.fromkeys(t["graph"].tolist()))
    fig, axes = plt.subplots(len(graphs) + has_epochs, 2, figsize=(9, 3.2 * (len(graphs) + has_epochs)),
                             squeeze=False)
    if has_epochs:
        epoch_panels(axes[-1], *load_table(a.results, "epochs"))
    for row, g in zip(axes, graphs):
        on = t["graph"] == g
        n, e = int(t["nodes"][on][0]), int(t["edges"][on][0])
        for method in dict.fromkeys(t["method"][on].tolist()):
            sel = on & (t["method"] == method)
            order = np.argsort(t["parts"][sel])
            color, marker = STYLE.get(method, ("k", "."))
            for ax, col in zip(row, ("cut_fraction", "halo_per_node")):
                ax.plot(t["parts"][sel][order], t[col][sel][order], color=color, marker=marker,
                        label=method)
        row[0].set_ylabel("edge cut / edges")
        row[1].set_ylabel("halo rows received per layer / n")
        for ax in row:
            ax.set_title(f"{g} ({n} nodes, {e} edges, shuffled)", fontsize=9)
            ax.set_xlabel("parts p")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    print(f"wrote {save_figure(fig, a.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
