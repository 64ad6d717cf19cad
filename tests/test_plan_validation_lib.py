"""hpcnn.plan.validation (the layouts, log readings and figures of a plan validation) and
hpcnn.validation_runs (its runs), without running hpcnn train: made-up predictions and run logs."""
import math
import os
import sys
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from hpcnn import validation_runs as validation
from hpcnn.plan import hybrid, machine
from hpcnn.plan import validation as pv
from mpi_util import ROOT

MACHINE = os.path.join(ROOT, "machines", "local-2vcpu.toml")


def _got(step_s, memory=100, load=0.5):
    return {"step_s": step_s, "rss_bytes": 10, "act_bytes": 3, "param_bytes": 4,
            "memory_bytes": memory, "load1": load}


def test_steady_median_leaves_out_the_first_fifth():
    assert pv.steady_median([100.0, 1.0, 2.0, 3.0, 4.0]) == 2.5
    assert pv.mape([1.0, 3.0], [2.0, 2.0]) == 0.5


def test_read_log_takes_the_largest_ranks_sum_and_the_steady_median(tmp_path):
    path = tmp_path / "run.h5"
    with h5py.File(path, "w") as f:
        f["metrics/step_time"] = [9.0, 1.0, 2.0, 3.0, 4.0]
        f["ranks"] = np.array([(0, 5), (1, 7)], dtype=[("rank", "i8"), ("peak_mem_bytes", "i8")])
        plan = f.create_group("plan")
        for key, per_rank in (("peak_activation_bytes_per_rank", "[10, 1]"),
                              ("param_bytes_per_rank", "[1, 20]"),
                              ("grad_bytes_per_rank", "[1, 20]"),
                              ("optimizer_bytes_per_rank", "[0, 0]")):
            plan.attrs[key] = per_rank
    got = pv.read_log(str(path))
    assert got == {"step_s": 2.5, "rss_bytes": 7, "act_bytes": 10, "param_bytes": 20,
                   "memory_bytes": 41}
    bare = tmp_path / "bare.h5"
    with h5py.File(bare, "w") as f:
        f["metrics/step_time"] = [1.0, 1.0]
    assert pv.read_log(str(bare))["memory_bytes"] == -1 == pv.read_log(str(bare))["act_bytes"]


def test_mlp_rows_summary_and_confirmation_from_made_up_figures(tmp_path):
    mach = pv.machine_for(MACHINE, 2)
    assert mach.p == 2
    cases = pv.mlp_cases([16, 16], 32, 2, 3, str(tmp_path), mach)
    assert len(cases) == 3 and all(os.path.exists(a[-1].split("=", 1)[1]) for _, a, _ in cases)
    preds = {name: [predict(mach), predict(mach)] for name, _, predict in cases}
    choice = pv.least_priced(preds)
    assert preds[choice][0].seconds == min(p[0].seconds for p in preds.values())
    assert pv.least_priced({}) is None
    rows = [pv.layout_row("mlp", name, [_got(0.01 * (k + 1)), _got(0.03 * (k + 1), 200)],
                          preds[name], 5, 2, choice) for k, (name, _, _) in enumerate(cases)]
    assert [r["meas_s"] for r in rows] == pytest.approx([0.02, 0.04, 0.06])
    assert all(r["tp"] == 2 and r["dp"] == 1 and r["remat"] == "none" for r in rows)
    assert all(r["meas_memory_bytes"] == 200 and r["rounds"] == 2 for r in rows)
    assert sum(r["planner_choice"] for r in rows) == 1
    s = pv.summarize("mlp", rows, choice)
    assert s["layouts"] == 3 and s["best"] == cases[0][0] and s["choice_over_best"] >= 1
    assert s["memory_rows"] == 3 and not math.isnan(s["memory_max_error"])
    times = {choice: [0.02, 0.03], cases[0][0]: [0.01, 0.02]}
    s.update(pv.confirm_summary(times, choice))
    confirmed = pv.confirm_rows("mlp", times, rows, choice)
    assert [r["layout"] for r in confirmed] == list(times)
    assert confirmed[0]["planner_choice"] == 1 and confirmed[0]["meas_s"] == 0.025
    lines = pv.summary_lines(s)
    assert len(lines) == 2 and lines[0].startswith("mlp: 3 layouts, Kendall tau")
    assert "confirmed (2 layouts, 2 rounds side by side)" in lines[1]
    s.update(pv.confirm_summary({}, choice))
    assert len(pv.summary_lines(s)) == 1


def test_gpt_rows_carry_the_layout():
    cases = pv.gpt_cases((2, 16, 2, 8, 4), 2, [2])
    mach = pv.machine_for(MACHINE, 2)
    assert cases and all(isinstance(predict(mach), hybrid.Priced) for _, _, predict in cases)
    name, args, predict = cases[0]
    assert f"--remat={predict(mach).layout.remat}" in args and "--model=gpt" in args
    row = pv.layout_row("gpt", name, [_got(0.1)], [predict(mach)], 3, 2, name)
    lay = predict(mach).layout
    assert (row["dp"], row["tp"], row["pp"]) == (lay.dp, lay.tp, lay.pp)
    assert row["pred_s"] == pv.value(predict(mach)) and row["planner_choice"] == 1


def test_runs_go_through_the_script_harness(tmp_path):
    """The validation's jobs are hpcnn.scripts' ``mpiexec -n p python -m mpi4py``, with this
    checkout on PYTHONPATH; with ``--machine`` its layouts are chosen on that file."""
    cmd = validation.mpi_command(3, ["-m", "hpcnn", "info"])
    assert cmd[cmd.index("-n"):] == ["-n", "3", sys.executable, "-m", "mpi4py", "-m", "hpcnn",
                                     "info"]
    assert validation.run_env()["PYTHONPATH"] == validation.ROOT
    assert os.path.isdir(os.path.join(validation.ROOT, "hpcnn"))
    a = SimpleNamespace(gpt="2,16,2,8,4", ranks=2, microbatches="2", gpt_layouts="1",
                        machine=MACHINE, hidden="16,16", mlp_batch=32, mlp_layouts="2",
                        gpt_steps=3, mlp_steps=4)
    models, first = validation.layouts(a, str(tmp_path), str(tmp_path))
    assert first == machine.resolve(MACHINE)
    assert len(models["gpt"][0]) == 1 and models["gpt"][1] == 3
    assert len(models["mlp"][0]) == 2 and models["mlp"][1] == 4
