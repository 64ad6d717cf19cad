"""ZeRO stages 1, 2 and 3 (hpcnn/parallel/data/sharded.py, zero3.py): the optimizer state, at
stage 2 the gradients, at stage 3 the parameters too, sharded over the data-parallel ranks,
against zero 0 in float64 (tests/mpi/train_zero.py; at 2 ranks: MLP with AdamW, SGD with
clipping, accumulation and weight decay, weighted speeds; GPT, also with remat and the shm
allreduce; GCN; in make test-long, at 3 ranks (uneven parts) the SGD, weighted and GPT cases,
at 4 ranks dp = 4, tp = 2 and pp = 2 with 1F1B and ZB-H1, stage 3 where there is no pipeline,
and every case at 3 and 4 ranks), the memory split,
checkpoints across stages, the planner's price of what a rank holds; and the parts, the
gathered blocks, the note and the refusals on their own."""
import numpy as np
import pytest

from hpcnn.cli import main
from hpcnn.parallel.data.sharded import bounds
from mpi_util import CaseRuns


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    return CaseRuns([(n, "train_zero", (CaseRuns.FOLDER,)) for n in (2, 3, 4)],
                    folder=tmp_path_factory.mktemp("zero"), timeout=240)


@pytest.fixture(scope="module")
def every_zero_run(tmp_path_factory):           # (jobs of their own: make test-long only)
    return CaseRuns([(n, "train_zero", (CaseRuns.FOLDER, "--every")) for n in (3, 4)],
                    folder=tmp_path_factory.mktemp("zero-every"), timeout=240)


# 3 and 4 ranks (uneven parts; tp = 2, pp = 2 with ZeRO) in make test-long: ~17 s
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.long),
                               pytest.param(4, marks=pytest.mark.long)])
def test_zero1_2_and_3_equal_zero0_and_shard_the_state(n, zero_runs):
    assert f"train_zero OK on {n} ranks" in zero_runs.stdout(n, "train_zero", CaseRuns.FOLDER)


@pytest.mark.long     # ~30 s: every case, and the resumes, at 3 and 4 ranks as well
@pytest.mark.parametrize("n", [3, 4])
def test_every_zero_case_at_3_and_4_ranks(n, every_zero_run):
    assert f"train_zero OK on {n} ranks" in every_zero_run.stdout(n, "train_zero",
                                                                  CaseRuns.FOLDER, "--every")


def test_parts_cover_every_element_once_nearly_evenly():
    for n, parts in [(10, 3), (7, 4), (3, 4), (1000003, 3)]:
        cut = bounds(n, parts)
        sizes = np.diff(cut)
        assert cut[0] == 0 and cut[-1] == n and sizes.min() >= 0
        assert sizes.max() - sizes.min() <= 1


def test_zero_without_data_parallel_ranks_is_a_note(tmp_path, capsys):
    assert main(["train", "--model=mlp", "--hidden=8", "--steps=2", "--zero=1",
                 "--progress=false", f"--log={tmp_path / 'a.h5'}"]) == 0
    assert "note: --zero=1 with dp=1 changes nothing" in capsys.readouterr().err


@pytest.mark.parametrize("args,words", [
    (["--zero=4"], "zero=4"),
    (["--model=gpt", "--dataset=sonnet", "--zero=3", "--dp=2", "--pp=2"],
     "zero=3 with pp=2: ZeRO-3 gathers the parameters around the blocks of one chain"),
    (["--zero=3", "--dp=2", "--remat=optimal", "--memory_budget=10"],
     "zero=3 with remat='optimal': each rank's recomputation sequence depends on its share"),
    (["--zero=3", "--dp=2", "--allreduce=shm"], "zero=3 with allreduce='shm': ZeRO-3 "),
    (["--zero=2", "--dp=2", "--allreduce=ring"], "zero=2 with allreduce='ring': ZeRO-2 "
                                                 "reduce-scatters each bucket with the MPI library"),
    (["--model=gpt", "--dataset=sonnet", "--zero=2", "--tp=2", "--sequence_parallel=true"],
     "zero=2 with sequence_parallel=true")])
def test_what_zero_cannot_run_is_refused_in_one_line(tmp_path, capsys, args, words):
    assert main(["train", *args, f"--log={tmp_path / 'a.h5'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcnn train: ") and words in err and len(err.splitlines()) == 1


def test_the_memory_check_counts_a_rank_s_part_of_the_slots():
    """Under --zero=1 a rank holds its parameters, its gradients and 1/dp of the AdamW slots:
    the memory check's floor falls by (2 - 2/dp) words a parameter (exactly, for the CNN)."""
    from hpcnn import datasets, memory_check
    from hpcnn.config import parse_overrides
    cfg0 = parse_overrides(["--model=cnn", "--dp=4"]).resolved()
    data = datasets.for_config(cfg0)
    need0, _ = memory_check.rank_need(cfg0, data)
    need1, _ = memory_check.rank_need(parse_overrides(["--model=cnn", "--dp=4",
                                                       "--zero=1"]).resolved(), data)
    n = memory_check.param_count(cfg0, data)
    assert need0 - need1 == pytest.approx((2 - 2 / 4) * n * 4)
    need3, _ = memory_check.rank_need(parse_overrides(["--model=cnn", "--dp=4",
                                                       "--zero=3"]).resolved(), data)
    assert need0 - need3 == pytest.approx((4 - 4 / 4) * n * 4)     # all four words, 1/dp


def test_report_prints_each_rank_s_memory_and_stage_2_s_buckets():
    from hpcnn.log.report import _memory_lines
    plan = {"zero": 2, "param_bytes_per_rank": [2**20, 2**20],
            "grad_bytes_per_rank": [2**19, 2**19], "optimizer_bytes_per_rank": [3 * 2**19] * 2,
            "peak_activation_bytes_per_rank": [5 * 2**20] * 2,
            "grad_buffer_peak_bytes_per_rank": [2**20, 2**19]}
    assert _memory_lines(plan) == [
        "memory   per rank (zero 2), MiB: parameters, gradients, optimizer, activations, "
        "gradient buckets' peak",
        "         rank 0: 1.0, 0.5, 1.5, 5.0, 1.0", "         rank 1: 1.0, 0.5, 1.5, 5.0, 0.5"]
    assert _memory_lines(dict(plan, zero=0))[0].endswith("optimizer, activations")
    three = _memory_lines(dict(plan, zero=3, param_gather_peak_bytes_per_rank=[3 * 2**18] * 2))
    assert three[0].endswith("gradient buckets' peak, gathered blocks' peak") and \
        three[1].endswith("1.0, 0.8"), three
    assert len(_memory_lines(dict(plan, param_bytes_per_rank=[1] * 10))) == 1 + 8 + 1
    assert _memory_lines({}) == []


def test_a_gathered_block_holds_its_parameters_only_while_it_runs():
    """Stage 3 on one rank (the same code, gathers of one part): the chain's loss and reduced
    gradient are the plain chain's; between uses every parameter is a placeholder (NaN, no
    storage) and at most two blocks are gathered; ``whole()`` binds them all; train/eval reach
    the wrapped blocks; release gives back whole private parameters and the plain blocks."""
    from hpcnn.nn import models
    from hpcnn.nn.core import is_placeholder
    from hpcnn.parallel.collectives import Communicator
    from hpcnn.parallel.data.zero3 import GatheredBlock, ShardedParameters
    x = np.random.default_rng(0).standard_normal((6, 8))
    y = np.arange(6) % 4
    plain = models.mlp(8, (16, 16), 4, dtype=np.float64)
    model = models.mlp(8, (16, 16), 4, dtype=np.float64)
    want, caches = plain.forward(x, y)
    plain.backward(1.0, caches)
    engine = ShardedParameters(model, Communicator.single(), bucket_mb=1e-3)
    engine.broadcast_parameters()
    wrapped = [b for b in model.blocks if isinstance(b, GatheredBlock)]
    assert len(wrapped) == sum(1 for b in plain.blocks if b.params) == 3
    assert all(is_placeholder(q.data) and np.isnan(q.data).all() for q in model.params)
    model.zero_grad()
    got, caches = model.forward(x, y)
    engine.backward(1.0, caches)
    assert not engine.recomputing      # (the first Linear's backward: its weight half only)
    engine.finish(0)
    assert got == want and all(is_placeholder(q.data) for q in model.params)
    assert engine.gather_peak == 8 * (8 * 16 + 16 + 16 * 16 + 16)   # the first two Linears
    grads = {q.name: q.grad for q in plain.params}
    for flat, (ps, _) in zip(engine.flats, engine.groups):
        assert np.array_equal(flat, np.concatenate([grads[q.name].reshape(-1) for q in ps]))
    model.eval()
    assert not any(b.training for b in model.blocks) and not wrapped[0].inner.training
    with engine.whole():
        assert not any(is_placeholder(q.data) for q in model.params)
        assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.params, model.params))
    assert all(is_placeholder(q.data) for q in model.params)
    engine.release()
    assert not any(isinstance(b, GatheredBlock) for b in model.blocks)
    assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.params, model.params))


def test_a_parameter_two_blocks_share_is_refused_at_stage_3():
    from hpcnn.nn.chain import Chain
    from hpcnn.nn.layers import Linear
    from hpcnn.nn.loss import SoftmaxCrossEntropy
    from hpcnn.parallel.collectives import Communicator
    from hpcnn.parallel.data.zero3 import ShardedParameters
    lin = Linear(4, 4, dtype=np.float64, name="tied")
    model = Chain([lin, lin], SoftmaxCrossEntropy())
    with pytest.raises(ValueError, match="parameter tied.weight is shared by blocks 0 and 1"):
        ShardedParameters(model, Communicator.single(), bucket_mb=1.0)


def test_stage_2_holds_three_blocks_of_gradients_however_slow_the_reductions():
    """Stage 2 waits, after each block's backward, for the reductions launched two blocks
    before, and reduces each micro-batch in its own backward: with reductions that never
    complete unless waited for, a step of one or of three micro-batches still binds at most
    three blocks' gradients and a bucket each (what the planner prices,
    ``hybrid.grad_buffer_params``), not the whole model's, and its parts are the plain chain's
    accumulated gradient."""
    from hpcnn.nn import models
    from hpcnn.parallel.collectives import Communicator
    from hpcnn.parallel.collectives.comm import _SelfRequest
    from hpcnn.parallel.data.sharded import ShardedGradients
    from hpcnn.plan.hybrid import grad_buffer_params

    class Slow(_SelfRequest):               # done only once waited for
        def test(self):
            return self.done

        def wait(self):
            if not self.done:
                self._finish(0.0)

    comm = Communicator.single()
    start = comm.ireduce_scatter_parts
    comm.ireduce_scatter_parts = lambda *a, **k: (start(*a, **k),
                                                  Slow(comm.stats, "ireduce_scatter"))[1]
    rng = np.random.default_rng(0)
    for micro in (1, 3):
        xs, ys = rng.standard_normal((micro, 6, 8)), rng.integers(0, 4, (micro, 6))
        plain, model = (models.mlp(8, (16,) * 6, 4, dtype=np.float64) for _ in range(2))
        for x, y in zip(xs, ys):
            plain.backward(0.5, plain.forward(x, y)[1])
        bucket = 1e-3
        engine = ShardedGradients(model, comm, bucket_mb=bucket)
        for k, (x, y) in enumerate(zip(xs, ys)):
            engine.backward(0.5, model.forward(x, y)[1], sync=k == micro - 1)
        engine.finish(0)
        whole = sum(q.size for q in model.params)
        block = max(sum(q.size for q in b.params) for b in model.blocks)
        priced = grad_buffer_params(whole, block, 8, False, bucket=bucket * 2 ** 20)
        assert block * 8 <= engine.peak_bytes <= priced * 8 < whole * 8, \
            (micro, engine.peak_bytes, block, priced, whole)
        grads = {q.name: q.grad for q in plain.params}
        for flat, (ps, _) in zip(engine.flats, engine.groups):
            want = np.concatenate([grads[q.name].reshape(-1) for q in ps])
            assert np.allclose(flat, want, rtol=1e-13, atol=0), micro
        engine.release()


def test_a_recomputed_block_is_gathered_once_for_its_recomputation_and_backward():
    """Stage 3 under rematerialization: a forward between a micro-batch's backwards keeps its
    block gathered for the backward that follows and prefetches nothing, so every block is
    gathered once for the forward and once for the backward (the last block once), as
    without recomputation: 2n - 1 gathers a micro-batch, and the plain chain's gradients."""
    from hpcnn.memory.executor import Executor
    from hpcnn.nn import models
    from hpcnn.parallel.collectives import Communicator
    from hpcnn.parallel.data.zero3 import ShardedParameters
    from hpcnn.schedule import sequences
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 32, (6, 16))
    x, y = tok, np.roll(tok, -1, axis=1)

    def gpt():
        return models.gpt(32, block_size=16, n_layers=3, dim=32, n_heads=4, seed=3,
                          dtype=np.float64)
    plain = gpt()
    plain.backward(1.0, plain.forward(x, y)[1])
    n = len(plain.blocks) + 1                     # the blocks and the loss
    for seq in (sequences.store_all(n), sequences.segments(n, n - 1)):
        model = gpt()
        engine = ShardedParameters(model, Communicator.single(), bucket_mb=1e-3)
        engine.broadcast_parameters()
        wrapped = sum(1 for b in model.blocks if b.params)
        model.zero_grad()
        Executor(model, seq, need_dx=False).run(x, y)
        engine.finish(0)
        assert engine.gathers == 2 * wrapped - 1, (engine.gathers, wrapped)
        assert engine.gather_peak <= 2 * max(8 * sum(q.size for q in b.params)
                                             for b in model.blocks)
        grads = {q.name: q.grad for q in plain.params}
        for flat, (ps, _) in zip(engine.flats, engine.groups):
            want = np.concatenate([grads[q.name].reshape(-1) for q in ps])
            assert np.allclose(flat, want, rtol=0, atol=1e-12)
        engine.release()
