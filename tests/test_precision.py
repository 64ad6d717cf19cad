"""Mixed precision (--precision=bf16|fp16, hpcnn.nn.precision): the machinery exact in float64,
GradScaler's scale sequence, what fp16 loses without scaling, layer parity against float32,
memory, checkpoints across precisions, validation loss, refusals; dp = 2 under mpiexec."""
import os
from types import MappingProxyType

import numpy as np
import pytest

from hpcnn import backend
from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.nn import models, precision
from hpcnn.nn.chain import Chain
from hpcnn.nn.layers import GELU, Dropout, LayerNorm, Linear, ReLU
from hpcnn.nn.loss import SoftmaxCrossEntropy
from hpcnn.nn.transformer import CausalSelfAttention, Embedding, MLPBlock, TransformerBlock
from hpcnn.train import train
from hpcnn.parallel.data.bucketed import DataParallel
from cachecheck import spec_matches_cache
from mpi_util import run_mpi, single
from test_refusals import TINY_GPT, assert_refused, run_cli

SMALL_GPT = ["--model=gpt", "--dataset=sonnet", "--n_layers=1", "--dim=32", "--n_heads=4",
             "--block_size=16", "--batch_size=8", "--eval_batches=1"]
# relative tolerance against float32 (of the reference's largest entry), per storage format
TOL = {"bfloat16": 3e-2, "float16": 3e-3}


def run(tmp_path, name, *args):
    return train(parse_overrides([f"--log={tmp_path / name}.h5", "--progress=false",
                                  "--log_interval=1", *args]))


# -- the machinery, exact ----------------------------------------------------------------------
@pytest.mark.parametrize("model", [
    SMALL_GPT + ["--clip=0.5", "--grad_accum=2"],
    ["--model=mlp", "--hidden=16", "--batch_size=16", "--optimizer=sgd", "--lr=0.05",
     "--weight_decay=0.01"]])
def test_float64_twin_equals_the_plain_float64_run_bit_for_bit(tmp_path, monkeypatch, model):
    """Master copy, float64-gradient path, static loss scale 2**10 (no growth in 5 steps),
    unscaling and the skip check, run with float64 storage: the plain float64 run exactly."""
    args = [*model, "--steps=5", "--eval_interval=5"]
    plain = run(tmp_path, "plain", *args, "--dtype=float64")
    monkeypatch.setattr(precision, "FORMATS", MappingProxyType(
        {"fp32": None, "bf16": None, "fp16": precision.Format("float64", "float64", True)}))
    twin = run(tmp_path, "twin", *args, "--precision=fp16", "--loss_scale_init=1024",
               "--loss_scale_growth_interval=100")
    for p, q in zip(plain["model"].params, twin["model"].params):
        assert q.data.dtype == np.float64 and np.array_equal(p.data, q.data), p.name
    a, b = read_run(tmp_path / "plain.h5").metrics, read_run(tmp_path / "twin.h5").metrics
    assert np.array_equal(a["loss"], b["loss"])
    assert list(b["loss_scale"]) == [1024.0] * 5 and not b["skipped"].any()
    assert twin["skipped_steps"] == 0


# -- the loss scale ----------------------------------------------------------------------------
class Holder:
    state: dict = None


def test_planted_overflow_sequence_gives_gradscalers_scales_and_skips():
    """init 8, growth 2, backoff 0.5, interval 3; infs planted at steps 4, 7 and 8. The values
    below are worked out by hand from torch's _amp_update_scale_ (scale used at each step)."""
    h = Holder()
    h.state = {}
    s = precision.LossScaler(h, init=8.0, growth=2.0, backoff=0.5, interval=3)
    found = [False, False, False, False, True, False, False, True, True, False, False, False,
             False]
    used = []
    for f in found:
        used.append(s.scale)
        s.update(f)
    assert used == [8, 8, 8, 16, 16, 8, 8, 8, 4, 2, 2, 2, 4]
    assert s.skipped == 3 and s.scale == 4.0 and s.good_steps == 1
    assert h.state == {"loss_scale": 4.0, "loss_scale_good_steps": 1}


def test_fp16_run_skips_overflowing_steps_and_backs_off_without_raising(tmp_path):
    """A first scale of 2**40 overflows fp16: those steps are skipped (the non-finite check
    does not fire), the scale halves each time until steps pass, then grows every 2 good
    steps; the log has the scale and the skips, the result counts them."""
    r = run(tmp_path, "f16", *SMALL_GPT, "--steps=40", "--eval_interval=0", "--precision=fp16",
            "--loss_scale_init=1099511627776", "--loss_scale_growth_interval=2")
    m = read_run(tmp_path / "f16.h5").metrics
    scale, skipped = m["loss_scale"], m["skipped"].astype(bool)
    assert skipped[0] and not skipped[-1] and r["skipped_steps"] == int(skipped.sum()) >= 1
    good = 0
    for t in range(len(scale) - 1):          # GradScaler's rule, step by step, growth 2
        good = 0 if skipped[t] else good + 1
        want = scale[t] * (0.5 if skipped[t] else 2.0 if good == 2 else 1.0)
        good %= 2
        assert scale[t + 1] == want, (t, scale[t], scale[t + 1])
    assert np.isfinite(r["loss"]) and all(np.isfinite(q.data).all() for q in r["model"].params)


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])
def test_the_non_finite_check_fires_unless_the_scaler_takes_it(dt):
    """The data-parallel engine's check raises on a NaN gradient (fp32, bf16); with
    numerics(check_finite=False), what precision.attach sets for fp16, it leaves it to the
    scaler, whose check finds it."""
    model = models.mlp(12, (8,), 3, dtype=dt)
    dp = DataParallel(model, single())
    x = np.ones((3, 12), dtype=dt)
    x[1, 2] = np.nan
    for check in (True, False):
        dp.numerics(check_finite=check)
        dp.zero_grad()
        dp.backward(1.0, model.forward(x, np.zeros(3, dtype=int))[1])
        if check:
            with pytest.raises(FloatingPointError, match="non-finite gradient at step 0"):
                dp.finish(0)
        else:
            dp.finish(0)
            assert precision.found_non_finite(model.params)
    model.zero_grad()
    assert model.params[0].grad.dtype == np.float32 or dt == "float64"
    assert not precision.found_non_finite(model.params)


def test_fp16_loses_small_gradients_without_the_scale():
    """A loss gradient of 1e-8 through two fp16 Linears: the activation gradient between them
    flushes to zero in fp16 (smallest subnormal 6e-8), so the first layer learns nothing;
    scaled by 2**16 and unscaled after, it matches float32 to fp16's precision."""
    x = np.random.default_rng(0).standard_normal((8, 16))
    grads = {}
    for dt, scale in (("float32", 1.0), ("float16", 1.0), ("float16", 2.0 ** 16)):
        chain = Chain([Linear(16, 16, seed=1, index=0, dtype=dt),
                       Linear(16, 4, seed=1, index=1, dtype=dt)])
        y, caches = chain.forward_blocks(x.astype(dt))
        chain.zero_grad()
        chain.backward_blocks(np.full(y.shape, 1e-8 * scale, dtype=dt), caches)
        grads[dt, scale] = chain.blocks[0].weight.grad / scale
    ref = grads["float32", 1.0]
    assert np.abs(ref).max() > 1e-9
    assert not grads["float16", 1.0].any()                         # all lost
    lost = np.abs(grads["float16", 2.0 ** 16] - ref).max() / np.abs(ref).max()
    assert lost < 3e-3, lost


# -- layer parity ------------------------------------------------------------------------------
def _twins(make, dt):
    """(the float32 block, the 16-bit block) with the same, 16-bit-representable weights."""
    a, b = make("float32"), make(dt)
    for p, q in zip(a.params, b.params):
        p.data[...] = q.data.astype(np.float32)
    return a, b


BLOCKS = {
    "linear": (lambda dt: Linear(32, 24, seed=3, dtype=dt), (4, 8, 32)),
    "layernorm": (lambda dt: LayerNorm(32, dtype=dt), (4, 8, 32)),
    "attention": (lambda dt: CausalSelfAttention(32, 4, seed=3, dtype=dt), (4, 8, 32)),
    "gpt-block": (lambda dt: TransformerBlock(32, 4, seed=3, dtype=dt), (4, 8, 32)),
}


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_16_bit_blocks_match_float32(name, dt):
    """Forward and backward of each block in 16-bit storage against float32 on the same
    (rounded) weights and inputs: outputs and caches stored in 16 bits, parameter gradients
    float32, all within TOL of the reference's largest entry."""
    make, shape = BLOCKS[name]
    ref, blk = _twins(make, backend.dtype_of(dt))
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(backend.dtype_of(dt))
    dy = rng.standard_normal(shape[:-1] + (ref.spec(shape).out_shape[-1],)).astype(x.dtype)
    y32, c32 = ref.forward(x.astype(np.float32))
    y16, c16 = blk.forward(x)
    assert y16.dtype == x.dtype
    dx32, dx16 = ref.backward(dy.astype(np.float32), c32), blk.backward(dy, c16)
    assert dx16.dtype == x.dtype
    pairs = [("y", y32, y16), ("dx", dx32, dx16)]
    pairs += [(p.name, p.grad, q.grad) for p, q in zip(ref.params, blk.params)]
    for what, a, b in pairs:
        if what not in ("y", "dx"):
            assert b.dtype == np.float32, what
        err = np.abs(a - b.astype(np.float32)).max() / np.abs(a).max()
        assert err < TOL[dt], (name, dt, what, err)


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_spec_counts_16_bit_caches_exactly(dt):
    """The block contract's check (tests/cachecheck.py) on the blocks of the GPT and the MLP
    stored in 16 bits: spec() counts what the real caches hold (16-bit activations,
    LayerNorm's float32 1/std, the loss's 16-bit probabilities)."""
    rng = np.random.default_rng(0)
    seq = rng.standard_normal((2, 8, 16)).astype(backend.dtype_of(dt))
    kw = dict(dtype=dt)
    blocks = [Linear(16, 8, **kw), ReLU(**kw), GELU(**kw), LayerNorm(16, **kw),
              Dropout(0.3, **kw), CausalSelfAttention(16, 4, dropout=0.1, **kw),
              MLPBlock(16, dropout=0.1, **kw), TransformerBlock(16, 4, dropout=0.1, **kw)]
    for block in blocks:
        spec_matches_cache(block, seq)
    spec_matches_cache(Embedding(20, 16, 8, **kw), rng.integers(0, 20, (2, 8)))
    spec_matches_cache(SoftmaxCrossEntropy(), seq, rng.integers(0, 16, (2, 8)))


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_16_bit_gpt_loss_and_gradients_match_float32(dt):
    V, rng = 40, np.random.default_rng(0)
    ref, m = _twins(lambda d: models.gpt(V, 16, 2, 32, 4, seed=1, dtype=d), backend.dtype_of(dt))
    x, y = rng.integers(0, V, (4, 16)), rng.integers(0, V, (4, 16))
    (l32, c32), (l16, c16) = ref.forward(x, y), m.forward(x, y)
    assert abs(l32 - l16) < TOL[dt] * abs(l32)
    ref.zero_grad(), m.zero_grad()
    ref.backward(1.0, c32), m.backward(1.0, c16)
    for p, q in zip(ref.params, m.params):
        err = np.abs(p.grad - q.grad).max() / np.abs(p.grad).max()
        assert err < TOL[dt], (p.name, err)


# -- memory ------------------------------------------------------------------------------------
def test_parameters_plus_activations_about_halve(tmp_path):
    """The account a run logs (16-bit parameter bytes, the peak of the blocks' caches from
    spec(), which tests/test_block_contract.py ties to the real caches) against fp32."""
    held = {}
    for p in ("fp32", "bf16", "fp16"):
        run(tmp_path, p, *SMALL_GPT, "--steps=1", "--eval_interval=0", f"--precision={p}")
        plan = read_run(tmp_path / f"{p}.h5").plan
        held[p] = plan["param_bytes_per_rank"][0] + plan["peak_activation_bytes_per_rank"][0]
    for p in ("bf16", "fp16"):
        assert 0.45 < held[p] / held["fp32"] < 0.55, (p, held)
    m32 = models.gpt(65, 64, 2, 128, 4, dtype="float32")
    m16 = models.gpt(65, 64, 2, 128, 4, dtype="bfloat16")
    s32, s16 = m32.spec((64, 64)), m16.spec((64, 64))
    ratio = (sum(s.bytes_params + s.bytes_cache for s in s16)
             / sum(s.bytes_params + s.bytes_cache for s in s32))
    assert 0.45 < ratio < 0.55, ratio


# -- checkpoints ---------------------------------------------------------------------------------
def test_checkpoints_hold_the_master_copy_and_move_between_precisions(tmp_path):
    """Saved at bf16 after 3 of 6 steps: the file holds float32 masters; resumed at bf16 it
    continues bit for bit as the uninterrupted run (the 16-bit copy is the rounded master);
    resumed at fp32 it continues within bf16's tolerance (and fp32 -> bf16 likewise)."""
    args = [*SMALL_GPT, "--steps=6", "--eval_interval=0"]
    whole = run(tmp_path, "whole", *args, "--precision=bf16")
    ck = str(tmp_path / "bf16-{step}.h5")
    run(tmp_path, "first", *args, "--precision=bf16", "--steps=6", f"--checkpoint={ck}",
        "--checkpoint_every=3")
    import h5py
    with h5py.File(ck.replace("{step}", "3")) as f:
        assert all(f["params"][k].dtype == np.float32 for k in f["params"])
    again = run(tmp_path, "again", *args, "--precision=bf16", f"--resume={ck.replace('{step}', '3')}")
    for p, q in zip(whole["model"].params, again["model"].params):
        assert np.array_equal(p.data.view(np.uint16), q.data.view(np.uint16)), p.name
    for frm, to in (("bf16", "fp32"), ("fp32", "bf16")):
        src = str(tmp_path / f"from-{frm}-{{step}}.h5")
        run(tmp_path, f"src-{frm}", *args, f"--precision={frm}", f"--checkpoint={src}",
            "--checkpoint_every=3")
        run(tmp_path, f"to-{to}", *args, f"--precision={to}",
            f"--resume={src.replace('{step}', '3')}")
        a = read_run(tmp_path / f"src-{frm}.h5").metrics["loss"][3:]
        b = read_run(tmp_path / f"to-{to}.h5").metrics["loss"]
        assert len(b) == 3 and np.abs(a - b).max() < 0.02 * a.max(), (frm, to, a, b)


def test_fp16_resume_restores_the_loss_scale(tmp_path):
    args = [*SMALL_GPT, "--steps=6", "--eval_interval=0", "--precision=fp16",
            "--loss_scale_init=1099511627776", "--loss_scale_growth_interval=2"]
    run(tmp_path, "whole", *args)
    ck = str(tmp_path / "ck-{step}.h5")
    run(tmp_path, "first", *args, f"--checkpoint={ck}", "--checkpoint_every=3")
    run(tmp_path, "again", *args, f"--resume={ck.replace('{step}', '3')}")
    a, b = read_run(tmp_path / "whole.h5").metrics, read_run(tmp_path / "again.h5").metrics
    assert list(a["loss_scale"][3:]) == list(b["loss_scale"]) and list(a["skipped"][3:]) == \
        list(b["skipped"])
    assert np.array_equal(a["loss"][3:], b["loss"])


# -- validation loss ---------------------------------------------------------------------------
@pytest.mark.long
def test_bf16_and_fp16_end_within_005_nats_of_fp32(tmp_path):
    """A one-layer GPT (width 64) on the bundled Shakespeare, 100 steps of 16 x 32 tokens
    (about 25 s: fp16's casts are NumPy's slow ones)."""
    val = {}
    for p in ("fp32", "bf16", "fp16"):
        val[p] = run(tmp_path, p, "--model=gpt", "--n_layers=1", "--dim=64", "--batch_size=16",
                     "--block_size=32", "--steps=100", "--eval_interval=0", "--eval_batches=8",
                     f"--precision={p}")["val_loss"]
    assert abs(val["bf16"] - val["fp32"]) < 0.05 and abs(val["fp16"] - val["fp32"]) < 0.05, val


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args, names", [
    (["--precision=bf16", "--dtype=float64"], ["precision='bf16'", "dtype='float64'"]),
    (["--precision=fp16", "--zero=2", "--dp=2", "--grad_reduce_dtype=param"],
     ["precision='fp16'", "zero=2", "grad_reduce_dtype='param'"]),
    (["--precision=bf16", "--model=cnn"], ["model='cnn'", "gpt", "mlp"]),
    (["--precision=fp8"], ["precision", "fp8"]),
    (["--grad_reduce_dtype=param"], ["grad_reduce_dtype='param'", "precision='fp32'"]),
    (["--precision=fp16", "--loss_scale_backoff=1"], ["loss_scale_backoff"]),
])
def test_refusals(args, names, tmp_path):
    code, _, err = run_cli([*TINY_GPT, *args], tmp_path)
    assert_refused(code, err, *names)


# -- many ranks --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long),
                               pytest.param(3, marks=pytest.mark.long)])
def test_data_parallel_16_bit_equals_serial_and_shards_at_every_zero_stage_mpi(tmp_path, n):
    """tests/mpi/train_precision.py: dp against serial at bf16 and fp16; zero 1, 2, 3 against
    zero 0 at 16 bits, their account, the sharded master copy's float64 twin; resumes across
    stages, precisions and dp (2 ranks: to and from the serial run; in make test-long, 4 ranks:
    zero 3, dp 4, bf16 <-> zero 0, dp 2, fp32, and 3 ranks: uneven parts)."""
    out = run_mpi("train_precision", n, str(tmp_path), timeout=240)
    assert f"train_precision OK on {n} ranks" in out
