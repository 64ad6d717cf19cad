"""Lab 2's figure: the loss curves of your data-parallel steps against the serial twin's, and
each method's gradient error.

    python labs/02-data-parallel/plot.py [RESULTS.h5] [FIGURE.png]  # default: runs/student.h5

Left: the global batch's loss per SGD step for each method, and the serial twins' (one per
batch size; the naive, bucketed and weighted curves lie on theirs). Right: the largest relative gradient error against the
twin per step, log scale (rounding for the exact methods; the plain mean's bias on unequal
shares is orders of magnitude above).
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
    results, figure = labkit.plot_args(__file__, "Draw lab 2's figure from the grader's results.")
    table, attrs = load_table(results, "curves")
    fig, (ax, err) = plt.subplots(1, 2, figsize=(10, 4))
    for k, name in enumerate(dict.fromkeys(table["method"])):
        rows = table["method"] == name
        steps = table["step"][rows]
        ax.plot(steps, table["serial_loss"][rows], "k-", lw=4, alpha=0.15,
                label="serial twins (equal, unequal shares)" if k == 0 else None)
        ax.plot(steps, table["loss"][rows], "o--", ms=3, label=name)
        err.semilogy(steps, np.maximum(table["grad_error"][rows], 1e-17), "o-", ms=3, label=name)
    ax.set(xlabel="step", ylabel="loss of the global batch",
           title=f"data parallelism on {int(attrs['ranks'])} ranks")
    err.set(xlabel="step", ylabel="largest relative gradient error", title="against the serial twin")
    ax.legend(fontsize=7)
    err.legend(fontsize=7)
    print(f"wrote {save_figure(fig, figure, dpi=120)}")


if __name__ == "__main__":
    main()
