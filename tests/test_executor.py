"""Executing rotor sequences on real chains: gradients equal store-all, the account matches the
simulator, and tracemalloc agrees with the account."""
import tracemalloc

import numpy as np
import pytest

from hpcnn import datasets as data
from hpcnn.schedule.ops import Op
from hpcnn.memory import profile, rotor
from hpcnn.schedule import sequences as sequence
from hpcnn.memory.executor import Executor, live_bytes, store_all_reference
from hpcnn.memory.simulate import simulate
from hpcnn.nn import models

from mpi_util import run_mpi

F64 = np.float64


def mlp():
    return models.mlp(64, (96, 96, 96, 96), 10, dtype=F64, seed=3)


def gpt():
    return models.gpt(32, block_size=16, n_layers=3, dim=32, n_heads=4, dropout=0.2, seed=3,
                      dtype=F64)


def cnn():
    return models.cnn(1, 8, (4, 8), 16, dtype=F64, seed=3)


def batch(kind):
    if kind == "gpt":
        rng = np.random.default_rng(0)
        tok = rng.integers(0, 32, (6, 16))
        return tok, np.roll(tok, -1, axis=1)
    d = data.digits(image=kind == "cnn")
    return d.x_train[:40].astype(F64), d.y_train[:40]


BUILD = {"mlp": mlp, "gpt": gpt, "cnn": cnn}


def grads(chain):
    return [p.grad.copy() for p in chain.params]


def reference(kind, steps=2):
    """Store-all over ``steps`` steps (dropout counters advance): losses, dx, grads per step."""
    chain, (x, y) = BUILD[kind](), batch(kind)
    out = []
    for _ in range(steps):
        chain.zero_grad()
        loss, dx = store_all_reference(chain, x, y)
        out.append((loss, dx, grads(chain)))
    return out


def sequences(prof):
    n = len(prof)
    solver = rotor.Solver(prof, slots=300)
    seqs = {"store_all": sequence.store_all(n), "sqrt": sequence.segments(n),
            "revolve2": sequence.revolve(n, 2)}
    for frac in (0.35, 0.5, 0.7):
        budget = max(solver.least, frac * solver.top)
        seqs[f"optimal{frac}"] = solver.solve(budget).sequence
    return seqs


@pytest.mark.parametrize("kind", ["mlp", "gpt", "cnn"])
def test_sequences_give_store_all_gradients(kind):
    ref = reference(kind)
    x, y = batch(kind)
    prof = profile.of_chain(BUILD[kind](), x.shape)
    for name, seq in sequences(prof).items():
        chain = BUILD[kind]()
        ex = Executor(chain, seq, need_dx=kind != "gpt")
        for step, (loss, dx, g) in enumerate(ref):
            chain.zero_grad()
            res = ex.run(x, y)
            assert res.loss == pytest.approx(loss, rel=0, abs=1e-12), (name, step)
            if dx is not None:
                np.testing.assert_allclose(res.dx, dx, rtol=0, atol=1e-12)
            for a, b in zip(grads(chain), g):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=f"{name} {step}")
        sim = simulate(seq, prof)
        if kind == "cnn":            # Flatten's output is a view: the model over-counts it
            assert res.peak <= sim.peak, name
        else:
            assert res.peak == sim.peak, (name, res.peak, sim.peak)


def test_a_stage_without_the_loss_holds_only_checkpoints_between_its_passes():
    """Full recomputation on a pipeline stage without the loss (a segment per block,
    ``has_loss=False``): its forward keeps each block's input and its output, no cache; its
    backward recomputes every block, the last first, and gives store-all's dx and gradients
    bit for bit (dropout's masks drawn again); the account equals the simulator's peak."""
    full, (x, _) = gpt(), batch("gpt")
    stage = full[:3]                                     # the embedding and two blocks
    n = len(stage)
    seq = sequence.segments(n, n, has_loss=False)
    assert " ".join(map(str, seq)) == "F_ck0 F_ck1 F_ck2 F_all2 B2 F_all1 B1 F_all0 B0"
    dy = np.random.default_rng(1).standard_normal((6, 16, 32))
    want = gpt()[:3]
    ys, cs = [], []
    h = x
    for blk in want.blocks:
        h, c = blk.forward(h)
        ys.append(h)
        cs.append(c)
    d = dy
    for blk, c in reversed(list(zip(want.blocks, cs))):
        d = blk.backward(d, c)
    prof = profile.of_chain(stage, x.shape, need_dx=False)
    ex = Executor(stage, seq, need_dx=False)
    y, st = ex.forward(x)
    np.testing.assert_array_equal(y, ys[-1])
    assert not st.bars and sorted(st.xs) == [0, 1, 2, 3]     # inputs and the output only
    ex.backward(dy, st)
    for a, b in zip(grads(stage), grads(want)):
        np.testing.assert_array_equal(a, b)
    assert st.peak == simulate(seq, prof).peak


def test_recompute_restores_dropout_state():
    chain, (x, y) = gpt(), batch("gpt")
    seq = sequence.revolve(len(chain) + 1, 1)
    Executor(chain, seq).run(x, y)
    ref = gpt()
    store_all_reference(ref, x, y)
    assert chain.rng_state() == ref.rng_state()


def test_tracemalloc_agrees_with_the_account():
    """Traced growth during the step <= the account's peak + the largest block transient."""
    chain, (x, y) = mlp(), batch("mlp")
    x = np.tile(x, (8, 1))
    y = np.tile(y, 8)
    measured = profile.measure(chain, x, y, repeats=1)
    transient = int(max(measured.of.max(), measured.ob.max()))
    prof = profile.of_chain(chain, x.shape)
    solver = rotor.Solver(prof, slots=200)
    for budget in (solver.least * 1.05, 0.6 * solver.top, solver.top):
        seq = solver.solve(budget).sequence
        ex = Executor(chain, seq)
        chain.zero_grad()
        ex.run(x, y)                                   # warm-up: scratch buffers, lazy grads
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            res = ex.run(x, y)
            traced = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert res.peak <= budget
        assert traced <= res.peak + transient + (64 << 10), (budget, traced, res.peak, transient)
        # the account is not an over-estimate either: tracemalloc sees at least the stored values
        assert traced >= res.peak - x.nbytes - (64 << 10)


def test_live_bytes_counts_views_once():
    a = np.zeros(1000)
    assert live_bytes(a, a[:10], (a.reshape(10, 100),)) == a.nbytes
    assert live_bytes([a, np.ones(5)], {"k": None}) == a.nbytes + 40


def test_live_bytes_counts_what_a_view_addresses():
    a = np.zeros((10, 100))
    assert live_bytes(a[2:4]) == 2 * 800                       # a slice: its rows only
    assert live_bytes(a[2:4], a[3:6]) == 4 * 800               # overlapping slices: the union
    assert live_bytes(a[:2], a[8:]) == 4 * 800                 # disjoint slices: both
    assert live_bytes(a[2:4], a) == a.nbytes                   # the whole buffer once
    assert live_bytes(a.T, a[::-1], a[:, ::-1]) == a.nbytes    # whole views, any strides
    assert live_bytes(a[1:3, 10:20]) == 800 + 10 * 8           # strided: first to last element
    assert live_bytes(a[5:5]) == 0


def test_account_of_a_micro_batch_view_equals_the_model():
    """A pipeline's micro-batch is a slice of the rank's batch: the account counts the slice,
    as the model's x[0] does, not the whole batch."""
    x, y = batch("gpt")
    chain = gpt()
    prof = profile.of_chain(chain, x[2:4].shape, need_dx=False)
    solver = rotor.Solver(prof, 300)
    for seq in (sequence.store_all(len(prof)), solver.solve(solver.least).sequence):
        res, sim = Executor(chain, seq, need_dx=False).run(x[2:4], y[2:4]), simulate(seq, prof)
        assert res.peak == sim.peak
        assert [live for _, live in res.trace[1:]] == sim.peaks      # op by op


def test_account_equals_the_plan_at_the_least_budget_under_tp_and_pp(tmp_path):
    """Under tp (with and without sequence parallelism) and pp, at the least budget the planner
    accepts, the measured account is the predicted peak on every rank."""
    out = run_mpi("remat_least_budget", 2, str(tmp_path), timeout=300)
    assert "remat_least_budget OK on 2 ranks" in out


def test_executor_rejects_bad_sequences():
    chain = mlp()
    with pytest.raises(ValueError, match="first backward must be B"):
        Executor(chain, [Op("F_all", block=0), Op("B", block=0)])
    with pytest.raises(ValueError, match="OffloadChannel"):
        Executor(chain, sequence.store_all(len(chain) + 1) + [Op("OFF", block=1, item="x")])

