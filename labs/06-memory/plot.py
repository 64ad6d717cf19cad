"""Lab 6's figure: what memory costs in recomputation, rotor's optimum against sqrt(L).

    python labs/06-memory/plot.py [RESULTS.h5] [FIGURE.png]  # default: runs/student.h5

Left: forwards recomputed against the peak memory the executor measured (in activations of
the chain), for your dynamic program's sequence at every feasible budget (a staircase), sqrt(L)
checkpointing and store-all. Right: the measured seconds of those recomputations.
"""
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402
from hpcnn.log.report import save_figure  # noqa: E402
from hpcnn.log.results import load_table  # noqa: E402


def main():
    results, figure = labkit.plot_args(__file__, "Draw lab 6's figure from the grader's results.")
    table, attrs = load_table(results, "memory")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in zip(axes, ("recomputed", "recompute_s"),
                              ("forwards recomputed", "recompute seconds (measured)")):
        rotor = table["method"] == "rotor"
        ax.step(table["peak_slots"][rotor], table[key][rotor], "o-", where="post", ms=4,
                label="rotor (your dynamic program)")
        for name, marker in (("sqrt(L)", "s"), ("store all", "^")):
            row = table["method"] == name
            ax.plot(table["peak_slots"][row], table[key][row], marker, ms=9, label=name)
        ax.set(xlabel=f"peak memory (activations of {int(attrs['rows'])} x "
                      f"{int(attrs['width'])} float64)", ylabel=label)
        ax.legend(fontsize=8)
    axes[0].set_title(f"a chain of L = {int(attrs['L'])} Linear blocks")
    axes[1].set_title("the time the recomputation took")
    print(f"wrote {save_figure(fig, figure, dpi=120)}")


if __name__ == "__main__":
    main()
