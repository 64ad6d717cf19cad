"""Lab 7's figure: each layout's step, measured, priced by hpcnn's planner and by your formula.

    python labs/07-planning/plot.py [RESULTS.h5] [FIGURE.png]  # default: runs/student.h5

One group of bars per layout of the measured MLP: the median measured step on this job's
ranks, hpcnn's price on this machine's file (``machines/``), and your by-hand BSP cost on the
same file's latency, bandwidth and FLOP rate. The planner's choice is starred.
"""
import os
import sys

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402
from hpcnn.log.report import save_figure  # noqa: E402
from hpcnn.log.results import load_table  # noqa: E402


def main():
    results, figure = labkit.plot_args(__file__, "Draw lab 7's figure from the grader's results.")
    table, attrs = load_table(results, "layouts")
    names = [n + (" *" if star else "") for n, star in zip(table["layout"], table["planner"])]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for k, (key, label) in enumerate((("measured_s", "measured"), ("hpcnn_s", "hpcnn's price"),
                                      ("by_hand_s", "your BSP cost"))):
        ax.bar(x + (k - 1) * 0.27, table[key] * 1e3, 0.27, label=label)
    ax.set_xticks(x, names, fontsize=8)
    ax.set(ylabel="milliseconds per step", title=f"MLP {attrs['dims']}, batch "
           f"{int(attrs['batch'])}, on {int(attrs['ranks'])} ranks (* the planner's choice)")
    ax.legend(fontsize=8)
    print(f"wrote {save_figure(fig, figure, dpi=120)}")


if __name__ == "__main__":
    main()
