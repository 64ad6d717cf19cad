"""The pipeline-bubble experiment and its two figures run end to end on tiny settings (2 ranks;
make test-long)."""
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from hpcnn.log import read_run
from hpcnn.log.results import load_table
from mpi_util import ROOT

COLUMNS = {"schedule", "M", "pp", "virtual", "n_stages", "micro_batch", "global_batch",
           "makespan_s", "bubble_measured", "bubble_measured_std", "bubble_analytic",
           "bubble_analytic_sched", "bubble_simulated", "makespan_simulated_s", "t_f_s", "t_b_s",
           "t_w_s", "peak_inflight_stage0", "peak_inflight_rank_max", "peak_bytes_rank0",
           "peak_bytes_max", "log"}


def _figure(script, *args):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "analysis", script), *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


@pytest.mark.long     # as the documented 4-rank run it reads (tests/test_docs.py, LONG); make
# test runs the documented 2-rank sweep and its figures
def test_pipeline_bubble_experiment_and_figures(docs_run, tmp_path):
    """The documentation's 2-rank run of the experiment, shortened by tests/test_docs.py's
    SCRIPT_SHORTEN (narrow model, M in 1, 2, 8, 2 steps after 1 warm-up: the test checks the
    plumbing, not the timing), and the documentation's figures of it, plus the Gantt chart's --all."""
    stdout = docs_run.succeeded(docs_run.command_running(
        "experiments/pipeline_bubble.py", "-n", "2")).stdout
    out = docs_run.scratch / "runs" / "pipeline_bubble_p2"
    assert "wrote" in stdout
    t, attrs = load_table(out / "results.h5", "bubble")
    assert set(t) == COLUMNS and attrs["ranks"] == 2
    got = sorted(zip(t["schedule"].tolist(), t["M"].tolist()))
    assert got == sorted([(s, m) for s in ("gpipe", "1f1b", "zb_h1", "zb_v") for m in (1, 2, 8)]
                         + [("interleaved", 2), ("interleaved", 8)])   # needs M % pp == 0
    S = 2
    for name, M, inflight in zip(t["schedule"], t["M"], t["peak_inflight_stage0"]):
        if name == "gpipe":
            assert inflight == M
        if name == "1f1b":
            assert inflight <= S
    row = {(n, m): k for k, (n, m) in enumerate(zip(t["schedule"], t["M"]))}
    # ZB-V's two half-size stages per rank hold no more than 1F1B's whole one (Qi et al. 2024)
    assert t["peak_bytes_max"][row[("zb_v", 2)]] <= t["peak_bytes_max"][row[("1f1b", 2)]]
    assert t["n_stages"][row[("zb_v", 2)]] == 2 * S and t["virtual"][row[("zb_v", 1)]] == 2
    assert ((t["bubble_measured"] >= 0) & (t["bubble_measured"] < 1)).all()
    assert ((t["bubble_simulated"] >= 0) & (t["bubble_simulated"] < 1)).all()
    np.testing.assert_allclose(t["bubble_analytic"], (S - 1) / (t["M"] + S - 1))
    mem, _ = load_table(out / "results.h5", "memory")
    assert len(mem["rank"]) == 2 * len(t["M"]) and set(mem["rank"].tolist()) == {0, 1}
    run = read_run(out / "gpipe-M2.h5")
    assert run.status == "finished" and len(run.metrics["step"]) == 2
    assert {"F", "B", "SEND_ACT", "RECV_ACT"} <= set(run.timeline["kind"].tolist())
    for name in ("zb_h1", "zb_v"):
        assert "W" in set(read_run(out / f"{name}-M2.h5").timeline["kind"].tolist())
    docs_run.succeeded(docs_run.command_running("experiments/pipeline_bubble.py", "-n", "4"))
    figures = [docs_run.command_running("analysis/pipeline_bubble.py",
                                          "runs/pipeline_bubble_p2/results.h5"),
               docs_run.command_running("analysis/pipeline_gantt.py",
                                          "runs/pipeline_bubble_p2/zb_v-M8.h5"),
               docs_run.command_running("analysis/pipeline_gantt.py",      # 4 ranks' zb_h1
                                          "runs/pipeline_bubble_p4/zb_h1-M8.h5")]
    pngs = []
    for index in figures:
        docs_run.succeeded(index)
        pngs.append(docs_run.scratch / shlex.split(docs_run.commands[index])[-1])
    _figure("pipeline_gantt.py", out / "zb_v-M2.h5", tmp_path / "gantt_all.png", "--all")
    for png in pngs + [tmp_path / "gantt_all.png"]:
        assert png.read_bytes()[:4] == b"\x89PNG"
