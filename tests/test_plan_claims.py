"""experiments/plan_crossover.py and plan_portability.py with their analyses, end to end on tiny
settings (real MPI runs, real HDF5): the tables agree with themselves (the crossover's in make
test-long, as its documented run). Which layout wins and by how much is a measured figure, not a
test."""
import math
import os
import shlex
import sys

import numpy as np
import pytest

from hpcnn.log.results import load_table
from hpcnn.schedule.placement import Cut
from hpcnn.plan import cost, machine, search
from hpcnn.plan import validation as plan_validation
from mpi_util import ROOT

sys.path.insert(0, os.path.join(ROOT, "experiments"))
import plan_crossover  # noqa: E402

MACHINE = os.path.join(ROOT, "machines", "local-2vcpu.toml")


def test_boundary_is_the_least_batch_from_which_dp_always_wins():
    assert plan_crossover.boundary([16, 64, 256], [False, True, True]) == 64
    assert plan_crossover.boundary([16, 64, 256], [True, False, True]) == 256
    assert plan_crossover.boundary([16, 64, 256], [True, True, False]) == -1
    assert plan_crossover.boundary([256, 16, 64], [True, True, True]) == 16


def test_op_layout_is_the_least_priced_without_a_batch_cut():
    mach = machine.load(MACHINE)
    names = plan_crossover.op_layout(256, 64, 2, mach)
    assert len(names) == 3 and "dp" not in names
    graph = plan_validation.mlp_graph([256, 256], 64)
    price = lambda ns: cost.strategy_cost(graph, [plan_validation.CHOICES[c](2) for c in ns],  # noqa: E731
                                          mach).seconds
    for other in (("col", "row", "col"), ("row", "row", "row"), ("rep", "col", "row")):
        assert price(names) <= price(other)


def documented_experiment(docs_run, name):
    """The documentation's runs of experiments/<name>.py (shortened by tests/test_docs.py's
    SCRIPT_SHORTEN) and of its analysis: (output folder, the analysis's stdout, its figure)."""
    docs_run.succeeded(docs_run.command_running(f"experiments/{name}.py"))
    analysis = docs_run.command_running(f"analysis/{name}.py", f"runs/{name}/results.h5")
    stdout = docs_run.succeeded(analysis).stdout
    figure = shlex.split(docs_run.commands[analysis], comments=True)[-1]
    return docs_run.scratch / "runs" / name, stdout, docs_run.scratch / figure


@pytest.mark.long     # as the documented run it reads (tests/test_docs.py, LONG): measured runs
def test_crossover_experiment_and_figure(docs_run):
    # SCRIPT_SHORTEN: --batches=8,32 --widths=8 --rounds=1 --steps=2 on local-2vcpu (the default)
    out, stdout, figure = documented_experiment(docs_run, "plan_crossover")
    t, attrs = load_table(out / "results.h5", "points")
    e, _ = load_table(out / "results.h5", "boundary")
    s, _ = load_table(out / "results.h5", "summary")
    assert attrs["ranks"] == 2 and len(t["batch"]) == 2
    assert sorted(zip(t["batch"], t["width"])) == [(8, 8), (32, 8)]
    mach = machine.load(MACHINE)
    for i in range(2):
        b, w = int(t["batch"][i]), int(t["width"][i])
        graph = plan_validation.mlp_graph([w, w], b)
        # the predictions are strategy_cost of the plans run, the winners the argmins
        dp = cost.strategy_cost(graph, [Cut(2, 1, 1)] * 3, mach).seconds
        op = cost.strategy_cost(graph, [plan_validation.CHOICES[c](2)
                                        for c in t["op_layout"][i].split("-")], mach).seconds
        assert math.isclose(t["pred_dp_s"][i], dp) and math.isclose(t["pred_op_s"][i], op)
        assert t["pred_winner"][i] == ("dp" if dp < op else "op")
        assert t["meas_winner"][i] == ("dp" if t["meas_dp_s"][i] < t["meas_op_s"][i] else "op")
        assert math.isclose(t["meas_ratio"][i], t["meas_dp_s"][i] / t["meas_op_s"][i])
        assert t["agree"][i] == (t["pred_winner"][i] == t["meas_winner"][i])
    assert s["agree"][0] == t["agree"].sum() and math.isclose(s["agreement"][0],
                                                               t["agree"].mean())
    for w, pb, mb in zip(e["width"], e["pred_boundary_batch"], e["meas_boundary_batch"]):
        mine = t["width"] == w
        for col, edge in (("pred_winner", pb), ("meas_winner", mb)):
            order = np.argsort(t["batch"][mine])
            wins = list(t[col][mine][order] == "dp")
            assert edge == plan_crossover.boundary(list(t["batch"][mine][order]), wins)
    assert f"{s['agree'][0]}/2 points" in stdout
    assert figure.read_bytes()[:4] == b"\x89PNG"


def test_portability_experiment_and_figure(docs_run):
    # change 5 (a 64-256x4-10 MLP, batch 64) and a GPT shape; one timed run per shape
    # (SCRIPT_SHORTEN: --changes=5,6 --reps=1 --replans=1 on local-2vcpu, the default)
    out, stdout, figure = documented_experiment(docs_run, "plan_portability")
    t, attrs = load_table(out / "results.h5", "changes")
    assert list(t["model"]) == ["mlp", "gpt"] and attrs["ranks"] == 2
    mach = machine.load(MACHINE)
    graph = plan_validation.mlp_graph([256] * 4, 64)
    cuts, price = search.least_price(graph, 2, mach)
    assert t["model_plan"][0] == "-".join(plan_validation.cut_name(c, 2) for c in cuts)
    assert math.isclose(t["predicted_step_s"][0], price)
    assert t["profile_s"][0] > 0 and t["replan_s"][0] > 0
    assert math.isclose(t["ratio"][0], t["profile_s"][0] / t["replan_s"][0])
    assert t["same_plan"][0] == (t["model_plan"][0] == t["profile_plan"][0])
    # the profiled choice is the least profiled: the model's choice costs at least as much there
    assert t["model_choice_profiled_s"][0] >= t["profiled_step_s"][0] * (1 - 1e-12)
    # 5 Linears x their legal cuts, and the pairs' exchanges: every distinct shape timed once
    assert t["timings"][0] >= 5
    assert t["profile_s"][1] == -1 and t["same_plan"][1] == -1 and "dp=" in t["model_plan"][1]
    assert "MLP: the same plan on" in stdout
    assert figure.read_bytes()[:4] == b"\x89PNG"
