"""The side-by-side confirmations of experiments/plan_validation.py, round by round and run
against run: how far each MLP plan lies from the best of its round, and how the same two
plans' ratio moves from one validation to another.

    python analysis/plan_confirm.py runs/plan_validation_p4_idle runs/plan_validation_p4_r3

For each OUT folder given (a validation run with ``--confirm``), the MLP confirmation's run
logs OUT/runs/mlp-confirm-rR-I.h5 give each plan (its ``--plan`` file, plan-NAME.json) one step
time per round R (:func:`hpcnn.plan.validation.read_log`, the median after the first fifth). Per
folder it prints each plan's median step and its per-round ratio to the folder's best plan
(least median) in the same round: the median and the quartiles of the ratios, the spread of
one comparison within one validation. Then, for every two plans confirmed together in more
than one folder, the median of their per-round ratio in each folder: the same comparison
repeated on other days, which a planner's 5 % can only be judged against once it is known.
"""
import glob
import os
import re
import sys

import h5py
import numpy as np

from hpcnn import scripts
from hpcnn.plan import validation as plan_validation


def confirm_times(folder: str) -> dict:
    """{plan name: [step seconds per round, rounds in order]} of the MLP confirmation in
    ``folder``; empty where it has none."""
    rounds = {}
    for path in glob.glob(os.path.join(folder, "runs", "mlp-confirm-r*-*.h5")):
        r = int(re.search(r"-confirm-r(\d+)-\d+\.h5$", path).group(1))
        with h5py.File(path, "r") as f:
            line = str(f.attrs["command_line"])
        name = re.search(r"--plan=\S*plan-([^/\s]+)\.json", line).group(1)
        rounds.setdefault(name, {})[r] = plan_validation.read_log(path)["step_s"]
    out = {name: [per[r] for r in sorted(per)] for name, per in rounds.items()}
    if len({len(t) for t in out.values()}) > 1:
        raise ValueError(f"{folder}: the confirmed plans have different numbers of rounds: "
                         f"{ {n: len(t) for n, t in out.items()} }")
    return out


def ratios(times: dict, ref: str) -> dict:
    """{plan: its step over ``ref``'s in the same round, per round}."""
    return {name: np.asarray(t) / np.asarray(times[ref]) for name, t in times.items()}


def summarize(times: dict) -> list:
    """Rows (plan, median step, median, 25th and 75th percentile of its per-round ratio to the
    best plan), the best first and the others by median step."""
    best = min(times, key=lambda n: np.median(times[n]))
    per = ratios(times, best)
    return [(n, float(np.median(times[n])), *(float(np.percentile(per[n], q))
                                              for q in (50, 25, 75)))
            for n in sorted(times, key=lambda n: (n != best, np.median(times[n])))]


def across(folders: dict) -> list:
    """Rows (plan a, plan b, {folder: median per-round ratio a / b}) for every two plans
    confirmed together in more than one folder, a the slower in the first of them."""
    names = sorted({n for t in folders.values() for n in t})
    rows = []
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            shared = [f for f, t in folders.items() if first in t and second in t]
            if len(shared) < 2:
                continue
            a, b = first, second
            if np.median(ratios(folders[shared[0]], b)[a]) < 1:
                a, b = b, a
            rows.append((a, b, {f: float(np.median(ratios(folders[f], b)[a]))
                                for f in shared}))
    return rows


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("folders", nargs="+", metavar="OUT",
                    help="a plan validation's output folder (run with --confirm)")
    folders = {}
    for folder in ap.parse_args(argv).folders:
        times = confirm_times(folder)
        if not times:
            print(f"{folder}: no MLP confirmation (run logs runs/mlp-confirm-r*-*.h5)")
            continue
        folders[folder] = times
        rounds = len(next(iter(times.values())))
        print(f"{folder}: {len(times)} plans, {rounds} rounds side by side")
        print(f"  {'plan':26s} {'median ms':>9s}  ratio to the best: median [25th, 75th pct]")
        for name, step, med, lo, hi in summarize(times):
            print(f"  {name:26s} {step * 1e3:9.2f}  {med:.3f} [{lo:.3f}, {hi:.3f}]")
    rows = across(folders)
    if rows:
        print("the same two plans in several validations: median per-round ratio")
        for a, b, med in rows:
            print(f"  {a} / {b}: " + ", ".join(f"{os.path.basename(os.path.normpath(f))} "
                                              f"{v:.3f}" for f, v in med.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
