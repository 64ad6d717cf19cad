"""Real nodes on one machine (benchmarks/netns_cluster.py): network namespaces joined by a
throttled link, MPI over TCP between them. Skipped where the machine cannot build them (not
root, no namespaces, no tbf)."""
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import netns_cluster  # noqa: E402

WHY = netns_cluster.usable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"emulated cluster: {WHY}")
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def test_the_hierarchical_allreduce_over_a_throttled_link_is_bitwise_the_same_everywhere(tmp_path):
    """2 nodes x 2 ranks at 2 Gbit/s: the link measures at most its rate, the ranks see two
    nodes, hpcnn's two-level allreduce gives every rank the same bits and the library's sum to
    rounding, and the benchmark's tables hold its figures."""
    out = tmp_path / "link.h5"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "throttled_link.py"),
                          "--rate=2gbit", "--sizes=1", "--rounds=1", f"--out={out}"],
                         capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 nodes x 2 ranks" in run.stdout and "tbf 2gbit, netns" in run.stdout
    with h5py.File(out, "r") as f:
        rows, fig = f["throttled_link"], f["throttled_link_machine"]
        assert rows["hier_bitwise_same"][0] == 1 and rows["hier_matches_lib"][0] == 1
        assert 0 < fig["inter_stream_Bps"][0] < 1.1 * 2e9 / 8        # the throttle holds
        assert fig["inter_all_Bps"][0] > 0 and fig["intra_reduce_Bps"][0] > 0
        assert f["throttled_link"].attrs["emulated_link"] == "tbf 2gbit, netns"


@pytest.mark.long     # ~6 s; make test trains with the two-level allreduce across emulated nodes
# (tests/test_topology.py) and runs it across these namespaced ones (above)
def test_training_across_the_nodes_equals_the_run_on_one_node(tmp_path):
    """An MLP on dp = 4 in float64 with the two-level allreduce, over 2 namespaced nodes, has
    the losses of the same run on one node to 1e-10; its header and log name the link as an
    emulation."""
    from hpcnn.log import read_run
    args = ["-m", "mpi4py", "-m", "hpcnn", "train", "--model=mlp", "--dp=4", "--steps=6",
            "--dtype=float64", "--eval_interval=0", "--log_interval=1"]
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    here = subprocess.run([mpiexec, "-n", "4", sys.executable, *args,
                           f"--log={tmp_path / 'one.h5'}"],
                          capture_output=True, text=True, env=ENV, timeout=240)
    assert here.returncode == 0, here.stderr
    there = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "netns_cluster.py"),
                            "--rate=2gbit", "--", sys.executable, *args, "--allreduce=hier",
                            f"--log={tmp_path / 'two.h5'}"],
                           capture_output=True, text=True, env=ENV, timeout=240)
    assert there.returncode == 0, there.stdout + there.stderr
    assert "on 2 nodes x 2 ranks" in there.stdout
    assert "over an emulated link (tbf 2gbit, netns)" in there.stdout
    one, two = read_run(tmp_path / "one.h5"), read_run(tmp_path / "two.h5")
    assert len(two.metrics["loss"]) == 6
    np.testing.assert_allclose(two.metrics["loss"], one.metrics["loss"], rtol=0, atol=1e-10)
    assert two.attrs["emulated_link"] == "tbf 2gbit, netns"
    assert two.plan["node_of_rank"] == [0, 0, 1, 1]
