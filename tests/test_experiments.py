"""Experiments and their figures run end to end on tiny settings (real MPI, real HDF5)."""
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from hpcnn.log.results import load_table
from mpi_util import ROOT, run_mpi


@pytest.mark.long     # ~5-8 s: the experiment's quick sweep and its figures
def test_hetero_weighting_experiment_and_figure(tmp_path):
    out = tmp_path / "hw"
    script = os.path.join(ROOT, "experiments", "hetero_weighting.py")
    # run_mpi launches tests/mpi/<name>.py; run_experiment.py runs the script given to it
    stdout = run_mpi("run_experiment", 2, script, "--seeds=1", "--factors=1,3", "--epochs=2",
                     "--shards=skewed", f"--out={out}", timeout=240)
    assert "wrote" in stdout
    runs, attrs = load_table(out / "results.h5", "runs")
    assert attrs["ranks"] == 2 and len(runs["arm"]) == 6
    weighted = runs["arm"] == "prop-weighted"
    uniform = runs["arm"] == "prop-uniform"
    # weighted = full-batch gradient: float32 rounding away from the serial run; uniform is not
    assert runs["max_param_diff_vs_serial"][weighted].max() < 1e-4
    assert runs["max_param_diff_vs_serial"][uniform & (runs["factor"] == 3)].min() > 1e-3
    p = subprocess.run([sys.executable, os.path.join(ROOT, "analysis", "hetero_weighting.py"),
                        str(out / "results.h5"), str(tmp_path / "fig.png")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    assert np.isfinite(runs["epoch_time_s"]).all()


@pytest.mark.long     # as the documented run it reads (tests/test_docs.py, LONG): ~15 s of planning
def test_plan_scale_experiment_and_figure(docs_run):
    """The documentation's run of the experiment and of its figure (docs/results/planning.md;
    tests/test_docs.py shortens it to two models)."""
    docs_run.succeeded(docs_run.command_running("experiments/plan_scale.py"))
    t, attrs = load_table(docs_run.scratch / "runs" / "plan_scale" / "results.h5", "scale")
    assert list(t["model"]) == ["1.7B", "145B"] and attrs["machine"] == "dgx-a100-cluster"
    assert (t["dp"] * t["tp"] * t["pp"] == t["devices"]).all()
    assert t["feasible"].all() and (t["memory_gb"] <= 80).all()
    assert t["tp"][1] > 1 and t["pp"][1] > 1             # 146 B parameters must be sharded
    assert (0 < t["fraction_of_peak"]).all() and (t["fraction_of_peak"] < 1).all()
    figure = docs_run.command_running("analysis/plan_scale.py", "runs/plan_scale/results.h5")
    docs_run.succeeded(figure)
    png = shlex.split(docs_run.commands[figure], comments=True)[-1]
    assert (docs_run.scratch / png).read_bytes()[:4] == b"\x89PNG"
