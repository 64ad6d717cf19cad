"""Lab 4's figure: the parallel MLP block against the serial one, weights and seconds.

    python labs/04-tensor-parallel/plot.py [RESULTS.h5] [FIGURE.png]  # default: runs/student.h5

Left: the weight bytes a rank holds against the block's width n (hidden 4 n): 1/p of the
serial block's. Right: the measured seconds of one forward and backward (batch 32).
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
    results, figure = labkit.plot_args(__file__, "Draw lab 4's figure from the grader's results.")
    table, attrs = load_table(results, "tp")
    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(table["mode"]):
        rows = table["mode"] == mode
        mem.loglog(table["width"][rows], table["weight_bytes"][rows], "o-", label=mode)
        sec.loglog(table["width"][rows], table["seconds"][rows], "o-", label=mode)
    mem.set(xlabel="width n (hidden 4 n)", ylabel="weight bytes per rank", title="memory")
    sec.set(xlabel="width n (hidden 4 n)", ylabel="seconds, forward + backward",
            title=f"MLP block, batch 32, {int(attrs['ranks'])} ranks")
    mem.legend(fontsize=7)
    sec.legend(fontsize=7)
    print(f"wrote {save_figure(fig, figure, dpi=120)}")


if __name__ == "__main__":
    main()
