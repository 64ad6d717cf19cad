"""Half transformer layers: finite differences, and a split GPT equal to the unsplit one."""
import numpy as np
import pytest

from gradcheck import check_block_gradients
from hpcnn.memory import profile, rotor
from hpcnn.nn import models
from hpcnn.nn.residual import ResidualHalf, halves, split_layers
from hpcnn.nn.transformer import TransformerBlock

F64 = np.float64


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_half_gradients(dropout):
    x = np.random.default_rng(1).standard_normal((2, 5, 8))
    for half in halves(TransformerBlock(8, 2, dropout=dropout, seed=3, dtype=F64)):
        assert isinstance(half, ResidualHalf)
        check_block_gradients(half, x)


def gpt(**kw):
    return models.gpt(24, block_size=12, n_layers=3, dim=16, n_heads=4, seed=7, dtype=F64, **kw)


def test_split_gpt_equals_gpt():
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 24, (4, 12))
    tgt = np.roll(tok, -1, axis=1)
    a, b = gpt(dropout=0.2), split_layers(gpt(dropout=0.2))
    assert len(b) == len(a) + 3
    assert [p.name for p in a.params] == [p.name for p in b.params]
    for step in range(2):                         # dropout counters advance alike
        for m in (a, b):
            m.zero_grad()
        la, ca = a.forward(tok, tgt)
        lb, cb = b.forward(tok, tgt)
        a.backward(1.0, ca)
        b.backward(1.0, cb)
        assert la == lb, step
        for p, q in zip(a.params, b.params):
            np.testing.assert_array_equal(p.grad, q.grad, err_msg=p.name)
    assert a.rng_state()[1] == tuple(s for h in b.blocks[1:3] for s in h.rng_state()[1:])
    sa, sb = a.spec(tok.shape), b.spec(tok.shape)
    assert sum(s.flops_fwd for s in sa) == sum(s.flops_fwd for s in sb)


def test_halves_lower_the_least_remat_budget():
    chain = models.gpt(65, block_size=64, n_layers=4, dim=128, n_heads=4)
    whole = rotor.Solver(profile.of_chain(chain, (16, 64), need_dx=False), 200)
    split = rotor.Solver(profile.of_chain(split_layers(chain), (16, 64), need_dx=False), 200)
    # store-all also holds each layer's middle of the residual stream, x + attn(...)
    assert split.top - whole.top == 4 * 16 * 64 * 128 * 4
    assert split.least < 0.75 * whole.least


def test_training_with_half_layers_equals_whole_layers(tmp_path):
    from hpcnn.config import parse_overrides
    from hpcnn.train import train
    args = ["--model=gpt", "--dataset=sonnet", "--steps=3", "--batch_size=4", "--block_size=16",
            "--dim=16", "--n_heads=2", "--n_layers=2", "--dropout=0.1", "--dtype=float64",
            "--progress=false", "--eval_interval=3"]
    a = train(parse_overrides([f"--log={tmp_path / 'a.h5'}", *args]))
    b = train(parse_overrides([f"--log={tmp_path / 'b.h5'}", *args, "--half_layers=true",
                               "--remat=sqrt"]))
    assert len(b["model"]) == len(a["model"]) + 2
    for p, q in zip(a["model"].params, b["model"].params):
        np.testing.assert_allclose(q.data, p.data, rtol=0, atol=1e-12, err_msg=p.name)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-12)
