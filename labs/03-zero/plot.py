"""Lab 3's figure: what ZeRO saves per rank, and what its steps took in your run.

    python labs/03-zero/plot.py [RESULTS.h5] [FIGURE.png]    # default: runs/student.h5

Left: bytes per rank against the vector length n: Adam's state as your optimizers hold it
(measured), against the replicated 16 n of plain data parallelism, and the bytes each step
sends (bandwidth-optimal counts: ZeRO-1's allreduce and all-gather, ZeRO-2's reduce-scatter
and all-gather, plain data parallelism's allreduce). Right: the measured seconds per step.
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
    results, figure = labkit.plot_args(__file__, "Draw lab 3's figure from the grader's results.")
    table, attrs = load_table(results, "zero")
    p = int(attrs["ranks"])
    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(table["method"]):
        rows = table["method"] == name
        n = table["n"][rows]
        line, = mem.loglog(n, table["state_bytes"][rows], "o-", label=f"{name}: Adam state")
        mem.loglog(n, table["sent_bytes"][rows], "s--", color=line.get_color(),
                   label=f"{name}: bytes sent per step")
        sec.loglog(n, table["seconds"][rows], "o-", color=line.get_color(), label=name)
    n = table["n"][table["method"] == table["method"][0]]
    mem.loglog(n, 16 * n, "k-", alpha=0.4, label="replicated Adam state (16 n)")
    mem.loglog(n, 2 * (p - 1) / p * 8 * n, "k:", alpha=0.6, label="plain DP: allreduce sent")
    mem.set(xlabel="parameters n", ylabel="bytes per rank", title=f"per rank, {p} ranks")
    sec.set(xlabel="parameters n", ylabel="seconds per step", title="measured")
    mem.legend(fontsize=7)
    sec.legend(fontsize=7)
    print(f"wrote {save_figure(fig, figure, dpi=120)}")


if __name__ == "__main__":
    main()
