"""Lab 8's figure: the hang as the watchdog saw it, and where each rank of a deadlocked pipeline
schedule stops.

    python labs/08-hang/plot.py [RESULTS.h5] [FIGURE.png]  # default: runs/student.h5

Left: each rank's time in its current call when the report was written, coloured by the call,
with the watchdog's timeout: the rank in another call than its peers is the one to look at.
Right: for each schedule, how far each rank's instruction list got (eager sends, blocking
receives), the receive it waits in written at the end of its bar.
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


def report(ax, table, timeout):
    kinds = list(dict.fromkeys(table["kind"]))
    for r, kind, waited in zip(table["rank"], table["kind"], table["waited_s"]):
        ax.barh(int(r), waited, color=f"C{kinds.index(kind)}")
        ax.text(waited, int(r), f" {kind}", va="center", fontsize=8)
    ax.axvline(timeout, color="k", ls="--", lw=1, label=f"--hang_timeout = {timeout:g} s")
    ax.set(xlabel="seconds in the current call", ylabel="rank", yticks=sorted(set(table["rank"])),
           title="the watchdog's records of the buggy step")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")


def schedules(ax, table):
    cases = list(dict.fromkeys(table["case"]))
    ranks = int(table["rank"].max()) + 1
    for c, case in enumerate(cases):
        rows = table["case"] == case
        for r, pos, length, op in zip(table["rank"][rows], table["position"][rows],
                                      table["length"][rows], table["op"][rows]):
            y = c * (ranks + 1) + int(r)
            ax.barh(y, length, color="0.9")
            ax.barh(y, pos, color="C3" if op != "end" else "C2")
            if op != "end":
                ax.text(pos, y, f" {op}", va="center", fontsize=6)
    ax.set(yticks=[c * (ranks + 1) + (ranks - 1) / 2 for c in range(len(cases))],
           yticklabels=cases, xlabel="instructions run (grey: the list's length)",
           title="pipeline schedules: where each rank stops")
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()


def main():
    results, figure = labkit.plot_args(__file__, "Draw lab 8's figure from the grader's results.")
    rep, attrs = load_table(results, "report")
    sch, _ = load_table(results, "schedules")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.6]})
    report(left, rep, float(attrs["timeout_s"]))
    schedules(right, sch)
    print(f"wrote {save_figure(fig, figure, dpi=120)}")


if __name__ == "__main__":
    main()
