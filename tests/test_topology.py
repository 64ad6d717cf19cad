"""Nodes, emulated nodes and the two-level collectives (hpcnn/parallel/collectives/topology.py,
hier.py): the emulated cut on its own; under mpiexec with HPCNN_NODES, every collective across
nodes (tests/mpi/emulated_nodes.py), the data-parallel engine against the serial run with the
two-level allreduce (tests/mpi/dp_equivalence.py), and a GPT at dp x tp x pp against the serial
run (tests/mpi/train_pp.py); the run header, log and ``hpcnn info`` naming the nodes; the
refusals."""
import os
import subprocess
import sys

import pytest

from hpcnn import scripts
from hpcnn.cli import main
from hpcnn.log import read_run
from hpcnn.parallel.collectives import topology
from mpi_util import ROOT, mpiexec, run_mpi


def test_emulated_nodes_are_consecutive_nearly_equal_blocks():
    for size, k in [(4, 2), (6, 3), (7, 3), (5, 5), (8, 1)]:
        nodes = [topology.node_index(r, size, k) for r in range(size)]
        assert nodes == sorted(nodes) and set(nodes) == set(range(k)), (size, k, nodes)
        counts = [nodes.count(n) for n in range(k)]
        assert max(counts) - min(counts) <= 1, (size, k, counts)
    assert topology.describe([0, 0, 1, 1]) == "2 nodes x 2 ranks"
    assert topology.describe([0, 0, 0, 1, 1]) == "2 nodes of 3, 2 ranks"


def test_the_variable_is_read_and_checked(monkeypatch):
    topology.emulate(None)
    monkeypatch.setenv(topology.ENV, "3")
    assert topology.emulated() == 3
    monkeypatch.setenv(topology.ENV, "0")
    assert topology.emulated() is None
    for bad in ("two", "-1"):
        monkeypatch.setenv(topology.ENV, bad)
        with pytest.raises(topology.TopologyError, match=f"HPCNN_NODES='{bad}'"):
            topology.emulated()
    topology.emulate(2)                     # the option wins over the variable
    assert topology.emulated() == 2
    topology.emulate(None)


@pytest.mark.parametrize("nodes,n", [(2, 4), pytest.param(3, 6, marks=pytest.mark.long)])
def test_collectives_across_emulated_nodes_mpi(nodes, n):
    out = run_mpi("emulated_nodes", n, timeout=180, env={topology.ENV: str(nodes)})
    assert f"emulated_nodes OK on {n} ranks ({nodes} nodes)" in out


def test_data_parallel_with_the_two_level_allreduce_equals_serial_mpi():
    out = run_mpi("dp_equivalence", 4, timeout=240, env={topology.ENV: "2"})
    assert "dp_equivalence OK on 4 ranks" in out


@pytest.mark.long      # ~25 s: 8 ranks on 2 emulated nodes
def test_gpt_dp_tp_pp_on_emulated_nodes_equals_serial_mpi(tmp_path):
    out = run_mpi("train_pp", 8, str(tmp_path), 2, 2, 2, timeout=400, env={topology.ENV: "2"})
    assert "train_pp OK on 8 ranks (dp=2, tp=2, pp=2)" in out


# the parity scenarios of the other test files, again on emulated nodes: (scenario, ranks, nodes,
# arguments, the OK line); the quick ones in make test, the rest in make test-long
SLOW = pytest.mark.long
EMULATED = [("grid_collectives", 4, 2, (), "OK on 4 ranks"),
            ("tp_blocks", 4, 2, (), "tp_blocks OK on 4 ranks"),
            pytest.param("grid_collectives", 6, 3, (), "OK on 6 ranks", marks=SLOW),
            pytest.param("pipeline_equivalence", 4, 2, (), "pipeline_equivalence OK on 4 ranks",
                         marks=SLOW),
            pytest.param("train_zero", 4, 2, ("DIR",), "train_zero OK on 4 ranks", marks=SLOW),
            pytest.param("train_zero", 6, 3, ("DIR",), "train_zero OK on 6 ranks", marks=SLOW),
            pytest.param("train_pp", 6, 3, ("DIR", 3, 1, 2),
                         "train_pp OK on 6 ranks (dp=3, tp=1, pp=2)", marks=SLOW)]


@pytest.mark.parametrize("scenario,n,nodes,args,ok", EMULATED)
def test_parity_scenarios_on_emulated_nodes_mpi(tmp_path, scenario, n, nodes, args, ok):
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    out = run_mpi(scenario, n, *args, timeout=400, env={topology.ENV: str(nodes)})
    assert ok in out


def _train(tmp_path, n, *args, env=None):
    cmd = [mpiexec(), "-n", str(n), *scripts.mpiexec_flags(), sys.executable, "-m", "mpi4py",
           "-m", "hpcnn", "train",
           "--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
           "--batch_size=8", "--steps=2", "--eval_interval=0", f"--log={tmp_path / 'run.h5'}",
           *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_the_header_and_the_log_name_the_nodes_and_warn_of_a_split_tp_group(tmp_path):
    p = _train(tmp_path, 4, "--dp=2", "--tp=2", "--nodes=2")
    assert p.returncode == 0, p.stderr
    assert "on 2 nodes x 2 ranks (emulated), tp groups inside nodes first," in p.stdout
    plan = read_run(str(tmp_path / "run.h5")).plan
    assert plan["node_of_rank"] == [0, 0, 1, 1] and plan["emulated_nodes"] == 2
    assert plan["groups_spanning_nodes"] == {"tp": 0, "pp": 0, "dp": 2}
    p = _train(tmp_path, 4, "--dp=2", "--tp=2", "--overwrite=true", env={topology.ENV: "4"})
    assert p.returncode == 0, p.stderr
    assert "(warning: 2 tp group(s) span nodes" in p.stdout


@pytest.mark.long      # ~5 s of 4 ranks; make test names the nodes in the header and log (above)
def test_info_prints_every_rank_s_node_once(tmp_path):
    cmd = [mpiexec(), "-n", "4", *scripts.mpiexec_flags(), sys.executable, "-m", "mpi4py", "-m",
           "hpcnn", "info"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HPCNN_NODES="2")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("nodes: 2 nodes x 2 ranks (emulated)") == 1
    assert "rank -> node: 0: 0 (" in p.stdout and ", 3: 1 (" in p.stdout
    for label, kind in topology.HW_KINDS:       # the groups inside a node, or why not
        assert p.stdout.count(f"rank -> {label}: ") == 1
        assert f"rank -> {label}: 0: 0, 1: " in p.stdout or f"library ({kind})" in p.stdout


def test_more_emulated_nodes_than_ranks_is_refused_in_one_line(tmp_path, capsys):
    assert main(["train", "--model=mlp", "--steps=1", "--nodes=2",
                 f"--log={tmp_path / 'a.h5'}"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("hpcnn train: invalid configuration: nodes=2 emulated nodes for 1 "
                           "rank(s): at most one node a rank"), err
