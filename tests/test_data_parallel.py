"""Data parallelism: helpers and bucket layout serially; equivalence under mpiexec (2, 4 ranks)."""
import numpy as np
import pytest

from hpcnn.nn import models
from hpcnn.nn.optim import SGD
from hpcnn.parallel.data.bucketed import DataParallel, check_shares, dloss_for, shard
from mpi_util import CaseRuns, single




def mlp():
    return models.mlp(12, (8, 6), 4, seed=1, dtype=np.float64)


# -- pure helpers ----------------------------------------------------------------------------------
def test_dloss_factors():
    assert dloss_for("weighted", 5, [5, 11]) == 5 / 16
    assert dloss_for("uniform", 5, [5, 11]) == 1 / 2
    assert dloss_for("equal", 8, [8, 8]) == 8 / 16
    assert dloss_for("weighted", 2, [5, 11], local=5) == 2 / 16      # micro-batch of 2 of 5
    assert dloss_for("uniform", 2, [5, 11], local=5) == 2 / (2 * 5)
    shares = [1, 2, 3, 10]
    assert sum(dloss_for("weighted", b, shares) for b in shares) == pytest.approx(1.0)
    parts = [3, 3, 4]                                                 # local share 10 in 3 pieces
    assert sum(dloss_for("uniform", m, shares, local=10) for m in parts) == pytest.approx(1 / 4)


@pytest.mark.parametrize("args, match", [
    (("mean", 5, [5, 11]), "mode must be one of"),
    (("weighted", 5, [0, 16]), r"shares must be integers >= 1, got \[0, 16\]"),
    (("equal", 5, [5, 11]), r"needs equal shares, got \[5, 11\]"),
    (("weighted", 6, [5, 11], 5), r"micro-batch of 6 samples must lie in \[1, 5\]"),
    (("weighted", 4, [5, 11]), "local share 4 is not one of the shares"),
])
def test_dloss_errors(args, match):
    with pytest.raises(ValueError, match=match):
        dloss_for(*args)


def test_shard_contiguous():
    g = np.arange(16) * 10
    parts = [shard(g, [1, 2, 3, 10], k) for k in range(4)]
    assert [len(p) for p in parts] == [1, 2, 3, 10]
    np.testing.assert_array_equal(np.concatenate(parts), g)
    np.testing.assert_array_equal(parts[2], [30, 40, 50])
    with pytest.raises(ValueError, match=r"shares \[5, 10\] sum to 15, not the global batch 16"):
        shard(g, [5, 10], 0)
    with pytest.raises(ValueError, match="rank 2 out of range for 2 shares"):
        shard(g, [5, 11], 2)
    with pytest.raises(ValueError, match=">= 1"):
        check_shares([16, 0, 0], 16)


# -- layout ----------------------------------------------------------------------------------------
def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_mb=0: must be > 0"):
        DataParallel(mlp(), single(), bucket_mb=0)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        DataParallel(mlp(), single(), algorithm="tree")


@pytest.mark.parametrize("bucket_bytes", [80, 8 * 32, 10 ** 9])
def test_layout_reverse_and_buckets(bucket_bytes):
    model = mlp()
    for k, p in enumerate(model.params):
        p.grad = np.full(p.shape, float(k))                          # kept through the rebinding
    dp = DataParallel(model, single(), bucket_mb=bucket_bytes / 2 ** 20)
    assert [p.name for p in dp.params] == [p.name for p in model.params][::-1]
    (flat,) = dp.flats
    assert flat.size == model.num_params() + 1                       # + the sentinel
    o = 0
    for p in dp.params:                                              # views, in reverse order
        assert np.shares_memory(p.grad, flat) and p.grad.base is not None
        np.testing.assert_array_equal(flat[o:o + p.size], float(model.params.index(p)))
        o += p.size
    ranges = [(b.lo, b.hi) for b in dp.buckets]                      # contiguous byte ranges
    assert ranges[0][0] == 0 and ranges[-1][1] == flat.size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(hi - lo <= bucket_bytes // 8 + b.last for (lo, hi), b in zip(ranges, dp.buckets))
    assert [b.last for b in dp.buckets] == [False] * (len(ranges) - 1) + [True]
    split = any(sum(p is q for b in dp.buckets for q in b.params) > 1 for p in dp.params)
    assert split == (bucket_bytes < 10 ** 9)
    # readiness: a bucket is final after the lowest block any of its parameters belongs to
    owner = {id(p): i for i, blk in enumerate(model.blocks) for p in blk.params}
    for b in dp.buckets:
        assert b.ready == min(owner[id(p)] for p in b.params)
    assert [b.ready for b in dp.order] == sorted((b.ready for b in dp.buckets), reverse=True)


# -- one rank: the same as plain training ----------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False])
def test_single_rank_equals_plain(overlap):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((10, 12)), rng.integers(0, 4, 10)
    plain, par = mlp(), mlp()
    dp = DataParallel(par, single(), bucket_mb=100 / 2 ** 20, overlap=overlap)
    o1, o2 = SGD(plain.params), SGD(par.params)
    for step in range(3):
        plain.zero_grad()
        plain.backward(1.0, plain.forward(x, y)[1], need_dx=False)
        o1.step(0.1)
        dp.zero_grad()
        dp.backward(0.4, par.forward(x[:4], y[:4])[1], sync=False)   # accumulate 4 + 6 of 10
        dp.backward(0.6, par.forward(x[4:], y[4:])[1])
        info = dp.finish(step)
        assert info["bytes"] == 8 * (par.num_params() + 1)
        o2.step(0.1)
    for p, q in zip(plain.params, par.params):
        np.testing.assert_allclose(q.data, p.data, rtol=0, atol=1e-12)
    assert dp.check_replicas_equal()


def test_finite_check_exact_despite_overflowing_squares():
    model = models.mlp(12, (8,), 4, seed=1, dtype=np.float32)
    dp = DataParallel(model, single())
    dp.zero_grad()
    model.params[0].grad[0, 0] = 1e30                   # squared: inf in float32; still finite
    dp.finish(0)
    model.params[0].grad[0, 1] = -np.inf
    with pytest.raises(FloatingPointError, match="at step 1 on rank"):
        dp.finish(1)


def test_nan_reported_with_step_and_rank():
    model = mlp()
    dp = DataParallel(model, single())
    x = np.ones((3, 12))
    x[1, 2] = np.nan
    dp.zero_grad()
    dp.backward(1.0, model.forward(x, np.zeros(3, dtype=int))[1])
    with pytest.raises(FloatingPointError, match=r"^non-finite gradient at step 3 on rank\(s\) 0$"):
        dp.finish(3)


# -- many ranks ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """The two 2-rank scenarios share one job (one start-up per rank)."""
    return CaseRuns([(2, "dp_equivalence", ()), (4, "dp_equivalence", ()),
                     (2, "train_dp", (CaseRuns.FOLDER,)), (3, "train_dp", (CaseRuns.FOLDER,))],
                    folder=tmp_path_factory.mktemp("dp"), timeout=240)


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long)])
def test_dp_equivalence_mpi(n, dp_runs):
    assert f"dp_equivalence OK on {n} ranks" in dp_runs.stdout(n, "dp_equivalence")


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.long)])
def test_training_loop_data_parallel_equals_serial(n, dp_runs):
    assert f"train_dp OK on {n} ranks" in dp_runs.stdout(n, "train_dp", CaseRuns.FOLDER)
