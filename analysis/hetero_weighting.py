"""Figure of the heterogeneous-replica experiment: time per epoch and test accuracy vs slowdown.

Reads only the HDF5 table written by experiments/hetero_weighting.py (no MPI, no text logs):

    python analysis/hetero_weighting.py runs/hetero_weighting/results.h5 [OUT.png]

Rows: shard layout (contiguous, class-skewed). Columns: median time per epoch vs the emulated
slowdown r of one replica, per arm; final test accuracy and final training loss (mean ± std over
seeds), with the serial large-batch run as a dashed line; the slow replica's final share of the
batch, with the share that balancing by samples/s would give if time were proportional to the
share, 1/((P-1)r+1), dotted; the spread of the replicas' median compute times in the second half
of each run, (max - min)/max, with the 10 % target dotted.
"""
import os
import sys

import numpy as np

from hpcnn import scripts
from hpcnn.log.results import load_table
from hpcnn.log.report import save_figure

STYLE = {"equal": ("tab:gray", "o"), "prop-uniform": ("tab:orange", "s"),
         "prop-weighted": ("tab:blue", "^")}


def figure(path, out=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt
    runs, attrs = load_table(path, "runs")
    serial, _ = load_table(path, "serial")
    shards = list(dict.fromkeys(runs["shard"]))
    p = int(attrs.get("ranks"))
    fig, axes = plt.subplots(len(shards), 5, figsize=(25, 3.8 * len(shards)), squeeze=False)
    for row, shard in enumerate(shards):
        ax_t, ax_a, ax_l, ax_s, ax_d = axes[row]
        for arm, (color, marker) in STYLE.items():
            sel = (runs["shard"] == shard) & (runs["arm"] == arm)
            fs = np.unique(runs["factor"][sel])
            t = [runs["epoch_time_s"][sel & (runs["factor"] == f)] for f in fs]
            a = [runs["test_acc"][sel & (runs["factor"] == f)] for f in fs]
            ax_t.errorbar(fs, [1e3 * np.mean(v) for v in t], [1e3 * np.std(v) for v in t],
                          color=color, marker=marker, capsize=3, label=arm)
            ax_a.errorbar(fs, [100 * np.mean(v) for v in a], [100 * np.std(v) for v in a],
                          color=color, marker=marker, capsize=3, label=arm)
            lo = [runs["final_loss"][sel & (runs["factor"] == f)] for f in fs]
            ax_l.errorbar(fs, [np.mean(v) for v in lo], [np.std(v) for v in lo],
                          color=color, marker=marker, capsize=3, label=arm)
            for ax, key, scale in ((ax_s, "slow_rank_share_final", 100), (ax_d, "compute_spread", 100)):
                v = [runs[key][sel & (runs["factor"] == f)] for f in fs]
                ax.errorbar(fs, [scale * np.mean(x) for x in v], [scale * np.std(x) for x in v],
                            color=color, marker=marker, capsize=3, label=arm)
        s = serial["test_acc"][serial["shard"] == shard]
        ax_a.axhline(100 * np.mean(s), color="k", ls="--", lw=1, label="serial large batch")
        ax_l.axhline(np.mean(serial["final_loss"][serial["shard"] == shard]), color="k", ls="--",
                     lw=1, label="serial large batch")
        fr = np.geomspace(1, max(runs["factor"]), 50)
        ax_s.plot(fr, 100 / ((p - 1) * fr + 1), "k:", lw=1, label="samples/s, time ∝ share")
        ax_d.axhline(10, color="k", ls=":", lw=1, label="10 %")
        for ax in (ax_t, ax_a, ax_l, ax_s, ax_d):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(set(runs["factor"].tolist())))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel("emulated slowdown r of one replica")
            ax.grid(alpha=0.3)
        ax_t.set_ylabel("time per epoch (ms, median step)")
        ax_a.set_ylabel("test accuracy (%)")
        ax_t.set_title(f"{shard} shards: time per epoch")
        ax_a.set_title(f"{shard} shards: accuracy (mean ± std over seeds)")
        ax_l.set_ylabel("final training loss")
        ax_l.set_title(f"{shard} shards: final loss (uniform's bias)")
        ax_s.set_ylabel("slow replica's final share (% of batch)")
        ax_s.set_title(f"{shard} shards: slow replica's share")
        ax_d.set_ylabel("compute time spread, 2nd half (%)")
        ax_d.set_title(f"{shard} shards: (max - min) / max of replica times")
        for ax in (ax_t, ax_a, ax_l, ax_s, ax_d):
            ax.legend(fontsize=8)
    fig.suptitle(f"Heterogeneous data parallelism, {p} ranks, {attrs.get('model')} "
                 f"(slowdown emulated: {attrs.get('emulated_slowdown_mode')}; "
                 f"balancer: {attrs.get('balancer', 'samples/s')})")
    out = save_figure(fig, out or os.path.splitext(path)[0] + ".png")
    print(f"wrote {out}")
    return out


def main(argv=None) -> int:
    a = scripts.figure_parser(__doc__, optional=True).parse_args(argv)
    figure(a.results, a.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
