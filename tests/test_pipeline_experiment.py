"""The pipeline-bubble experiment and its two figures run end to end on tiny settings (2 ranks)."""
import os
import subprocess
import sys

import numpy as np

from hpcnn.log import read_run
from hpcnn.log.results import load_table
from mpi_util import ROOT, run_mpi

COLUMNS = {"schedule", "M", "pp", "virtual", "n_stages", "micro_batch", "global_batch",
           "makespan_s", "bubble_measured", "bubble_measured_std", "bubble_analytic",
           "bubble_analytic_sched", "bubble_simulated", "makespan_simulated_s", "t_f_s", "t_b_s",
           "t_w_s", "peak_inflight_stage0", "peak_inflight_rank_max", "peak_bytes_rank0",
           "peak_bytes_max", "log"}


def _figure(script, *args):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "analysis", script), *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_pipeline_bubble_experiment_and_figures(tmp_path):
    out = tmp_path / "pb"
    script = os.path.join(ROOT, "experiments", "pipeline_bubble.py")
    # narrow model: the test checks the plumbing, not the timing
    stdout = run_mpi("run_experiment", 2, script, "--micro-batches=1,2", "--steps=2",
                     "--warmup=1", "--width=128", "--pairs=4", "--micro=8", f"--out={out}",
                     timeout=120)
    assert "wrote" in stdout
    t, attrs = load_table(out / "results.h5", "bubble")
    assert set(t) == COLUMNS and attrs["ranks"] == 2
    got = sorted(zip(t["schedule"].tolist(), t["M"].tolist()))
    assert got == sorted([(s, m) for s in ("gpipe", "1f1b", "zb_h1", "zb_v") for m in (1, 2)]
                         + [("interleaved", 2)])        # interleaved needs M % pp == 0
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
    _figure("pipeline_bubble.py", out / "results.h5", tmp_path / "bubble.png")
    _figure("pipeline_gantt.py", out / "zb_h1-M2.h5", tmp_path / "gantt.png")
    _figure("pipeline_gantt.py", out / "zb_v-M2.h5", tmp_path / "gantt_all.png", "--all")
    for png in ("bubble.png", "gantt.png", "gantt_all.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
