"""Figure of experiments/graph_partition.py, made only from its HDF5 table:

    python analysis/graph_partition.py runs/graph_partition/results.h5 docs/figures/graph_partition.png

One row of panels per graph. Left: the edge cut as a fraction of the edges against the number of
parts p; right: the halo volume (rows all ranks receive per GCN layer) per node. One line per
partitioner (contiguous, random, spectral bisection, METIS when it was run).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hpcnn.log.report import save_figure  # noqa: E402
from hpcnn.log.results import load_table  # noqa: E402

STYLE = {"contiguous": ("tab:gray", "s"), "random": ("tab:red", "x"),
         "spectral": ("tab:blue", "o"), "metis": ("tab:green", "^")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("png")
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(a.results, "partitions")
    graphs = list(dict.fromkeys(t["graph"].tolist()))
    fig, axes = plt.subplots(len(graphs), 2, figsize=(9, 3.2 * len(graphs)), squeeze=False)
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
