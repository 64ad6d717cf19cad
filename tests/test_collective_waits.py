"""experiments/collective_waits.py on 2 ranks: it times exactly the collectives the price counts."""
import os
import subprocess
import sys

import numpy as np

from hpcnn.log.results import load_table
from mpi_util import ROOT, mpiexec

SCRIPT = os.path.join(ROOT, "experiments", "collective_waits.py")


def _run(tmp_path, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", SCRIPT,
                           f"--out={tmp_path / 'results.h5'}", *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_every_priced_allreduce_is_timed_once_a_step_with_its_bytes(tmp_path):
    plans = ["col-row-rep", "dp-col-row", "row-dp-col"]
    p = _run(tmp_path, f"--plans={','.join(plans)}", "--hidden=32,16", "--batch=32",
             "--steps=5", "--rounds=2", f"--machine={ROOT}/machines/local-2vcpu.toml")
    assert p.returncode == 0, p.stderr
    t, attrs = load_table(tmp_path / "results.h5", "calls")
    assert attrs["ranks"] == 2 and attrs["rounds"] == 2
    assert set(t["plan"]) == set(plans) and set(t["rank"]) == {0, 1}
    # dp-col-row: the data-parallel Linear's weight gradients, then the column's input
    # gradient, then the row's partial outputs
    got = {(r["plan"], r["op"], r["group"]) for r in _rows(t)}
    assert {("dp-col-row", 0, "batch"), ("dp-col-row", 1, "out"),
            ("dp-col-row", 2, "reduce")} <= got
    assert not any(r["plan"] == "col-row-rep" and r["op"] == 2 for r in _rows(t))
    for r in _rows(t):
        assert r["calls_per_step"] == 1 and r["median_s"] > 0
        assert r["bytes"] == r["priced_bytes"] and r["priced_devices"] == 2
        assert np.isfinite(r["priced_s"]) and r["priced_s"] > 0
    # every priced allreduce term was timed: none the price counts is missing from training
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import collective_waits
    from hpcnn.plan import validation as plan_validation
    machine = plan_validation.machine_for(f"{ROOT}/machines/local-2vcpu.toml", 2)
    graph = plan_validation.mlp_graph([32, 16], 32)
    options = plan_validation.cut_options(2)
    for name in plans:
        priced = collective_waits.priced(graph, [options[c] for c in name.split("-")], machine)
        assert {(name, op, g) for op, g in priced} == {x for x in got if x[0] == name}


def test_bad_plans_are_refused_on_every_rank_before_any_call(tmp_path):
    p = _run(tmp_path, "--plans=col-row-bogus", "--hidden=32,16")
    assert p.returncode != 0 and "'col-row-bogus'" in p.stderr and "bogus" in p.stderr
    assert p.stderr.count("error: --plans") == 2                # both ranks said it
    p = _run(tmp_path, "--plans=col-row", "--hidden=32,16")
    assert p.returncode != 0 and "expected 3 cuts" in p.stderr


def _rows(t):
    return [dict(zip(t, vals)) for vals in zip(*t.values())]
