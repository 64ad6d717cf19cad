"""Pipeline executor: helpers and single-rank runs serially; equivalence under mpiexec (2, 4 ranks)."""
import numpy as np
import pytest

from hpcnn.engine import execute, stage, step
from hpcnn.nn import models
from hpcnn.schedule import stages as partition, pipeline as schedules
from hpcnn.engine import pipelined as pipeline
from mpi_util import run_mpi, single




def mlp():
    return models.mlp(12, (8, 8, 6), 4, seed=1, dtype=np.float64)       # 7 blocks


def batch(n=10):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 12)), rng.integers(0, 4, n)


def serial_grads(x, y):
    model = mlp()
    model.zero_grad()
    loss, caches = model.forward(x, y)
    model.backward(1.0, caches)
    return loss, [p.grad.copy() for p in model.params]


# -- helpers --------------------------------------------------------------------------------------
def test_split_batch_sizes_and_errors():
    x, y = batch(10)
    xs, ys = step.split_batch(x, y, 4)
    assert [len(a) for a in xs] == [3, 3, 2, 2] == [len(b) for b in ys]
    assert np.array_equal(np.concatenate(xs), x) and np.array_equal(np.concatenate(ys), y)
    for bad in (0, 11, 2.0):
        with pytest.raises(ValueError, match="n_micro"):
            step.split_batch(x, y, bad)


def test_boundary_shapes_and_tags():
    ranges = partition.parse_layout("1|3|2|1", 7)
    shapes = stage.boundary_shapes(mlp(), ranges, [(3, 12), (2, 12)])
    # blocks fc0 relu | fc1 relu fc2 | relu fc3 (widths 12 8 8 6 4); the stage inputs:
    # block 0 (12), block 1 (8), block 4 (8), block 6 (6), then the output (4)
    assert shapes == [[(3, 12), (3, 8), (3, 8), (3, 6), (3, 4)],
                      [(2, 12), (2, 8), (2, 8), (2, 6), (2, 4)]]
    tags = {execute.tag_of(k, mb, s, 8) for k in execute.KINDS for mb in range(5)
            for s in range(8)}
    assert len(tags) == 2 * 5 * 8 and min(tags) == 0


def test_build_stages_placement():
    model = mlp()
    ranges = partition.uniform(7, 4)
    stages = stage.build_stages(model, ranges, 1, 2)
    assert [s.index for s in stages] == [1, 3]
    assert stages[1].last and stages[1].chain.loss is model.loss and not stages[0].last
    assert stages[0].chain.blocks == model.blocks[ranges[1][0]:ranges[1][1]]
    with pytest.raises(ValueError, match="do not split evenly"):
        stage.build_stages(model, partition.uniform(7, 3), 0, 2)
    v = schedules.placement("zb_v", 4, 2)                   # the V: rank 0 has stages 0 and 3
    stages = [stage.build_stages(model, ranges, r, 2, v) for r in (0, 1)]
    assert [[s.index for s in st] for st in stages] == [[0, 3], [1, 2]]
    assert stages[0][0].first and stages[0][1].last and not stages[1][1].last


def test_split_backward_matches_whole_backward():
    x, y = batch(6)
    grads = {}
    for split in (False, True):
        model = mlp()
        st = stage.Stage(0, model[0:7], 1)
        model.zero_grad()
        _, caches = st.forward(x, y)
        dx, pending = st.backward(0.5, caches, split)
        assert dx is None                                   # the first stage returns no dx
        assert (len(pending) == 4) == split                 # the four Linear blocks kept for W
        st.weight(pending)
        grads[split] = [p.grad.copy() for p in model.params]
    for a, b in zip(grads[False], grads[True]):
        assert np.allclose(a, b, rtol=0, atol=1e-15)
    st = stage.Stage(1, mlp()[2:7], 2)           # not first: returns dx
    _, caches = st.forward(np.ones((2, 8)), np.array([0, 1]))
    assert st.backward(1.0, caches, True)[0].shape == (2, 8)


# -- single-rank runs of every schedule -----------------------------------------------------------
@pytest.mark.parametrize("name,virtual,M", [("gpipe", 3, 4), ("interleaved", 3, 3),
                                            ("1f1b", 1, 4), ("zb_h1", 1, 4), ("gpipe", 1, 1),
                                            ("zb_v", 2, 4)])
def test_single_rank_equals_serial(name, virtual, M):
    x, y = batch(10)
    model = mlp()
    out = pipeline.train_step(name, model, single(), x, y, M, virtual=virtual)
    loss, grads = serial_grads(x, y)
    assert abs(out["loss"] - loss) < 1e-12
    for p, g in zip(model.params, grads):
        assert np.abs(p.grad - g).max() < 1e-12, p.name
    lst = schedules.SCHEDULES[name](virtual, M, 1)[0]
    assert [(k, mb) for _, k, mb, _, _ in out["events"]] == [(i.kind, i.mb) for i in lst]
    assert len(out["stages"]) == virtual and out["ranges"] == partition.uniform(7, virtual)


def test_peak_memory_gpipe_vs_1f1b():
    x, y = batch(8)                                        # four micro-batches of 2
    one = sum(s.bytes_cache for s in mlp().spec((2, 12)))
    peaks = {n: pipeline.train_step(n, mlp(), single(), x, y, 4) for n in ("gpipe", "1f1b")}
    assert peaks["gpipe"]["peak_bytes"] == 4 * one and peaks["gpipe"]["peak_inflight"] == 4
    assert peaks["1f1b"]["peak_bytes"] == one and peaks["1f1b"]["peak_inflight"] == 1


def test_errors():
    x, y = batch(10)
    with pytest.raises(ValueError, match="unknown schedule"):
        pipeline.train_step("nope", mlp(), single(), x, y, 2)
    with pytest.raises(ValueError, match="expected pp"):
        pipeline.train_step("gpipe", mlp(), single(), x, y, 2, layout="3|4")
    model = mlp()
    stages = stage.build_stages(model, [(0, 7)], 0, 1)
    lst = [i for i in schedules.gpipe(1, 2, 1)[0] if i.kind != "B"]    # no backward: left over
    xs, ys = step.split_batch(x, y, 2)
    shapes = stage.boundary_shapes(model, [(0, 7)], [a.shape for a in xs])
    with pytest.raises(RuntimeError, match="2 caches"):
        execute.run(lst, stages, single(), xs, ys, dloss=0.5, shapes=shapes,
                              dtype=np.float64)


# -- under mpiexec --------------------------------------------------------------------------------
@pytest.mark.parametrize("n,names", [(2, ()), pytest.param(4, (), marks=pytest.mark.long),
                                     (3, ("zb_h1", "zb_v"))])
def test_pipeline_equivalence_mpi(n, names):
    """Every schedule on 2 and 4 ranks (4: make test-long); the zero-bubble ones also on an odd
    pp (3 stages, or 6 in a V)."""
    out = run_mpi("pipeline_equivalence", n, *([",".join(names)] if names else []), timeout=120)
    assert f"pipeline_equivalence OK on {n} ranks" in out
    ran = dict(x.rsplit(" ", 1) for x in out.split("runs: ")[1].split(")")[0].split(", "))
    assert set(ran) == set(names or schedules.SCHEDULES)        # each ran at least once
