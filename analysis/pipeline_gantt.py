"""Per-rank Gantt chart of a run log's /timeline: what each pipeline rank did, and when it idled.

Reads one HDF5 run log only (no MPI, no text logs), e.g. one written by
experiments/pipeline_bubble.py:

    python analysis/pipeline_gantt.py runs/pipeline_bubble/1f1b-M8.h5 [OUT.png] [--step=K|--all]

One row per rank; boxes coloured by kind: forward (F), backward (B: the whole backward, or its
input-gradient half under zero bubble), weight gradient (W), send and receive of activations and
gradients; the gaps between events are idle time (hatched). Micro-batch numbers are written in the
boxes wide enough to hold them. When /metrics has ``t_start``/``t_end`` per step, the last step is
drawn (``--step=K`` another one, ``--all`` the whole timeline); otherwise the whole timeline.
"""
import os
import sys

import numpy as np

from hpcnn import scripts
from hpcnn.log import read_run
from hpcnn.log.report import save_figure

COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green", "SEND_ACT": "0.55",
          "RECV_ACT": "0.75", "SEND_GRAD": "tab:purple", "RECV_GRAD": "plum"}
LABELS = {"F": "forward", "B": "backward (input grad. if W split)", "W": "weight gradient",
          "SEND_ACT": "send activation", "RECV_ACT": "recv activation (incl. wait)",
          "SEND_GRAD": "send gradient", "RECV_GRAD": "recv gradient (incl. wait)"}


def select(run, step):
    """Mask of the events to draw and a title suffix: one step's window, or everything."""
    tl, m = run.timeline, run.metrics
    if step == "all" or "t_start" not in m or not len(m["t_start"]):
        return np.ones(len(tl["rank"]), bool), "whole timeline"
    k = len(m["t_start"]) - 1 if step is None else list(m["step"]).index(int(step))
    a, b = m["t_start"][k], m["t_end"][k]
    return (tl["t_start"] >= a - 1e-9) & (tl["t_end"] <= b + 1e-9), f"step {int(m['step'][k])}"


def figure(path, out=None, step=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt
    run = read_run(path)
    tl = run.timeline
    if not len(tl.get("rank", [])):
        raise SystemExit(f"{path}: empty /timeline")
    sel, which = select(run, step)
    rank, kind, mb = tl["rank"][sel], tl["kind"][sel], tl["microbatch"][sel]
    t0 = tl["t_start"][sel].min()
    ts, te = 1e3 * (tl["t_start"][sel] - t0), 1e3 * (tl["t_end"][sel] - t0)     # ms
    ranks = sorted(set(rank.tolist()))
    span = te.max()
    fig, ax = plt.subplots(figsize=(14, 0.9 * len(ranks) + 2.2))
    for r in ranks:
        i = np.where(rank == r)[0]
        i = i[np.argsort(ts[i])]
        ax.barh(r, span, left=0, height=0.8, color="white", hatch="///", edgecolor="0.85", lw=0)
        for j in i:
            w = te[j] - ts[j]
            ax.barh(r, w, left=ts[j], height=0.8, color=COLORS.get(kind[j], "k"),
                    edgecolor="k" if kind[j] in "FBW" else "none", lw=0.3)
            if kind[j] in ("F", "B", "W") and w > 0.018 * span:      # room for the number
                ax.text(ts[j] + w / 2, r, str(mb[j]), ha="center", va="center", fontsize=8,
                        color="white" if kind[j] != "W" else "k")
    kinds = [k for k in COLORS if k in set(kind.tolist())]
    handles = [mpatches.Patch(color=COLORS[k], label=LABELS[k]) for k in kinds]
    handles.append(mpatches.Patch(facecolor="white", hatch="///", edgecolor="0.7", label="idle"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14 - 0.02 * (
        4 - min(len(ranks), 4))), ncol=min(len(handles), 4), fontsize=8, frameon=False)
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (ms)")
    cfg, plan = run.config, run.plan
    busy = sum(te[(rank == r) & np.isin(kind, ["F", "B", "W"])].sum()
               - ts[(rank == r) & np.isin(kind, ["F", "B", "W"])].sum() for r in ranks)
    bubble = 1 - busy / (len(ranks) * span)
    title = (f"{os.path.basename(path)}: {plan.get('schedule', cfg.get('schedule', ''))}, "
             f"pp={plan.get('pp', len(ranks))}, v={plan.get('virtual', 1)}, "
             f"M={plan.get('n_micro', cfg.get('n_micro', '?'))}, {which}, bubble {bubble:.2f}")
    if run.attrs.get("oversubscribed"):
        title += f"\n(OVERSUBSCRIBED: {run.attrs.get('world_size')} ranks on " \
                 f"{run.attrs.get('cores')} cores, times include descheduling)"
    ax.set_title(title, fontsize=10)
    out = save_figure(fig, out or os.path.splitext(path)[0] + "-gantt.png")
    print(f"wrote {out}")
    return out


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("log", help="a run log (HDF5)")
    ap.add_argument("figure", nargs="?", default=None, help="the PNG to write (optional)")
    ap.add_argument("--step", default=None, help="the step K to draw (default the last)")
    scripts.flag(ap, "all", False, "draw the whole timeline")
    a = ap.parse_args(argv)
    figure(a.log, a.figure, "all" if a.all else a.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
