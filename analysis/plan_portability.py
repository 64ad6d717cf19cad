"""Figure and table of experiments/plan_portability.py: re-planning time against profiling time.

    python analysis/plan_portability.py runs/plan_portability/results.h5 docs/figures/plan_portability.png

One group of bars per model change, log scale: the cost model's re-planning (least BSP price for
the MLP, ``hybrid.plan`` for the GPT) and, for the MLP, the DRA's and the profiling baseline's
time; each MLP group is labelled with the ratio profiling / re-planning and "same plan" when
both planners chose the same cuts, else the cost model's choice's excess in profiled step time. Prints the table. Made only from the HDF5
table "changes".
"""
import sys

import numpy as np

from hpcnn import scripts
from hpcnn.log.report import save_figure
from hpcnn.log.results import load_table


def print_table(t: dict) -> None:
    print(f"{'change':<32} {'re-plan ms':>10} {'dra ms':>7} {'profile s':>9} {'ratio':>7}  plans (model / profiled)")
    for i, name in enumerate(t["change"]):
        if t["model"][i] == "mlp":
            excess = t["model_choice_profiled_s"][i] / t["profiled_step_s"][i] - 1
            print(f"{name:<32} {t['replan_s'][i] * 1e3:10.2f} {t['dra_s'][i] * 1e3:7.2f} "
                  f"{t['profile_s'][i]:9.2f} "
                  f"{t['ratio'][i]:7.0f}  {t['model_plan'][i]} / {t['profile_plan'][i]}"
                  f"{' (same)' if t['same_plan'][i] else f' (model choice {excess:+.1%} profiled)'}")
        else:
            print(f"{name:<32} {t['replan_s'][i] * 1e3:10.2f} {'-':>7} {'-':>9} {'-':>7}  "
                  f"{t['model_plan'][i]}")
    mlp = t["model"] == "mlp"
    print(f"MLP: the same plan on {int(t['same_plan'][mlp].sum())}/{int(mlp.sum())} changes; "
          f"profiling / re-planning {t['ratio'][mlp].min():.0f}x to {t['ratio'][mlp].max():.0f}x")


def main(argv=None) -> int:
    a = scripts.figure_parser(__doc__).parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(a.results, "changes")
    print_table(t)
    n = len(t["change"])
    x = np.arange(n)
    mlp = t["model"] == "mlp"
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    ax.bar(x - 0.27, t["replan_s"], 0.27, color="tab:blue",
           label="re-plan with the cost model (MLP: least BSP price; GPT: hybrid.plan)")
    ax.bar(x[mlp], t["dra_s"][mlp], 0.27, color="tab:cyan", label="MLP: the DRA (SAPP volumes)")
    ax.bar(x[mlp] + 0.27, t["profile_s"][mlp], 0.27, color="tab:orange",
           label="profiling baseline (time each operator under each cut, pick)")
    for i in np.flatnonzero(mlp):
        excess = t["model_choice_profiled_s"][i] / t["profiled_step_s"][i] - 1
        ax.annotate(f"{t['ratio'][i]:.0f}x\n" + ("same plan" if t["same_plan"][i]
                                                 else f"other plan;\nmodel's {excess:+.0%}"),
                    (x[i] + 0.27, t["profile_s"][i]), ha="center", va="bottom", fontsize=7)
    ax.set(yscale="log", ylabel="seconds", xticks=x,
           title=f"re-planning after each change, {attrs.get('ranks', '?')} ranks on "
                 f"{attrs.get('machine', '?')} (load {attrs.get('load_before', 0):.1f} / "
                 f"{attrs.get('load_after', 0):.1f})")
    ax.set_xticklabels(t["change"], rotation=30, ha="right", fontsize=7)
    ax.set_ylim(top=ax.get_ylim()[1] * 1000)       # room for the labels and the legend
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="upper right")
    print(f"wrote {save_figure(fig, a.figure)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
