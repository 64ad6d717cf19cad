"""Predicted timelines (hpcnn.plan.timeline): a planned step as the /timeline a measured run
logs; its makespan is the planner's step time, and hpcnn report draws and exports it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcnn.cli_tools import cmd_simulate
from hpcnn.log import read_run
from hpcnn.log.report import gantt_report
from hpcnn.schedule.placement import Cut
from hpcnn.plan import cost, hybrid, machine, timeline

GPT = hybrid.Transformer(n_layers=8, dim=256, n_heads=8, seq=64, vocab=65, batch=64,
                         dtype="float32")
LAYOUTS = [hybrid.Layout(1, 1, 1, 1), hybrid.Layout(2, 1, 1, 2), hybrid.Layout(1, 2, 1, 1),
           hybrid.Layout(1, 1, 2, 4, "1f1b"), hybrid.Layout(1, 1, 4, 8, "gpipe"),
           hybrid.Layout(1, 1, 4, 4, "zb_h1"), hybrid.Layout(2, 2, 2, 4, "1f1b", "full"),
           hybrid.Layout(1, 2, 4, 8, "zb_h1"), hybrid.Layout(2, 1, 4, 2, "1f1b")]  # M < pp:
                                                                    # no formula, simulated


CASES = [(name, lay) for lay in LAYOUTS for name in ("local-2vcpu", "dgx-a100-cluster")
         if name != "local-2vcpu" or lay.dp * lay.tp * lay.pp <= 2]   # it holds 2 devices


@pytest.mark.parametrize("name, lay", CASES, ids=str)
def test_gpt_timeline_ends_at_the_priced_step(name, lay):
    mach = machine.load(name).with_devices(lay.dp * lay.tp * lay.pp)
    events = timeline.gpt_events(GPT, lay, mach)
    assert timeline.makespan(events) == pytest.approx(hybrid.price(GPT, lay, mach).step_s,
                                                      rel=1e-12)
    ranks = {e[0] for e in events}
    assert ranks == set(range(lay.dp * lay.tp * lay.pp))
    st = hybrid.stage_times(GPT, lay, mach)
    n_group = lay.dp * lay.tp
    for r in ranks:                     # ProcessGrid order: the ranks of stage r // (dp tp)
        mine = sorted(e[1:] for e in events if e[0] == r)
        same = sorted(e[1:] for e in events if e[0] == (r // n_group) * n_group)
        assert mine == same
        kinds = [k for k, *_ in mine]
        assert kinds.count("F") == lay.microbatches
        assert kinds.count("allreduce") == (lay.dp > 1)
        busy = sum(b - a for k, _, a, b in mine if k in ("F", "B", "W"))
        assert busy == pytest.approx(lay.microbatches * (st.t_f + st.t_b), rel=1e-12)
        for a, b in zip(sorted(mine, key=lambda e: e[2]), sorted(mine, key=lambda e: e[2])[1:]):
            assert a[3] <= b[2] + 1e-15          # one event at a time per rank


@pytest.mark.parametrize("lay", [lay for lay in LAYOUTS if lay.pp > 1], ids=str)
def test_gpt_timeline_of_ranks_sharing_cores_ends_at_the_priced_step(lay):
    """With a bubble weight (ranks sharing cores) the fill and drain shrink as the price counts
    them; the events keep their order on every rank; the held activations' cost is one event
    a rank."""
    base = machine.load("dgx-a100-cluster").with_devices(lay.dp * lay.tp * lay.pp)
    from dataclasses import replace
    mach = replace(base, levels=tuple(replace(lv, bubble_weight=0.4, handoff=((0.0, 1e-5),))
                                      for lv in base.levels),
                   device=replace(base.device, elementwise={"held": 1e-10}))   # and its cost
    events = timeline.gpt_events(GPT, lay, mach)
    assert sum(e[1] == "held" for e in events) == lay.dp * lay.tp * lay.pp   # one a rank
    step = hybrid.price(GPT, lay, mach).step_s
    assert timeline.makespan(events) == pytest.approx(step, rel=1e-12)
    assert step < hybrid.price(GPT, lay, replace(mach, levels=tuple(
        replace(lv, bubble_weight=1.0) for lv in mach.levels))).step_s
    for r in {e[0] for e in events}:
        mine = sorted((e for e in events if e[0] == r), key=lambda e: e[3])
        assert all(e[3] <= e[4] for e in mine)
        assert all(a[4] <= b[3] + 1e-15 for a, b in zip(mine, mine[1:]))


def test_mlp_timeline_is_the_strategy_cost_on_every_rank():
    mach = machine.load("dgx-a100-cluster").with_devices(4)
    graph = cost.mlp_graph([64, 256, 256, 10], 128)
    for cuts in ([Cut(4, 1, 1)] * 3, [Cut(1, 1, 4), Cut(1, 4, 1), Cut(2, 1, 2)],
                 [Cut(1, 2, 2), Cut(2, 2, 1), Cut(1, 1, 1)]):
        events = timeline.mlp_events(graph, cuts, mach)
        priced = cost.strategy_cost(graph, cuts, mach)
        assert timeline.makespan(events) == pytest.approx(priced.seconds, rel=1e-12)
        assert {e[0] for e in events} == set(range(4))
        rank0 = [e[1:] for e in events if e[0] == 0]
        assert [k for k, *_ in rank0] == [timeline.term_kind(t) for t in priced.terms]
        assert [k for k, *_ in rank0].count("compute") == 3
    assert "alltoall" in {e[1] for e in events}       # the last plan redistributes


def test_simulate_writes_predicted_logs_report_draws_and_traces(tmp_path, capsys):
    gpt = tmp_path / "gpt.h5"
    assert cmd_simulate(["--model=gpt", "--dp=1", "--pp=2", "--schedule=zb_h1",
                         "--microbatches=4", "--n_layers=2", "--dim=32", "--batch=8",
                         f"--log={gpt}"]) == 0
    run = read_run(gpt)
    lay = hybrid.Layout(1, 1, 2, 4, "zb_h1")
    model = hybrid.Transformer(2, 32, 4, 64, 65, 8, "float32")
    step = hybrid.price(model, lay, machine.load("local-2vcpu")).step_s
    assert run.attrs["predicted"] and run.plan["schedule"] == "zb_h1"
    assert run.metrics["step_time"][0] == pytest.approx(step, rel=1e-12)
    assert float(np.max(run.timeline["t_end"])) == pytest.approx(step, rel=1e-12)
    assert {"F", "B", "W", "SEND_ACT", "SEND_GRAD", "optimizer"} == set(run.timeline["kind"])

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"devices": 2, "layers": [{"out": 2}, {"reduce": 2}, {"batch": 2}]}))
    mlp = tmp_path / "mlp.h5"
    assert cmd_simulate(["--model=mlp", f"--plan={plan}", "--widths=64,32,32,10", "--batch=16",
                         f"--log={mlp}"]) == 0
    assert read_run(mlp).plan["operator_layout"]["cuts"] == [[1, 1, 2], [1, 2, 1], [2, 1, 1]]
    assert cmd_simulate(["--model=gpt", "--pp=3", f"--log={tmp_path / 'x.h5'}"]) == 2
    assert "pp dividing the 2 layers" in capsys.readouterr().err

    for log in (gpt, mlp):                            # the Chrome trace of a predicted log
        out = tmp_path / (log.stem + ".json")
        r = subprocess.run([sys.executable, "-m", "hpcnn", "report", str(log), "--trace",
                            str(out)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        names = {e["tid"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "M"}
        assert names == {0, 1}

    # a measured run (one rank, in process) beside the predicted one
    from hpcnn.config import parse_overrides
    from hpcnn.train import train
    measured = tmp_path / "measured.h5"
    train(parse_overrides(["--model=gpt", "--dataset=sonnet", "--dim=32", "--n_layers=2",
                           "--batch_size=8", "--steps=2", "--eval_interval=0",
                           "--progress=false", f"--log={measured}"]))
    png = tmp_path / "side.png"
    drawn = gantt_report(measured, gpt, png)
    assert os.path.getsize(png) > 0
    assert drawn["titles"] == ["predicted", "measured (step -1)"]
    assert drawn["ranks"] == [[0, 1], [0]]
    assert drawn["span_s"][0] == pytest.approx(step, rel=1e-12)
    r = subprocess.run([sys.executable, "-m", "hpcnn", "report", str(measured),
                        f"--predicted={gpt}", f"--gantt={tmp_path / 'cli.png'}"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and os.path.exists(tmp_path / "cli.png"), r.stderr
    r = subprocess.run([sys.executable, "-m", "hpcnn", "report", str(measured),
                        f"--predicted={gpt}", "--gantt=x.png", "--step=5"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "rank 0 logged 2 steps, no step 5" in r.stderr
