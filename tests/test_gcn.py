"""The GCN: graph convolution block (finite differences), node loss, node split, training,
refused options, and the distributed GCN against the serial one (tests/mpi/gcn_equivalence.py)."""
import numpy as np
import pytest

from gradcheck import check_block_gradients
from mpi_util import run_mpi
from hpcnn.config import ConfigError, parse_overrides
from hpcnn.graph import RowPartition
from hpcnn.graph.nodes import graph_data, node_split
from hpcnn.nn.gcn import GraphConv, GraphOperator, NodeLoss, gcn
from hpcnn.train import train

F64 = "float64"


@pytest.fixture(scope="module")
def karate():
    return graph_data("karate", seed=0)


@pytest.mark.parametrize("bias", [True, False])
def test_graph_conv_backward_matches_finite_differences(karate, bias):
    op = GraphOperator.from_global(karate.a_hat, dtype=F64)
    block = GraphConv(op, 6, 4, bias=bias, seed=1, dtype=F64)
    x = np.random.default_rng(0).standard_normal((karate.n_nodes, 6))
    check_block_gradients(block, x)


def test_gcn_loss_gradient_matches_finite_differences(karate):
    """The whole chain (GraphConv, ReLU, GraphConv, NodeLoss): dL/dθ by central differences."""
    x, y, n = karate.features, karate.targets(), karate.n_nodes
    model = gcn(GraphOperator.from_global(karate.a_hat, dtype=F64), x.shape[1], (5,), 2,
                n_train=karate.train.size, n_nodes=n, seed=2, dtype=F64)
    model.zero_grad()
    _, caches = model.forward(x, y)
    model.backward(1.0, caches)
    rng = np.random.default_rng(0)
    for q in model.params:
        flat, grad = q.data.reshape(-1), q.grad.reshape(-1).copy()
        for i in rng.choice(flat.size, size=min(15, flat.size), replace=False):
            old = flat[i]
            flat[i] = old + 1e-6
            lp = model.forward(x, y)[0]
            flat[i] = old - 1e-6
            lm = model.forward(x, y)[0]
            flat[i] = old
            assert abs((lp - lm) / 2e-6 - grad[i]) <= 1e-7 + 1e-5 * abs(grad[i]), (q.name, i)


def test_node_loss_is_the_mean_cross_entropy_over_training_nodes(karate):
    logits = np.random.default_rng(0).standard_normal((karate.n_nodes, 2))
    loss, _ = NodeLoss(karate.n_nodes, karate.train.size).forward(logits, karate.targets())
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    t = karate.train
    assert loss == pytest.approx(-logp[t, karate.labels[t]].mean(), rel=1e-12)


def test_node_split_is_seeded_class_balanced_and_disjoint():
    labels = np.repeat(np.arange(4), [50, 200, 3, 10])
    train, test = node_split(labels, seed=5)
    assert np.bincount(labels[train]).tolist() == [10, 20, 1, 2]
    assert np.intersect1d(train, test).size == 0 and train.size + test.size == labels.size
    assert np.array_equal(node_split(labels, seed=5)[0], train)
    assert not np.array_equal(node_split(labels, seed=6)[0], train)
    sbm = graph_data("sbm")
    assert (sbm.n_nodes, sbm.n_classes, sbm.train.size) == (2000, 4, 80)


def test_bad_inputs_are_refused_with_their_values(karate, tmp_path):
    op = GraphOperator.from_global(karate.a_hat, dtype=F64)
    with pytest.raises(ValueError, match="expected this rank's 34 rows of 6"):
        GraphConv(op, 6, 2, dtype=F64).forward(np.zeros((33, 6)))
    with pytest.raises(ValueError, match="operator in float64, block in float32"):
        GraphConv(op, 6, 2, dtype="float32")
    with pytest.raises(ValueError, match="partition of 2 ranks on 1"):
        GraphOperator.from_global(karate.a_hat, RowPartition.contiguous(34, 2))
    for args, msg in [(["--model=gcn", "--tp=2"], "tp=2, pp=1"),
                      (["--model=mlp", "--dataset=karate"], "are for model='gcn'"),
                      (["--model=gcn", "--dataset=digits"], "are for model='gcn'"),
                      (["--model=gcn", "--balance=proportional"], "balance='proportional'"),
                      (["--model=gcn", "--remat=sqrt"], "remat='sqrt'")]:
        with pytest.raises(ConfigError, match=msg):
            parse_overrides(args).resolved()
    from hpcnn import preflight                  # before MPI starts: at least one row per rank
    cfg = parse_overrides(["--model=gcn", "--dp=40", f"--log={tmp_path / 'x.h5'}"]).resolved()
    with pytest.raises(ConfigError, match="dp=40: karate has 34 nodes"):
        preflight.check(cfg, 40)
    # a step is the whole graph: a batch other than the node count is refused, not replaced
    with pytest.raises(ConfigError, match="batch_size=16: model='gcn' runs full-batch steps, "
                                          "34 nodes of karate; leave --batch_size unset or pass 34"):
        preflight.planned(parse_overrides(["--model=gcn", "--batch_size=16"]).resolved(), 1)
    assert preflight.planned(parse_overrides(["--model=gcn", "--batch_size=34"]).resolved(),
                             1)[0].batch_size == 34


def test_partition_option_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ConfigError, match="partition='random' cuts a graph's rows"):
        parse_overrides(["--model=mlp", "--partition=random"]).resolved()
    with pytest.raises(ConfigError, match="partition"):
        parse_overrides(["--model=gcn", "--partition=kway"]).resolved()
    import importlib.util
    find_spec = importlib.util.find_spec            # as on a machine without pymetis
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pymetis" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="partition='metis' needs the optional package pymetis"):
        parse_overrides(["--model=gcn", "--partition=metis", "--dp=2"]).resolved()
    parse_overrides(["--model=gcn", "--partition=spectral", "--dp=2"]).resolved()


def test_serial_training_on_karate_learns_the_factions(tmp_path):
    from hpcnn.log import read_run
    log = str(tmp_path / "gcn.h5")
    out = train(parse_overrides(["--model=gcn", "--hidden=16", "--steps=60", "--lr=0.01",
                                 "--progress=false", f"--log={log}", "--eval_interval=30"]))
    run = read_run(log)
    assert out["test_acc"] >= 0.9 and run.metrics["loss"][-1] < 0.5 * run.metrics["loss"][0]
    assert run.plan["operator_layout"]["ranks"] == 1 and run.plan["operator_layout"]["edge_cut"] == 0
    assert int(run.config["batch_size"]) == 34         # full batch: the graph's nodes


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.long),
                               pytest.param(4, marks=pytest.mark.long)])
def test_distributed_gcn_equals_serial(n, tmp_path):
    assert f"OK on {n} ranks" in run_mpi("gcn_equivalence", n, tmp_path)


def test_the_graph_data_sets_are_the_configs_choices():
    """--dataset's graph choices (config, which must not load the graph package) are exactly
    the data sets hpcnn.graph.nodes builds."""
    from hpcnn.config import GRAPH_DATASETS
    from hpcnn.graph.nodes import makers
    assert tuple(makers()) == GRAPH_DATASETS
