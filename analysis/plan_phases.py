"""Where the MLP plans' measured time goes against their price: phases of experiments/plan_validation.py's runs.

    python analysis/plan_phases.py runs/plan_validation_p4_all

For every MLP run log of the validation (OUT/runs/mlp-rR-I.h5, the sweep's rounds; the
confirmation's are left out), the run's ``/timeline`` gives per step and rank the seconds of its
passes (forward and backward, with the collectives and redistributions the layout executor runs
inside them), of its wait for the data-parallel gradients (``allreduce_wait``) and of its
optimizer step; a step's phase is the slowest rank's, the run's the median over the steps after
the first fifth (as the validation's step time). The same plan (the run's ``--plan`` file) is
priced by :func:`hpcnn.plan.cost.strategy_cost` on that round's machine file (OUT/machine-rR.toml,
or the one ``--machine`` gave) and its terms are summed by kind: compute, update, collectives
(the operators' reductions and the redistributions, data-parallel gradients included) and their
count. Prints the percentiles of measured over priced per phase and a least-squares fit of the
passes' seconds on the priced compute, the priced collectives and one constant per collective
(weighted by 1 / measured), and per round a least-squares fit of the step time on the priced
terms by kind, the collectives split into their kinds (:func:`fit_by_kind`); writes
OUT/phases.h5, table ``phases`` (one row per run).
"""
import glob
import json
import os
import re
import sys

import h5py
import numpy as np

from hpcnn import scripts
from hpcnn.log.results import load_table, save_table
from hpcnn.schedule.placement import read_plan
from hpcnn.plan import cost
from hpcnn.plan import validation as plan_validation

PHASES = {"passes": ("F", "B"), "wait": ("allreduce_wait",), "optimizer": ("optimizer",)}


def run_phases(path: str) -> dict:
    """{phase: seconds} of one run log (the module docstring), plus its plan file, its batch
    and its ranks. A rank's optimizer events end its steps: an event belongs to the step of
    the first optimizer event that ends after it starts."""
    with h5py.File(path, "r") as f:
        steps = len(f["metrics/step_time"])
        t = f["timeline"][...]
        names = json.loads(f["timeline"].attrs["kind_names"])
        cfg = f["config"].attrs
        plan, batch, ranks = str(cfg["plan"]), int(cfg["batch_size"]), int(cfg["tp"])
    per = {phase: np.zeros((ranks, steps)) for phase in PHASES}
    for rank in range(ranks):
        mine = t[t["rank"] == rank]
        ends = np.sort(mine["t_end"][mine["kind"] == names.index("optimizer")])
        step = np.searchsorted(ends[:steps - 1], mine["t_start"], side="right")
        for phase, kinds in PHASES.items():
            sel = np.isin(mine["kind"], [names.index(k) for k in kinds if k in names])
            np.add.at(per[phase][rank], step[sel], (mine["t_end"] - mine["t_start"])[sel])
    out = {"plan": plan, "batch": batch, "ranks": ranks}
    out.update({phase: plan_validation.steady_median(seconds.max(axis=0))
                for phase, seconds in per.items()})
    return out


# The collectives' kinds of cost.strategy_cost's terms, by the words of their names.
COLLECTIVES = ("reduce y", "reduce dx", "grad allreduce", "redistribute")


def priced_phases(graph, cuts, mach) -> dict:
    """The plan's priced seconds by kind of term (the module docstring) and its collectives,
    the collectives' seconds also by kind (:data:`COLLECTIVES`, columns ``pred_KIND_s``)."""
    sc = cost.strategy_cost(graph, cuts, mach, "float32")
    out = {"pred_compute_s": 0.0, "pred_update_s": 0.0, "pred_comm_s": 0.0, "collectives": 0}
    out.update({_column(kind): 0.0 for kind in COLLECTIVES})
    for term in sc.terms:
        if term.what.endswith("compute"):
            out["pred_compute_s"] += term.seconds
        elif term.what.endswith("update"):
            out["pred_update_s"] += term.seconds
        else:
            out["pred_comm_s"] += term.seconds
            out["collectives"] += 1
            kind = next((k for k in COLLECTIVES if k in term.what), None)
            if kind is None:
                raise ValueError(f"term {term.what!r}: not one of the kinds {COLLECTIVES}")
            out[_column(kind)] += term.seconds
    out["pred_s"] = float(sc.seconds)
    return out


def _column(kind: str) -> str:
    return f"pred_{kind.replace(' ', '_')}_s"


def _weighted_fit(design, measured) -> tuple:
    """(factors, fitted) of the least squares of ``measured`` on the columns of ``design``,
    each row weighted by 1 / measured (relative errors)."""
    w = 1 / measured
    coef = np.linalg.lstsq(design * w[:, None], measured * w, rcond=None)[0]
    return coef, design @ coef


def fit_by_kind(rows: list) -> dict:
    """Per round, the least-squares factors (weighted by 1 / measured) of each priced kind of
    term (compute, update, each of :data:`COLLECTIVES`) that best give the measured step time
    (passes, gradient wait and optimizer): {round: (factors, MAPE of the fit)}. A factor above 1
    is a kind the price under-counts on that round's machine file."""
    kinds = ("compute", "update", *COLLECTIVES)            # columns pred_compute_s, ...
    out = {}
    for r in sorted({x["round"] for x in rows}):
        mine = [x for x in rows if x["round"] == r]
        design = np.array([[x[_column(k)] for k in kinds] for x in mine])
        meas = np.array([x["meas_passes_s"] + x["meas_wait_s"] + x["meas_optimizer_s"]
                         for x in mine])
        coef, fit = _weighted_fit(design, meas)
        out[r] = (dict(zip(kinds, coef)), float(np.mean(abs(fit - meas) / meas)))
    return out


def hidden_of(command_line: str) -> list:
    """The MLP's hidden widths the validation ran (its ``--hidden``, else its default)."""
    got = re.search(r"--hidden[= ](\S+)", command_line)
    return [int(v) for v in (got.group(1) if got else plan_validation.HIDDEN).split(",")]


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("out", help="a plan validation's output folder (results.h5, runs/)")
    out = ap.parse_args(argv).out
    _, attrs = load_table(os.path.join(out, "results.h5"), "layouts")
    machines = str(attrs["machine_file"]).split(",")
    hidden = hidden_of(str(attrs["command_line"]))
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "runs", "mlp-r*-*.h5"))):
        r = int(re.search(r"mlp-r(\d+)-\d+\.h5$", path).group(1))
        got = run_phases(path)
        mach = plan_validation.machine_for(machines[r], got["ranks"])      # one per round
        graph = plan_validation.mlp_graph(hidden, got["batch"])
        cuts = read_plan(got["plan"], devices=got["ranks"])
        name = os.path.basename(got["plan"])[len("plan-"):-len(".json")]
        rows.append({"layout": name, "round": r, "meas_passes_s": got["passes"],
                     "meas_wait_s": got["wait"], "meas_optimizer_s": got["optimizer"],
                     **priced_phases(graph, cuts, mach)})
    if not rows:
        raise SystemExit(f"no MLP run logs under {out}/runs")
    passes = np.array([x["meas_passes_s"] + x["meas_wait_s"] for x in rows])
    opt = np.array([x["meas_optimizer_s"] for x in rows])
    compute = np.array([x["pred_compute_s"] for x in rows])
    comm = np.array([x["pred_comm_s"] for x in rows])
    update = np.array([x["pred_update_s"] for x in rows])
    count = np.array([x["collectives"] for x in rows], float)
    pct = (5, 25, 50, 75, 95)
    print(f"{len(rows)} runs; measured / priced, percentiles {pct}:")
    print("  passes and gradient wait / compute + collectives:",
          np.round(np.percentile(passes / (compute + comm), pct), 2))
    print("  optimizer / update:", np.round(np.percentile(opt / update, pct), 2))
    coef, fit = _weighted_fit(np.c_[compute, comm, count], passes)
    print(f"  passes ~ {coef[0]:.3g} x compute + {coef[1]:.3g} x collectives + "
          f"{coef[2] * 1e3:.3g} ms per collective (MAPE {np.mean(abs(fit - passes) / passes):.1%})")
    for r, (factors, err) in fit_by_kind(rows).items():
        print(f"  round {r}: step ~ " + " + ".join(f"{v:.2f} x {k}" for k, v in factors.items())
              + f" (MAPE {err:.1%})")
    save_table(os.path.join(out, "phases.h5"), "phases", rows,
               attrs={"fit_compute": coef[0], "fit_collectives": coef[1],
                      "fit_per_collective_s": coef[2]})
    print(f"wrote {os.path.join(out, 'phases.h5')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
