"""Lab 1's figure: your ring against the MPI library, seconds and bus bandwidth per message size.

    python labs/01-collectives/plot.py [RESULTS.h5] [FIGURE.png]    # default: runs/student.h5

Left: seconds per allreduce against bytes (log-log), with each fitted alpha-beta model. Right:
the bus bandwidth 2 (p - 1) / p * n / t, what a ring allreduce moves per rank and second.
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
    results, figure = labkit.plot_args(__file__, "Draw lab 1's figure from the grader's results.")
    table, attrs = load_table(results, "timings")
    p = int(attrs["ranks"])
    fig, (ax, bw) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(table["algorithm"]):
        rows = table["algorithm"] == name
        n, t = table["bytes"][rows], table["seconds"][rows]
        line, = ax.loglog(n, t, "o", label=f"{name}, measured")
        alpha, beta = attrs[f"{name} alpha"], attrs[f"{name} beta"]
        model = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta
        ax.loglog(n, np.maximum(model, 1e-9), "-", color=line.get_color(),
                  label=f"fit: alpha={alpha * 1e6:.0f} us, beta={beta * 1e9:.2f} ns/B")
        bw.semilogx(n, 2 * (p - 1) / p * n / t / 1e9, "o-", color=line.get_color(), label=name)
    ax.set(xlabel="message (bytes)", ylabel="seconds per allreduce", title=f"allreduce on {p} ranks")
    bw.set(xlabel="message (bytes)", ylabel="bus bandwidth (GB/s)", title="2(p-1)/p n / t")
    ax.legend(fontsize=7)
    bw.legend(fontsize=7)
    print(f"wrote {save_figure(fig, figure, dpi=120)}")


if __name__ == "__main__":
    main()
