"""Figure of the pipeline-bubble experiment: bubble fraction vs M, and peak activation memory.

Reads only the HDF5 tables written by experiments/pipeline_bubble.py (no MPI, no text logs):

    python analysis/pipeline_bubble.py runs/pipeline_bubble/results.h5 [OUT.png]

Left: per schedule, the measured bubble fraction (mean ± std over the timed steps) against the
number of micro-batches M, with the simulator's prediction from the measured stage costs (dashed)
and the analytic (S-1)/(M+S-1) (black, equal for GPipe and 1F1B; the schedule's own formula for
interleaved, ZB-H1 and ZB-V dotted). Right: peak activation memory per rank (MiB, from the blocks'
spec) of GPipe vs 1F1B (and ZB-H1 and ZB-V, whose split backward keeps each micro-batch's Linear
caches until its W) at each M, with the peak number of micro-batches in flight (F done, B not
yet; ZB-V's stages are half the size) on the bars.
"""
import os
import sys

import numpy as np

from hpcnn import scripts
from hpcnn.log.results import load_table
from hpcnn.log.report import save_figure

STYLE = {"gpipe": ("tab:gray", "o"), "1f1b": ("tab:blue", "s"),
         "interleaved": ("tab:orange", "^"), "zb_h1": ("tab:green", "D"),
         "zb_v": ("tab:red", "v")}


def bubble_panel(ax, t):
    Ms = np.unique(t["M"])
    for name in [s for s in STYLE if s in set(t["schedule"].tolist())]:
        color, marker = STYLE[name]
        sel = t["schedule"] == name
        order = np.argsort(t["M"][sel])
        M = t["M"][sel][order]
        ax.errorbar(M, t["bubble_measured"][sel][order], t["bubble_measured_std"][sel][order],
                    color=color, marker=marker, capsize=3, label=f"{name} measured")
        ax.plot(M, t["bubble_simulated"][sel][order], color=color, ls="--", lw=1,
                label=f"{name} simulated")
        if name in ("interleaved", "zb_h1", "zb_v"):
            ax.plot(M, t["bubble_analytic_sched"][sel][order], color=color, ls=":", lw=1.2,
                    label=f"{name} analytic")
    p = int(t["pp"][0])
    grid = np.geomspace(Ms.min(), Ms.max(), 50)
    ax.plot(grid, (p - 1) / (grid + p - 1), color="k", lw=1.5, label="(S-1)/(M+S-1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ms)
    ax.set_xticklabels([str(m) for m in Ms])
    ax.set_ylim(0, 1)
    ax.set_xlabel("micro-batches M (fixed micro-batch size)")
    ax.set_ylabel("bubble fraction")
    ax.set_title(f"bubble fraction, S = pp = {p}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def memory_panel(ax, mem):
    names = [s for s in ("gpipe", "1f1b", "zb_h1", "zb_v") if s in set(mem["schedule"].tolist())]
    Ms = np.unique(mem["M"])
    ranks = np.unique(mem["rank"])
    width = 0.8 / (len(names) * len(ranks))
    x = np.arange(len(Ms))
    for i, name in enumerate(names):
        for j, r in enumerate(ranks):
            k = i * len(ranks) + j
            vals, infl = [], []
            for M in Ms:
                sel = (mem["schedule"] == name) & (mem["M"] == M) & (mem["rank"] == r)
                vals.append(mem["peak_bytes"][sel][0] / 2**20 if sel.any() else 0)
                infl.append(int(mem["peak_inflight"][sel][0]) if sel.any() else 0)
            color = STYLE[name][0]
            bars = ax.bar(x - 0.4 + width * (k + 0.5), vals, width, color=color,
                          alpha=1.0 - 0.6 * j / max(len(ranks) - 1, 1),
                          edgecolor="k", lw=0.3, label=f"{name} rank {r}")
            for b, n in zip(bars, infl):
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), str(n), ha="center",
                        va="bottom", fontsize=6)
    ax.set_xticks(x)
    ax.set_xticklabels([str(m) for m in Ms])
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("peak activation memory per rank (MiB)")
    ax.set_title("peak activations per rank (numbers: micro-batches between F and B)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)


def figure(path, out=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(path, "bubble")
    mem, _ = load_table(path, "memory")
    fig, (ax_b, ax_m) = plt.subplots(1, 2, figsize=(15, 5.5))
    bubble_panel(ax_b, t)
    memory_panel(ax_m, mem)
    title = (f"Pipeline bubble, {attrs.get('ranks')} ranks, {attrs.get('model')}, "
             f"micro-batch {attrs.get('micro_batch')}, {attrs.get('steps')} timed steps")
    if attrs.get("oversubscribed"):
        title += (f"\nOVERSUBSCRIBED: {attrs.get('ranks')} ranks on {attrs.get('cores')} cores "
                  f"(measured times include descheduling)")
    fig.suptitle(title, fontsize=11)
    out = save_figure(fig, out or os.path.splitext(path)[0] + ".png")
    print(f"wrote {out}")
    return out


def main(argv=None) -> int:
    a = scripts.figure_parser(__doc__, optional=True).parse_args(argv)
    figure(a.results, a.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
