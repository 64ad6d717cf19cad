"""hpcnn train --model=gcn with --spectral_features and --coarsen/--reduction: the coarse
training nodes and targets, serial runs (accuracy, /plan records), refusals, and the 2-rank runs
against the serial ones (tests/mpi/gcn_preprocessing.py)."""
import numpy as np
import pytest

from mpi_util import run_mpi
from hpcnn.config import ConfigError, parse_overrides
from hpcnn.graph.nodes import graph_data
from hpcnn.log import read_run
from hpcnn.train import train


def run(tmp_path, *extra, dataset="karate", steps=100):
    log = str(tmp_path / "run.h5")
    cfg = parse_overrides(["--model=gcn", f"--dataset={dataset}", "--hidden=16",
                           f"--steps={steps}", "--lr=0.02", "--eval_interval=0",
                           "--progress=false", f"--log={log}", *extra])
    out = train(cfg)
    return out, read_run(log).plan["operator_layout"]["preprocessing"]


@pytest.mark.parametrize("method", ["heavy_edge", "spectral", "random"])
def test_coarse_training_nodes_hold_a_training_node_and_its_majority_label(method):
    data = graph_data("karate", seed=0, coarsen=method, reduction=0.3)
    full, c = data.full, data.coarsening
    assert data.n_nodes == c.n_coarse == data.record["coarse_nodes"] == round(0.3 * 34)
    assert np.array_equal(data.train, np.unique(c.assign[full.train]))
    for group in range(c.n_coarse):
        known = full.labels[np.intersect1d(np.flatnonzero(c.assign == group), full.train)]
        want = np.bincount(known).argmax() if known.size else -1     # test labels never used
        assert data.labels[group] == want, group
    assert np.allclose(data.features, c.mean_features(full.features))


def test_serial_runs_with_spectral_features_and_coarsening(tmp_path):
    base, rec = run(tmp_path)
    assert rec == {} and base["test_acc"] > 0.85
    spec, rec = run(tmp_path, "--spectral_features=4")
    assert rec["spectral_features"] == 4 and rec["spectral_ranks"] == 1 and rec["spectral_s"] > 0
    assert spec["test_acc"] > 0.85 and spec["model"].blocks[0].n_in == 34 + 4
    coarse, rec = run(tmp_path, "--coarsen=heavy_edge", "--reduction=0.5")
    assert (rec["coarsen"], rec["nodes"], rec["coarse_nodes"]) == ("heavy_edge", 34, 17)
    assert rec["coarse_ratio"] == 0.5 and rec["coarsen_s"] > 0 and 1 <= rec["coarse_train_nodes"] <= 6
    assert coarse["test_acc"] > 0.75          # scored on the full graph's 28 test nodes
    sbm, rec = run(tmp_path, "--coarsen=spectral", "--reduction=0.3", "--spectral_features=4",
                   dataset="sbm", steps=60)
    assert rec["coarse_nodes"] == 600 and rec["spectral_features"] == 4
    assert sbm["test_acc"] > 0.8              # 4 blocks: chance is 0.25


@pytest.mark.parametrize("args, words", [
    (["--model=mlp", "--spectral_features=4"], ["spectral_features=4", "model='mlp'"]),
    (["--model=cnn", "--coarsen=random"], ["coarsen='random'", "model='cnn'"]),
    (["--model=gcn", "--reduction=0.5"], ["reduction=0.5", "--coarsen"]),
    (["--model=gcn", "--coarsen=metis"], ["coarsen='metis'", "heavy_edge"]),
    (["--model=gcn", "--coarsen=random", "--reduction=0"], ["reduction=0", "(0, 1]"]),
    (["--model=gcn", "--spectral_features=-1"], ["spectral_features=-1"]),
])
def test_bad_options_are_refused_with_their_values(args, words):
    with pytest.raises(ConfigError) as e:
        parse_overrides(args).resolved()
    assert all(w in str(e.value) for w in words), str(e.value)


def test_too_many_eigenvectors_are_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="spectral_features=33: karate has 34 nodes, at most 32"):
        run(tmp_path, "--spectral_features=33")


def test_distributed_preprocessing_equals_serial(tmp_path):
    assert "OK on 2 ranks" in run_mpi("gcn_preprocessing", 2, tmp_path)
