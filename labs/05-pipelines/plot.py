"""Lab 5's figure: the pipeline bubble against (S-1)/(M+S-1), and the timelines of your runs.

    python labs/05-pipelines/plot.py [RESULTS.h5] [FIGURE.png]  # default: runs/student.h5

Left: the bubble of each run against M, measured (filled) and simulated by hpcnn (open), with
the formula (S-1)/(M+S-1) as a line. Right: the measured timelines of 1F1B and ZB-H1 at the
largest M, one row per rank (F light, B dark, W hatched): where the bubble is, and what ZB-H1's
deferred W's fill.
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

COLOURS = {"F": "#9ecae1", "B": "#3182bd", "W": "#fdae6b"}


def bubbles(ax, table, S):
    ms = np.arange(1, int(table["M"].max()) + 1)
    ax.plot(ms, (S - 1) / (ms + S - 1), "k-", lw=1, label="(S-1)/(M+S-1)")
    for k, name in enumerate(dict.fromkeys(table["schedule"])):
        rows = table["schedule"] == name
        c = f"C{k}"
        ax.plot(table["M"][rows], table["measured"][rows], "o", color=c, label=f"{name} measured")
        ax.plot(table["M"][rows], table["simulated"][rows], "s", mfc="none", color=c, ms=9,
                label=f"{name} simulated")
    ax.set(xlabel="micro-batches M", ylabel="bubble (idle share of ranks x makespan)",
           title=f"pipeline bubble, S = {S} stages")
    ax.legend(fontsize=7)


def timeline(ax, spans, name, M, S):
    rows = (spans["schedule"] == name) & (spans["M"] == M)
    for r, k, a, b in zip(spans["rank"][rows], spans["kind"][rows], spans["start"][rows],
                          spans["end"][rows]):
        ax.barh(int(r), b - a, left=a, color=COLOURS[k], edgecolor="k", lw=0.3)
    ax.set(yticks=range(S), ylabel="rank (stage)", title=f"{name}, M = {M}: measured timeline")
    ax.invert_yaxis()


def main():
    results, figure = labkit.plot_args(__file__, "Draw lab 5's figure from the grader's results.")
    table, attrs = load_table(results, "bubble")
    spans, _ = load_table(results, "spans")
    S = int(attrs["ranks"])
    fig = plt.figure(figsize=(12, 5))
    bubbles(fig.add_subplot(1, 2, 1), table, S)
    M = int(table["M"].max())
    for k, name in enumerate(("1f1b", "zb_h1")):
        ax = fig.add_subplot(2, 2, 2 * (k + 1))
        timeline(ax, spans, name, M, S)
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), fontsize=7, loc="lower right")
    print(f"wrote {save_figure(fig, figure, dpi=120)}")


if __name__ == "__main__":
    main()
