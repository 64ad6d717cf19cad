"""Checkpoints: a resumed run continues bit for bit; bad checkpoints are refused with the reason."""
import os

import h5py
import numpy as np
import pytest

from hpcnn.config import ConfigError, parse_overrides
from hpcnn import checkpoint
from hpcnn.log import read_run
from hpcnn.train import train

GPT = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=6", "--dropout=0.1", "--dtype=float64", "--steps=6", "--eval_interval=3",
       "--clip=1.0", "--warmup=2", "--progress=false"]


def _run(tmp_path, name, *args):
    return train(parse_overrides([f"--log={tmp_path / name}", *args]))


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, opt):
    ck = str(tmp_path / "ck-{step}.h5")
    whole = _run(tmp_path, "whole.h5", *GPT, f"--optimizer={opt}", f"--checkpoint={ck}",
                 "--checkpoint_every=2")
    assert sorted(os.listdir(tmp_path)) == sorted(["whole.h5", "ck-2.h5", "ck-4.h5", "ck-6.h5"])
    info = checkpoint.summary(str(tmp_path / "ck-2.h5"))
    assert info["step"] == 2 and info["optimizer"] == opt and info["layout"] == "1,1,1"
    rest = _run(tmp_path, "rest.h5", *GPT, f"--optimizer={opt}",
                f"--resume={tmp_path / 'ck-2.h5'}")
    for a, b in zip(whole["model"].params, rest["model"].params):
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)      # bit for bit
    w, r = read_run(tmp_path / "whole.h5"), read_run(tmp_path / "rest.h5")
    np.testing.assert_array_equal(r.metrics["step"], [2, 3, 4, 5])
    np.testing.assert_array_equal(w.metrics["loss"][2:], r.metrics["loss"])
    assert r.plan["start_step"] == 2 and r.plan["resumed_from"].endswith("ck-2.h5")
    with h5py.File(tmp_path / "ck-6.h5", "r") as f:   # the final state, as trained
        for p in whole["model"].params:
            np.testing.assert_array_equal(f["params"][p.name][...], p.data)
        slots = {"adamw": {"m", "v"}, "sgd": {"momentum"}}[opt]
        assert all(set(f["optim"][p.name]) == slots for p in whole["model"].params)
        assert f["optim"].attrs["step"] == 6


def test_resume_and_checkpoint_to_the_same_file(tmp_path):
    """The job-script pattern: a slice resumes from the file it then keeps overwriting."""
    import shutil
    whole = _run(tmp_path, "whole.h5", *GPT, f"--checkpoint={tmp_path / 'ck-{step}.h5'}",
                 "--checkpoint_every=2")
    ck = str(tmp_path / "run.ckpt.h5")
    shutil.copy(tmp_path / "ck-2.h5", ck)         # where an earlier slice stopped
    rest = _run(tmp_path, "rest.h5", *GPT, f"--resume={ck}", f"--checkpoint={ck}",
                "--checkpoint_every=2")
    assert checkpoint.summary(ck)["step"] == 6
    for a, b in zip(whole["model"].params, rest["model"].params):
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]


def test_bad_checkpoints_are_refused(tmp_path):
    ck = str(tmp_path / "ck.h5")
    _run(tmp_path, "a.h5", *GPT, "--steps=2", f"--checkpoint={ck}")
    cases = [([f"--resume={tmp_path / 'none.h5'}"], "no such checkpoint file"),
             ([f"--resume={ck}", "--optimizer=sgd"], "saved with optimizer 'adamw'"),
             ([f"--resume={ck}", "--dim=32"],
              r"parameter embed.wte is \(\d+, 16\) in the checkpoint, \(\d+, 32\) here"),
             ([f"--resume={ck}", "--pad_vocab=3"],
              r"padded to a multiple of 1, here of 3: give both runs the same --pad_vocab"),
             ([f"--resume={ck}", "--n_layers=3"], "parameter h2.ln1.weight is not in"),
             ([f"--resume={ck}", "--n_layers=1"], "has parameters this model has not: h1"),
             ([f"--resume={ck}", "--steps=2"], "at step 2, nothing is left")]
    for extra, match in cases:
        with pytest.raises(ConfigError, match=match):
            _run(tmp_path, "b.h5", *GPT, *extra)
    (tmp_path / "plain").write_text("a file, not a directory")
    with pytest.raises(OSError, match="checkpoint .*plain/ck.h5"):   # cannot write: says where
        _run(tmp_path, "c.h5", *GPT, "--steps=1", f"--checkpoint={tmp_path / 'plain' / 'ck.h5'}")
    with pytest.raises(ConfigError, match="needs --checkpoint"):
        parse_overrides(["--checkpoint_every=5"]).resolved()
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]         # no half-written file


def test_checkpoint_moves_between_layouts_under_mpi(tmp_path):
    from mpi_util import run_mpi
    assert "train_checkpoint OK on 4 ranks" in run_mpi("train_checkpoint", 4, str(tmp_path),
                                                       timeout=300)
