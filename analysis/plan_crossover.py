"""Figure and table of experiments/plan_crossover.py: the dp / op crossover, predicted and measured.

    python analysis/plan_crossover.py runs/plan_crossover/results.h5 docs/figures/plan_crossover.png

Two heat maps over (batch, width), the same diverging colour scale: log10 of the step-time ratio
dp / op, predicted (BSP price on the machine file) and measured (median of rounds); blue where
data parallelism wins, red where the operator-parallel layout does. The black line on each is
that map's crossover boundary (per width, the least batch from which dp wins at every larger
batch); the measured map also carries the predicted boundary dashed, and crosses the points
whose predicted winner is not the measured one. Each cell gives its ratio.

Prints the table per grid point (predicted winner, measured winner, ratios) and the summary.
Made only from the HDF5 tables "points", "boundary" and "summary".
"""
import sys

import numpy as np

from hpcnn import scripts
from hpcnn.log.report import save_figure
from hpcnn.log.results import load_table


def grid(t: dict, column: str, batches, widths) -> np.ndarray:
    """(widths x batches) array of a column of the points table."""
    out = np.full((len(widths), len(batches)), np.nan)
    for b, w, v in zip(t["batch"], t["width"], t[column]):
        out[list(widths).index(w), list(batches).index(b)] = v
    return out


def boundary_line(edges: np.ndarray, n_batches: int, batches) -> tuple:
    """Step line (x, y) in cell coordinates left of each width's boundary batch."""
    xs, ys = [], []
    for row, edge in enumerate(edges):
        x = batches.index(edge) - 0.5 if edge in batches else n_batches - 0.5
        xs += [x, x]
        ys += [row - 0.5, row + 0.5]
    return xs, ys


def print_table(t: dict, s: dict, e: dict) -> None:
    print(f"{'batch':>6} {'width':>6} {'op layout':>12} {'pred dp/op':>10} {'meas dp/op':>10} "
          f"{'pred':>4} {'meas':>4}")
    for i in range(len(t["batch"])):
        print(f"{t['batch'][i]:6d} {t['width'][i]:6d} {t['op_layout'][i]:>12} "
              f"{t['pred_ratio'][i]:10.3g} {t['meas_ratio'][i]:10.3g} {t['pred_winner'][i]:>4} "
              f"{t['meas_winner'][i]:>4}{'' if t['agree'][i] else '  <- differs'}")
    for w, pb, mb in zip(e["width"], e["pred_boundary_batch"], e["meas_boundary_batch"]):
        print(f"width {w}: dp wins from batch {pb} predicted, {mb} measured")
    print(f"winner agrees on {s['agree'][0]}/{s['points'][0]} points ({s['agreement'][0]:.0%}); "
          f"boundary equal on {s['boundaries_equal'][0]}/{len(e['width'])} widths")


def main(argv=None) -> int:
    a = scripts.figure_parser(__doc__).parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t, attrs = load_table(a.results, "points")
    e, _ = load_table(a.results, "boundary")
    s, _ = load_table(a.results, "summary")
    print_table(t, s, e)
    batches, widths = sorted(set(t["batch"].tolist())), sorted(set(t["width"].tolist()))
    maps = {"predicted (BSP price)": np.log10(grid(t, "pred_ratio", batches, widths)),
            "measured (median step time)": np.log10(grid(t, "meas_ratio", batches, widths))}
    lim = max(np.nanmax(np.abs(m)) for m in maps.values()) or 1.0
    fig, (*axes, cax) = plt.subplots(1, 3, figsize=(10.5, 4.4),
                                     gridspec_kw={"width_ratios": [1, 1, 0.05]})
    lines = {"predicted (BSP price)": e["pred_boundary_batch"],
             "measured (median step time)": e["meas_boundary_batch"]}
    agree = grid(t, "agree", batches, widths)
    for ax, (title, m) in zip(axes, maps.items()):
        im = ax.imshow(m, origin="lower", cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        for r in range(len(widths)):
            for c in range(len(batches)):
                ax.text(c, r, f"{10 ** m[r, c]:.2f}", ha="center", va="center", fontsize=7,
                        color="w" if abs(m[r, c]) > 0.6 * lim else "k")
        ax.plot(*boundary_line(lines[title], len(batches), batches), "k-", lw=2)
        if title.startswith("measured"):
            ax.plot(*boundary_line(e["pred_boundary_batch"], len(batches), batches), "k--", lw=1)
            rr, cc = np.nonzero(agree == 0)
            ax.plot(cc + 0.3, rr + 0.3, "x", color="k", ms=7, mew=1.2)
        ax.set(xticks=range(len(batches)), xticklabels=batches, yticks=range(len(widths)),
               yticklabels=widths, xlabel="global batch", title=title,
               xlim=(-0.5, len(batches) - 0.5), ylim=(-0.5, len(widths) - 0.5))
    axes[0].set_ylabel("width w of 64-w-w-10")
    fig.colorbar(im, cax=cax, label="log10 step time dp / op (< 0: dp wins)")
    fig.suptitle(f"{attrs.get('ranks', '?')} ranks on {attrs.get('machine', '?')}: winner agrees "
                 f"on {s['agree'][0]}/{s['points'][0]} points; line: dp wins right of it "
                 "(dashed: predicted); x: winner differs", fontsize=9)
    print(f"wrote {save_figure(fig, a.figure)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
