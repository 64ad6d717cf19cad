"""Figure of experiments/plan_validation.py: predicted against measured step time, every layout.

    python analysis/plan_validation.py runs/plan_validation/results.h5 docs/figures/plan_validation.png

Log-log, one colour per model, the y = x line (a perfect cost model) and, dotted, y = x times the
model's scale (the geometric mean of measured / predicted: the calibrated machine's constant
offset); the planner's choice circled, the best measured layout marked with a star. The legend
gives each model's Kendall tau and MAPE. Made only from the HDF5 tables "layouts" and "summary".
"""
import sys

import numpy as np

from hpcnn import scripts
from hpcnn.log.report import save_figure
from hpcnn.log.results import load_table

COLORS = {"gpt": "tab:blue", "mlp": "tab:orange"}


def main(argv=None) -> int:
    a = scripts.figure_parser(__doc__).parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(a.results, "layouts")
    s, _ = load_table(a.results, "summary")
    fig, ax = plt.subplots(figsize=(6.2, 5.6))
    pred, meas = t["pred_s"] * 1e3, t["meas_s"] * 1e3
    lo, hi = min(pred.min(), meas.min()) / 1.5, max(pred.max(), meas.max()) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="y = x")
    for i, model in enumerate(s["model"]):
        color = COLORS.get(model, f"C{i + 2}")
        mine = t["model"] == model
        yerr = np.vstack([t["meas_s"][mine] - t["meas_min_s"][mine],
                          t["meas_max_s"][mine] - t["meas_s"][mine]]) * 1e3
        ax.errorbar(pred[mine], meas[mine], yerr=yerr, fmt="o", ms=4, color=color, lw=0.6,
                    label=f"{model}: {s['layouts'][i]} layouts, tau {s['kendall_tau'][i]:.2f}, "
                          f"MAPE {s['mape'][i]:.0%} ({s['mape_scaled'][i]:.0%} scaled)")
        ax.plot([lo, hi], [lo * s["scale"][i], hi * s["scale"][i]], ":", color=color, lw=0.8)
        chosen = mine & (t["planner_choice"] == 1)
        ax.plot(pred[chosen], meas[chosen], "o", ms=11, mfc="none", color=color)
        best = np.flatnonzero(mine)[np.argmin(meas[mine])]
        ax.plot(pred[best], meas[best], "*", ms=12, color="k")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="predicted step time (ms, calibrated machine)",
           ylabel="measured step time (ms, median of rounds)",
           title=f"{attrs.get('ranks', '?')} ranks on {attrs.get('machine', '?')}: "
                 "circle = planner's choice, star = best measured", )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="upper left")
    print(f"wrote {save_figure(fig, a.figure)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
