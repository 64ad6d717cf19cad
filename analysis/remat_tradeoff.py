"""Figures of the rematerialization / offloading trade-off, made only from the HDF5 tables of
experiments/remat_tradeoff.py:

    python analysis/remat_tradeoff.py --results=runs/remat_tradeoff/results.h5 --out=docs/figures

One figure per model, ``<out>/remat_tradeoff_<model>.png``. Left: step-time overhead over store-all
(measured: solid, median of the paired rounds with the inter-quartile range; predicted by the
simulator from the profile: dashed, at the same measured peak) against the measured peak (the
executor's account of stored values) over store-all's, for rotor's optimal rematerialization,
optimal + offloading at each emulated bandwidth, √L segments and store-all (one point each).
Right: measured peak against the budget: the account (filled) and the tracemalloc peak of one
step, transients included (hollow); every point must be under y = x. Below: the headline numbers
(table "headline"). ``<out>/remat_solver_time.png``: seconds to build the rotor table and to run
combine.solve against the chain length L, per slot count, on random heterogeneous chains.
(Those two arguments are the defaults.)
"""
import os

import numpy as np

from hpcnn import scripts  # noqa: E402
from hpcnn.log.report import save_figure  # noqa: E402
from hpcnn.log.results import load_table  # noqa: E402

MiB = 2.0 ** 20
OFFLOAD_COLORS = ("tab:orange", "tab:green", "tab:red", "tab:purple")


def arms_of(t, model):
    """[(label, mask, color, marker)] of a model's curves: optimal, then offload per bandwidth."""
    m = t["model"] == model
    out = [("optimal (remat only)", m & (t["arm"] == "optimal"), "tab:blue", "o")]
    bws = sorted(set(t["bandwidth"][m & (t["arm"] == "optimal+offload")].tolist()))
    for color, bw in zip(OFFLOAD_COLORS, bws):
        out.append((f"optimal+offload {bw / 1e9:g} GB/s",
                    m & (t["arm"] == "optimal+offload") & (t["bandwidth"] == bw), color, "s"))
    return out


def legend(ax, curves, styles, **kw):
    """One entry per curve (its color and marker), then one per line or fill style."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=c, marker=mk, ms=6, lw=1.5 if lw else 0, label=label)
               for label, c, mk, lw in curves]
    handles += [Line2D([], [], color="k", label=label, **style) for label, style in styles]
    ax.legend(handles=handles, fontsize=7.5, **kw)


def tradeoff_panel(ax, t, model, limit):
    m = t["model"] == model
    sa_peak = t["store_all_peak"][m][0]
    curves = []
    for label, sel, color, marker in arms_of(t, model):
        order = np.argsort(t["budget_bytes"][sel])
        x = t["measured_peak"][sel][order] / sa_peak
        y = t["overhead"][sel][order]
        err = np.vstack([y - t["overhead_q25"][sel][order], t["overhead_q75"][sel][order] - y])
        ax.errorbar(x, y, np.clip(err, 0, None), color=color, marker=marker, ms=4, lw=1.5,
                    capsize=2)
        ax.plot(x, t["predicted_overhead"][sel][order], color=color, ls="--", lw=1)
        curves.append((label, color, marker, True))
    for arm, label, marker, color in (("sqrt", "√L segments", "*", "k"),
                                      ("store_all", "store-all", "D", "tab:gray")):
        sel = m & (t["arm"] == arm)
        x = t["measured_peak"][sel] / sa_peak
        ax.plot(x, t["overhead"][sel], marker=marker, color=color, ms=11, ls="none")
        ax.plot(x, t["predicted_overhead"][sel], marker=marker, mfc="none", color=color, ms=11,
                ls="none")
        curves.append((label, color, marker, False))
    ax.axhline(limit, color="k", ls=":", lw=1)
    ax.text(ax.get_xlim()[0], limit, f" {100 * (limit - 1):.0f} % overhead", va="bottom",
            fontsize=8)
    ax.set_xlabel("measured peak / store-all peak (executor account of stored values)")
    ax.set_ylabel("step time / store-all step time")
    ax.set_title("time overhead vs memory")
    ax.grid(alpha=0.3)
    legend(ax, curves, [("measured: median of paired rounds, bars: quartiles",
                         dict(ls="-", marker="o", ms=4)),
                        ("predicted by the simulator (profile times)", dict(ls="--")),
                        ("predicted (single arms)", dict(ls="none", marker="*", mfc="none",
                                                          ms=10))],
           loc="upper right")


def peak_panel(ax, t, model):
    m = t["model"] == model
    curves = arms_of(t, model) + [("√L segments", m & (t["arm"] == "sqrt"), "k", "*"),
                                  ("store-all", m & (t["arm"] == "store_all"), "tab:gray", "D")]
    for label, sel, color, marker in curves:
        b = t["budget_bytes"][sel] / MiB
        ax.plot(b, t["measured_peak"][sel] / MiB, marker=marker, color=color, ls="none", ms=5)
        ax.plot(b, t["traced_peak"][sel] / MiB, marker=marker, mfc="none", color=color,
                ls="none", ms=8)
    lo = 0.9 * min(t["budget_bytes"][m].min(), t["measured_peak"][m].min()) / MiB
    hi = 1.03 * t["budget_bytes"][m].max() / MiB
    ax.plot([lo, hi], [lo, hi], color="k", lw=1)
    over = int((t["measured_peak"][m] > t["budget_bytes"][m]).sum())
    tover = (t["traced_peak"][m] - t["budget_bytes"][m]).max()
    ax.set_title(f"measured peak vs budget (account > budget: {over} of {m.sum()} rows; "
                 f"max tracemalloc - budget: {tover / 1024:+.1f} KiB)", fontsize=10)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("memory budget (MiB; the model's peak counts the input and block transients)")
    ax.set_ylabel("measured peak (MiB)")
    ax.grid(alpha=0.3)
    legend(ax, [(label, color, marker, False) for label, _, color, marker in curves],
           [("filled: executor account (stored values)", dict(ls="none", marker="o")),
            ("hollow: tracemalloc peak of a step (+ transients)",
             dict(ls="none", marker="o", mfc="none")),
            ("peak = budget", dict(ls="-"))], loc="upper left")


def headline_text(h, model):
    lines = ["store-all peak / least peak with measured overhead < 20 %  |  share of the remat "
             "overhead removed by offloading: mean over budgets with remat overhead > 2 % "
             "(pooled: sum of removed / sum of remat overheads)"]
    for i in np.flatnonzero(h["model"] == model):
        name = "optimal" if h["arm"][i] == "optimal" else \
            f"optimal+offload {h['bandwidth'][i] / 1e9:g} GB/s"
        line = (f"  {name:26s} {h['mem_gain_account'][i]:.2f}x account, "
                f"{h['mem_gain_traced'][i]:.2f}x tracemalloc ({h['mem_gain_predicted'][i]:.2f}x "
                f"predicted)")
        if h["arm"][i] != "optimal":
            line += (f"  |  removes {100 * h['share_removed_measured'][i]:.0f} % (pooled "
                     f"{100 * h['share_pooled_measured'][i]:.0f} %) measured, "
                     f"{100 * h['share_removed_predicted'][i]:.0f} % (pooled "
                     f"{100 * h['share_pooled_predicted'][i]:.0f} %) predicted")
        lines.append(line)
    return "\n".join(lines)


def model_figure(plt, t, models, heads, chan, attrs, model, out):
    row = int(np.flatnonzero(models["model"] == model)[0])
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(16, 7.5))
    tradeoff_panel(ax_t, t, model, float(attrs.get("overhead_limit", 1.2)))
    peak_panel(ax_p, t, model)
    fig.text(0.01, 0.01, headline_text(heads, model), fontsize=8, va="bottom",
             family="monospace")
    ach = ", ".join(f"{bw / 1e9:g} GB/s (achieved {a / 1e9:.2f})"
                    for bw, a in zip(chan["bandwidth"][chan["model"] == model],
                                     chan["achieved"][chan["model"] == model]))
    fig.suptitle(f"Rematerialization + offloading, {models['description'][row]} "
                 f"({models['stages'][row]} stages, float32, 1 core), store-all step "
                 f"{1e3 * models['store_all_measured_time'][row]:.0f} ms\n"
                 f"OFFLOAD CHANNEL EMULATED: a file on local disk throttled to {ach}; "
                 f"{attrs.get('repeats')} paired rounds", fontsize=11)
    return save_figure(fig, os.path.join(out, f"remat_tradeoff_{model}.png"), rect=(0, 0.1, 1, 1))


def solver_figure(plt, s, attrs, out):
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for kind, ls, marker in (("rotor", "-", "o"), ("combine", "--", "s")):
        for slots, color in zip(sorted(set(s["slots"].tolist())), ("tab:blue", "tab:orange",
                                                                     "tab:green", "tab:red")):
            sel = (s["kind"] == kind) & (s["slots"] == slots)
            order = np.argsort(s["L"][sel])
            name = "rotor.Solver table" if kind == "rotor" else "combine.solve, one budget"
            ax.plot(s["L"][sel][order], s["seconds"][sel][order], ls=ls, marker=marker,
                    color=color, label=f"{name}, {slots} slots")
    rot = s["kind"] == "rotor"
    L = np.array(sorted(set(s["L"].tolist())), dtype=float)
    k = np.argmax(s["L"][rot] * 1e4 + s["slots"][rot])
    ax.plot(L, s["seconds"][rot][k] * (L / s["L"][rot][k]) ** 3, color="k", ls=":", lw=1,
            label="∝ L³")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(L)
    ax.set_xticklabels([str(int(v)) for v in L])
    ax.set_xlabel("chain length L (stages)")
    ax.set_ylabel("seconds")
    ax.set_title(f"Solver time on random heterogeneous chains (NumPy, "
                 f"{attrs.get('cores')} cores, OMP_NUM_THREADS={attrs.get('omp_num_threads')})",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return save_figure(fig, os.path.join(out, "remat_solver_time.png"))


def main(argv=None):
    ap = scripts.parser(__doc__)
    ap.add_argument("--results", default="runs/remat_tradeoff/results.h5")
    ap.add_argument("--out", default="docs/figures")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(args.results, "tradeoff")
    models, _ = load_table(args.results, "models")
    heads, _ = load_table(args.results, "headline")
    chan, _ = load_table(args.results, "channel")
    solver, _ = load_table(args.results, "solver")
    os.makedirs(args.out, exist_ok=True)
    for model in models["model"]:
        print(f"wrote {model_figure(plt, t, models, heads, chan, attrs, model, args.out)}")
    print(f"wrote {solver_figure(plt, solver, attrs, args.out)}")


if __name__ == "__main__":
    main()
