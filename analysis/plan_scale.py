"""Figure of experiments/plan_scale.py: the layout the planner chooses against model size.

    python analysis/plan_scale.py runs/plan_scale/results.h5 docs/figures/plan_scale.png

Left: the chosen dp, tp and pp (log scale) against parameters; a hollow marker where even the best
layout does not fit the device memory. Right: predicted model FLOP/s per device, as a fraction of
the device's peak, and memory per device. Made only from the HDF5 table "scale"; predictions
from the machine file's public figures, not measurements (the title says so).
"""
import sys

from hpcnn import scripts
from hpcnn.log.report import save_figure
from hpcnn.log.results import load_table


def main(argv=None) -> int:
    a = scripts.figure_parser(__doc__).parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(a.results, "scale")
    params = t["params"] / 1e9
    fits = t["feasible"].astype(bool)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, color in (("dp", "tab:blue"), ("tp", "tab:orange"), ("pp", "tab:green")):
        ax.plot(params, t[key], "-", color=color, label=key)
        ax.plot(params[fits], t[key][fits], "o", color=color)
        ax.plot(params[~fits], t[key][~fits], "o", mfc="none", color=color)
    ax.set(xscale="log", yscale="log", xlabel="parameters (billions)",
           ylabel="chosen degree", title="chosen layout (hollow: does not fit memory)")
    ax.legend()
    bx.plot(params, t["fraction_of_peak"], "o-", label="model FLOP/s / peak")
    bx.set(xscale="log", xlabel="parameters (billions)", ylim=(0, 1),
           ylabel="fraction of the device's peak")
    mx = bx.twinx()
    mx.plot(params, t["memory_gb"], "s--", color="tab:red", label="memory per device (GB)")
    mx.set_ylabel("GB per device")
    bx.legend(loc="lower left")
    mx.legend(loc="lower right")
    bx.set_title("predicted per device")
    fig.suptitle(f"hpcnn plan on {attrs.get('machine', '?')}: predictions from public "
                 f"figures, not measured", fontsize=10)
    print(f"wrote {save_figure(fig, a.figure, rect=(0, 0, 1, 0.94))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
