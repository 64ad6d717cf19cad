"""Checkpoints: a resumed run continues bit for bit; bad checkpoints are refused with the reason."""
import contextlib
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
              "a checkpoint of another model: --dim=16 in the checkpoint, 32 here"),
             ([f"--resume={ck}", "--pad_vocab=3"],
              r"padded to a multiple of 1, here of 3: give both runs the same --pad_vocab"),
             ([f"--resume={ck}", "--n_layers=3"], "--n_layers=2 in the checkpoint, 3 here"),
             ([f"--resume={ck}", "--steps=2"], "at step 2, nothing is left")]
    for extra, match in cases:
        with pytest.raises(ConfigError, match=match):
            _run(tmp_path, "b.h5", *GPT, *extra)
    (tmp_path / "plain").write_text("a file, not a directory")
    with pytest.raises(ConfigError, match="plain/ck.h5' cannot be written: .*plain is not a d"):
        _run(tmp_path, "c.h5", *GPT, "--steps=1", f"--checkpoint={tmp_path / 'plain' / 'ck.h5'}")
    with pytest.raises(ConfigError, match="needs --checkpoint"):
        parse_overrides(["--checkpoint_every=5"]).resolved()
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]         # no half-written file


def test_checkpoint_moves_between_layouts_under_mpi(tmp_path):
    from mpi_util import run_mpi
    assert "train_checkpoint OK on 4 ranks" in run_mpi("train_checkpoint", 4, str(tmp_path),
                                                       timeout=300)


# -- damaged files, other models, failed writes ----------------------------------------------

def _flip(path, dataset: str, byte: int, mask: int) -> None:
    """XOR ``mask`` into byte ``byte`` of ``dataset``'s stored array, in place in the file."""
    with h5py.File(path, "r") as f:
        at = f[dataset].id.get_offset() + byte
    with open(path, "r+b") as fh:
        fh.seek(at)
        old = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([old ^ mask]))


def test_damaged_checkpoints_are_refused_naming_the_dataset(tmp_path):
    ck = str(tmp_path / "ck.h5")
    _run(tmp_path, "a.h5", *GPT, "--steps=2", f"--checkpoint={ck}")
    good = open(ck, "rb").read()
    cases = [("/params/h0.attn.qkv.weight", 0, 0x01),   # lowest mantissa byte of one float64
             ("/optim/embed.wte/v", 7, 0x40),             # the top exponent bit of an Adam slot
             ("/params/lm_head.weight", 8 * 5 + 3, 0x10)]
    for dataset, byte, mask in cases:
        open(ck, "wb").write(good)
        _flip(ck, dataset, byte, mask)
        with pytest.raises(ConfigError, match=f"dataset {dataset} is corrupt: its CRC-32 is "):
            _run(tmp_path, "b.h5", *GPT, f"--resume={ck}")
    for size in (len(good) // 2, 100, 0):                 # truncated: one line, no traceback
        open(ck, "wb").write(good[:size])
        with pytest.raises(ConfigError, match="cannot read the checkpoint: ") as e:
            _run(tmp_path, "b.h5", *GPT, f"--resume={ck}")
        assert "\n" not in str(e.value), str(e.value)
    open(ck, "wb").write(good)                            # undamaged again: resumes
    assert _run(tmp_path, "b.h5", *GPT, f"--resume={ck}")["steps"] == 6


# one other value of each model-defining option (with the GPT (or MLP, CNN) of GPT below)
OTHER_VALUE = {"model": None, "dataset": ["--dataset=shakespeare", "--max_plays=1"],
               "dtype": ["--dtype=float32"], "n_layers": ["--n_layers=1"],
               "dim": ["--dim=8", "--n_heads=2"], "n_heads": ["--n_heads=4"],
               "block_size": ["--block_size=16"], "hidden": ["--hidden=8,4"],
               "channels": ["--channels=4,4"]}
SMALL = {"mlp": ["--model=mlp", "--hidden=8,8", "--batch_size=16", "--dtype=float64",
                 "--progress=false"],
         "cnn": ["--model=cnn", "--channels=4,8", "--batch_size=16", "--dtype=float64",
                 "--progress=false"],
         "gpt": GPT}


def test_each_model_defining_option_is_compared(tmp_path):
    listed = set(checkpoint.COMMON_OPTIONS).union(*checkpoint.MODEL_OPTIONS.values())
    assert listed == set(OTHER_VALUE), "a test case for every compared option"
    for model, base in SMALL.items():
        ck = str(tmp_path / f"{model}.h5")
        _run(tmp_path, "a.h5", *base, "--steps=1", f"--checkpoint={ck}")
        for option in checkpoint.COMMON_OPTIONS + checkpoint.MODEL_OPTIONS[model]:
            if option == "dataset" and model != "gpt":    # the digits are the images' only set
                continue
            other = OTHER_VALUE[option] if option != "model" else {
                "mlp": ["--model=cnn"], "cnn": ["--model=mlp"],
                "gpt": ["--model=mlp", "--dataset=digits"]}[model]
            with pytest.raises(ConfigError, match=f"another model: --{option}="):
                _run(tmp_path, "b.h5", *base, "--steps=3", *other, f"--resume={ck}")
    # a file without the option in its config (older hpcnn): the parameters' names decide
    ck = str(tmp_path / "gpt.h5")
    with h5py.File(ck, "r+") as f:
        import json
        saved = json.loads(f.attrs["config"])
        del saved["n_layers"]
        f.attrs["config"] = json.dumps(saved)
    with pytest.raises(ConfigError, match="parameter h2.ln1.weight is not in"):
        _run(tmp_path, "b.h5", *GPT, "--n_layers=3", f"--resume={ck}")
    with pytest.raises(ConfigError, match="has parameters this model has not: h1"):
        _run(tmp_path, "b.h5", *GPT, "--n_layers=1", f"--resume={ck}")


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    """Fault injection: os.write, fsync, close or replace fail with ENOSPC at random points of
    30 saves (written in 4 KB pieces, some writes short); each raises CheckpointError, leaves
    no temporary file, and the previous checkpoint stays byte for byte and restores exactly."""
    import errno
    import random
    from hpcnn.nn.optim import make_optimizer
    from hpcnn.task import build_task
    ck = str(tmp_path / "ck.h5")
    _run(tmp_path, "a.h5", *GPT, "--steps=2", f"--checkpoint={ck}")
    good = open(ck, "rb").read()
    cfg = parse_overrides([f"--log={tmp_path / 'x.h5'}", *GPT]).resolved()

    def restored():
        task = build_task(cfg)
        opt = make_optimizer(cfg.optimizer, task.model.params)
        assert checkpoint.restore(ck, cfg, task.model, task.model.params, opt, steps=6) == 2
        return task.model.params, opt

    ref_params, ref_opt = restored()
    real = {n: getattr(os, n) for n in ("write", "fsync", "close", "replace")}
    rng = random.Random(0)
    monkeypatch.setattr(checkpoint, "WRITE_CHUNK", 4096)
    pieces = len(good) // 4096
    for trial in range(30):
        where = rng.choice(["write"] * 3 + ["fsync", "close", "replace"])
        fail_at = rng.randrange(pieces) if where == "write" else 0
        calls = {"n": 0}

        def faulty(*args, _name=where, _at=fail_at):
            if _name == "write":
                calls["n"] += 1
                if calls["n"] > _at:
                    raise OSError(errno.ENOSPC, "No space left on device")
                fd, data = args                           # and now and then a short write
                return real["write"](fd, data[:rng.randrange(1, len(data) + 1)])
            if _name == "close":                          # NFS: closed, and then the error
                real["close"](*args)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint.os, where, faulty)
        with pytest.raises(checkpoint.CheckpointError,
                           match="No space left on device writing .*tmp.*previous checkpoint"):
            checkpoint.save(ck, 4, cfg, ref_params, ref_opt)
        monkeypatch.setattr(checkpoint.os, where, real[where])
        assert open(ck, "rb").read() == good, (trial, where, fail_at)
        assert not [n for n in os.listdir(tmp_path) if ".tmp" in n], (trial, where)
        open(ck, "wb").write(good)
    params, opt = restored()
    for a, b in zip(ref_params, params):
        np.testing.assert_array_equal(a.data, b.data)
    for k, v in ref_opt.state.items():
        np.testing.assert_array_equal(v, opt.state[k])


def test_an_interrupt_gives_up_a_save_at_any_point(tmp_path, monkeypatch):
    """``save``'s ``abandon`` saying True at its k-th question (between arrays, then between
    4 KB chunks written): the save returns False, no temporary file is left and the previous
    checkpoint is byte for byte the same; never asked True, the save returns True."""
    from hpcnn.nn.optim import make_optimizer
    from hpcnn.task import build_task
    ck = str(tmp_path / "ck.h5")
    _run(tmp_path, "a.h5", *GPT, "--steps=2", f"--checkpoint={ck}")
    good = open(ck, "rb").read()
    cfg = parse_overrides([f"--log={tmp_path / 'x.h5'}", *GPT]).resolved()
    task = build_task(cfg)
    opt = make_optimizer(cfg.optimizer, task.model.params)
    monkeypatch.setattr(checkpoint, "WRITE_CHUNK", 4096)
    asked = {"n": 0}

    def count():
        asked["n"] += 1
        return False
    assert checkpoint.save(str(tmp_path / "whole.h5"), 2, cfg, task.model.params, opt,
                           abandon=count) is True
    chunks = os.path.getsize(tmp_path / "whole.h5") // 4096
    assert asked["n"] > chunks > 10                  # asked between arrays and chunks
    for k in range(1, asked["n"] + 1, max(1, asked["n"] // 12)):
        asked["n"] = 0

        def at_k(k=k):
            asked["n"] += 1
            return asked["n"] >= k
        assert checkpoint.save(ck, 4, cfg, task.model.params, opt, abandon=at_k) is False, k
        assert open(ck, "rb").read() == good, k
        assert not [n for n in os.listdir(tmp_path) if ".tmp" in n], k


def _cli_mpi(n, *args):
    """``mpiexec -n n python -m mpi4py -m hpcnn train ARGS``: the completed process."""
    import subprocess
    import sys
    from mpi_util import ROOT, mpiexec
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcnn",
                           "train", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


def test_a_damaged_checkpoint_stops_every_rank_with_one_line(tmp_path):
    """pp=2: only rank 1 reads lm_head.weight, finds it corrupt, and both ranks stop, exit 2."""
    ck = str(tmp_path / "ck.h5")
    _run(tmp_path, "a.h5", *GPT, "--steps=2", f"--checkpoint={ck}")
    _flip(ck, "/params/lm_head.weight", 3, 0x08)
    p = _cli_mpi(2, *GPT, "--pp=2", f"--resume={ck}", f"--log={tmp_path / 'b.h5'}")
    assert p.returncode == 2, p.stderr
    with h5py.File(ck, "r") as f:
        ds = f["params/lm_head.weight"]
        got, want = checkpoint.checksum(ds[...]), int(ds.attrs["crc32"])
    assert p.stderr.splitlines() == [f"hpcnn train: --resume={ck}: dataset /params/lm_head.weight "
                                     f"is corrupt: its CRC-32 is {got:08x}, the checkpoint "
                                     f"recorded {want:08x} (on rank(s) [1] of 2)"], p.stderr


@contextlib.contextmanager
def tmpfs(folder, options: str):
    """A tmpfs mounted at ``folder`` (made here) with ``options`` while the block runs; the test
    is skipped where it cannot be mounted (it needs root)."""
    import subprocess
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_stops_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    """A real full file system (a 600 KB tmpfs, mounted when this runs as root): the second save
    of a ~330 KB checkpoint does not fit beside the first. Every rank stops with exit 2 and one
    line, no temporary file is left, the first checkpoint is whole and the log says why."""
    from hpcnn.log import read_run
    with tmpfs(tmp_path / "disk", "size=600k") as disk:
        log = tmp_path / "run.h5"
        p = _cli_mpi(2, "--dp=2", "--allreduce=mpi", "--hidden=128,128", "--steps=3",
                     "--checkpoint_every=1", "--eval_interval=0",
                     f"--checkpoint={disk / 'ck.h5'}", f"--log={log}", "--progress=false")
        assert p.returncode == 2, p.stderr
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and "No space left on device writing" in lines[0], p.stderr
        assert lines[0].endswith("(the previous checkpoint is unchanged)"), lines
        assert os.listdir(disk) == ["ck.h5"]
        assert checkpoint.summary(str(disk / "ck.h5"))["step"] == 1
        run = read_run(log)
        assert run.attrs["status"] == "failed" and "No space left" in run.plan["failure"]
        cfg = parse_overrides(["--hidden=128,128", "--steps=3"]).resolved()   # restores whole
        from hpcnn.nn.optim import make_optimizer
        from hpcnn.task import build_task
        task = build_task(cfg)
        opt = make_optimizer(cfg.optimizer, task.model.params)
        assert checkpoint.restore(str(disk / "ck.h5"), cfg, task.model, task.model.params, opt,
                                  steps=3) == 1


def test_format_1_is_resumed_unverified_with_a_note(tmp_path, capsys):
    """A file from before checksums (format 1) resumes exactly, with a note; a format 2 file
    whose array lost its checksum is refused."""
    ck = str(tmp_path / "ck.h5")
    whole = _run(tmp_path, "a.h5", *GPT, f"--checkpoint={tmp_path / 'ck-{step}.h5'}",
                 "--checkpoint_every=2")
    import shutil
    shutil.copy(tmp_path / "ck-2.h5", ck)
    with h5py.File(ck, "r+") as f:
        f.attrs["format"] = 1
        def strip(name, obj):                             # (a value returned stops the visit)
            if "crc32" in obj.attrs:
                del obj.attrs["crc32"]
        f.visititems(strip)
        assert not [n for n in f["params"] if "crc32" in f["params"][n].attrs]
    rest = _run(tmp_path, "b.h5", *GPT, f"--resume={ck}")
    assert "format 1 checkpoint, without checksums" in capsys.readouterr().err
    for a, b in zip(whole["model"].params, rest["model"].params):
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)
    with h5py.File(ck, "r+") as f:
        f.attrs["format"] = 2
    with pytest.raises(ConfigError, match="dataset /(params|optim)/.* has no checksum"):
        _run(tmp_path, "b.h5", *GPT, f"--resume={ck}")
