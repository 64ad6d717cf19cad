"""Figure of benchmarks/plan_search.py: the planner's search time against operators and devices.

    python analysis/plan_search.py runs/bench/plan_search.h5 docs/figures/plan_search.png

Left: seconds against the number of operators (DRA on 4096 devices, chain DP on 16, exhaustive
on 4); right: against the number of devices (DRA with 10^4 operators, chain DP with 100). Log-log,
each sweep labelled with its fitted slope (1 = linear); the DRA's 1 s target for 10^4 operators
on 4096 devices as a dotted line. Made only from the HDF5 table "plan_search".
"""
import sys

import numpy as np

from hpcnn import scripts
from hpcnn.log.report import save_figure
from hpcnn.log.results import load_table

PANELS = (("operators", (("dra_blocks", "DRA, 4096 devices"), ("dp_blocks", "chain DP, 16 devices"),
                         ("exhaustive_blocks", "exhaustive, 4 devices"))),
          ("devices", (("dra_devices", "DRA, 10^4 operators"),
                       ("dp_devices", "chain DP, 100 operators"))))
COLORS = {"dra": "tab:blue", "dp": "tab:orange", "exhaustive": "tab:green"}


def main(argv=None) -> int:
    a = scripts.figure_parser(__doc__).parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(a.results, "plan_search")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, (x, sweeps) in zip(axes, PANELS):
        for key, label in sweeps:
            mine = t["sweep"] == key
            if not mine.any():
                continue
            order = np.argsort(t[x][mine])
            ax.plot(t[x][mine][order], t["seconds"][mine][order], "o-",
                    color=COLORS[key.split("_")[0]],
                    label=f"{label} (slope {attrs.get(f'slope_{key}', float('nan')):.2f})")
        ax.axhline(1.0, color="k", ls=":", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel=x, ylabel="search time (s, median of 3)")
        ax.legend(fontsize=8)
    fig.suptitle(f"planner search time (load {attrs.get('load_avg_1min', float('nan')):.1f}); "
                 "dotted: 1 s", fontsize=10)
    print(f"wrote {save_figure(fig, a.figure)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
