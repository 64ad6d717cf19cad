"""The training loop end to end on bundled data: accuracy, determinism, the log, the CLI."""
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, name, *args):
    cfg = parse_overrides([f"--log={tmp_path / name}", "--progress=false", *args])
    return train(cfg)


def test_same_seed_gives_bit_identical_loss_curve(tmp_path):
    args = ("--model=gpt", "--dataset=sonnet", "--steps=12", "--batch_size=4", "--block_size=16",
            "--dim=16", "--n_heads=2", "--dropout=0.1", "--eval_interval=6")
    _run(tmp_path, "a.h5", *args)
    _run(tmp_path, "b.h5", *args)
    _run(tmp_path, "c.h5", *args, "--seed=1")
    a, b, c = (read_run(tmp_path / n).metrics for n in ("a.h5", "b.h5", "c.h5"))
    assert len(a["loss"]) == 12
    np.testing.assert_array_equal(a["loss"], b["loss"])          # bit-identical, dropout included
    np.testing.assert_array_equal(a["val_loss"], b["val_loss"])
    assert not np.array_equal(a["loss"], c["loss"])


def test_dropout_masks_follow_the_rows_not_the_micro_batches(tmp_path):
    """Gradient accumulation splits the batch; each sample keeps its serial-step mask."""
    args = ("--model=gpt", "--dataset=sonnet", "--steps=4", "--batch_size=6", "--block_size=8",
            "--dim=16", "--n_heads=2", "--dropout=0.2", "--dtype=float64", "--eval_interval=4")
    one = _run(tmp_path, "one.h5", *args)
    three = _run(tmp_path, "three.h5", *args, "--grad_accum=3")
    none = _run(tmp_path, "none.h5", *args[:-3], "--dropout=0.0", "--dtype=float64",
                "--eval_interval=4", "--grad_accum=3")
    for a, b, c in zip(one["model"].params, three["model"].params, none["model"].params):
        assert np.max(np.abs(a.data - b.data)) < 1e-12, a.name
    assert max(np.max(np.abs(a.data - c.data)) for a, c in
               zip(one["model"].params, none["model"].params)) > 1e-4   # dropout did act


def test_mlp_reaches_97_percent_on_digits(tmp_path):
    r = _run(tmp_path, "mlp.h5", "--model=mlp")
    assert r["test_acc"] >= 0.97, r
    run = read_run(tmp_path / "mlp.h5")
    assert run.attrs["status"] == "finished" and run.config["model"] == "mlp"
    assert len(run.metrics["step"]) == r["steps"]
    assert np.isfinite(run.metrics["test_acc"]).sum() == r["steps"] // 100 + (r["steps"] % 100 > 0)
    assert set(run.timeline["kind"]) == {"F", "B", "optimizer"}   # the schedule's op names


@pytest.mark.long     # ~5 s; the MLP's target above and the CNN's blocks' gradient checks stay
def test_cnn_reaches_97_percent_on_digits(tmp_path):
    r = _run(tmp_path, "cnn.h5", "--model=cnn")
    assert r["test_acc"] >= 0.97, r


def test_gpt_learns_below_unigram_entropy(tmp_path):
    r = _run(tmp_path, "gpt.h5", "--model=gpt", "--dataset=sonnet", "--steps=150",
             "--batch_size=16", "--block_size=32", "--dim=32", "--n_heads=2", "--eval_interval=0")
    assert r["loss"] < 0.7 * r["unigram_entropy"], r


def test_sgd_and_clipping_path(tmp_path):
    r = _run(tmp_path, "sgd.h5", "--model=mlp", "--optimizer=sgd", "--lr=0.05", "--clip=1.0",
             "--warmup=10", "--epochs=5", "--weight_decay=1e-4")
    assert r["test_acc"] > 0.9, r
    assert "grad_norm" in read_run(tmp_path / "sgd.h5").metrics


def _cli(*args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hpcnn", *args], capture_output=True, text=True,
                          env=env, timeout=120, **kw)


@pytest.mark.long     # ~5 s; make test runs hpcnn train, report and info from the documentation
# (tests/test_docs.py) and the report's figures in-process (tests/test_runlog.py)
def test_cli_train_report_info(tmp_path):
    log = tmp_path / "cli.h5"
    p = _cli("train", "--model=mlp", "--epochs=2", f"--log={log}", "--log_interval=5")
    assert p.returncode == 0, p.stderr
    assert "step" in p.stdout and "samples/s" in p.stdout and "ETA" in p.stdout
    assert "test_acc=" in p.stdout
    p = _cli("report", str(log), str(tmp_path / "cli.png"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "cli.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = _cli("info")
    assert p.returncode == 0 and "MPI library:" in p.stdout
    assert "BLAS" in p.stdout and "backend: cpu" in p.stdout
    assert "allreduce C fast path: " in p.stdout and "ptrace_scope" in p.stdout
    blas = [ln for ln in p.stdout.splitlines() if ln.startswith(("BLAS", "OpenMP"))]
    assert any(ln.startswith("BLAS in numpy: ") and " threads" in ln for ln in blas), blas
    assert not any("None" in ln for ln in blas), blas     # no unnamed library or version


def test_cli_rejects_bad_options(tmp_path):
    p = _cli("train", "--lrr=0.1", "--steps=x")
    assert p.returncode == 2
    assert "unknown option --lrr (did you mean --lr?)" in p.stderr and "--steps='x'" in p.stderr
    p = _cli("train", "--dp=2", "--steps=1")              # refused by the layout check in train()
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "world size (1) != dp*tp*pp (2*1*1 = 2)" in p.stderr, p.stderr
    p = _cli("train", "--steps=1", "--checkpoint=/dev/null/ck.h5",   # cannot be written: refused
             f"--log={tmp_path / 'ck.h5'}")                         # before step 0, not at the save
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "checkpoint='/dev/null/ck.h5' cannot be written: /dev/null is not a directory" \
        in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "ck.h5")                     # nothing ran, no log
    p = _cli("frobnicate")
    assert p.returncode == 2 and "unknown command" in p.stderr
    p = _cli("train", "--help")
    assert p.returncode == 0 and "--batch_size" in p.stdout


def test_run_header_names_the_layout_the_whole_model_and_a_resume():
    from types import SimpleNamespace

    from hpcnn.nn import models
    from hpcnn.engine.record import run_header, whole_model_params
    model = models.mlp(64, (32,), 10, seed=0)
    task = SimpleNamespace(data=SimpleNamespace(name="digits"), steps=40)
    cfg = parse_overrides(["--dp=2", "--pp=2", "--microbatches=4", "--schedule=gpipe",
                           "--resume=runs/a.h5", "--log=x.h5"]).resolved()
    line = run_header(cfg, model, task, world_size=4, start=30)
    assert f"({whole_model_params(model):,} parameters)" in line and "2,410 parameters" in line
    assert "dp=2 x tp=1 x pp=2 on 4 rank(s), gpipe with 4 micro-batches" in line, line
    assert "resumed from runs/a.h5 at step 30" in line, line
    serial = run_header(parse_overrides(["--log=x.h5"]).resolved(), model, task, world_size=1)
    assert "dp=1 x tp=1 x pp=1 on 1 rank(s)" in serial and "resumed" not in serial, serial


def test_a_diverging_loss_is_named_in_the_log_the_report_and_the_result_line(tmp_path):
    """AdamW at lr=10 on the MLP: the loss jumps past 100 x its first value at step 2 (finite:
    the run goes on); the log's /plan, ``report``'s summary and headline, the result line and
    one warning on stderr name it; --divergence=0 names nothing, the same run otherwise."""
    from hpcnn.log.report import headline, summary
    log = tmp_path / "div.h5"
    p = _cli("train", "--model=mlp", "--lr=10", "--steps=6", f"--log={log}", "--progress=false")
    assert p.returncode == 0, p.stderr
    note = read_run(str(log)).plan["divergence"]
    assert note.startswith("diverged at step 2: loss ") and "> 100 x the first step's" in note
    assert p.stdout.strip().endswith(", " + note), p.stdout
    assert p.stderr.count("warning: diverged at step 2") == 1, p.stderr
    assert f"warning  {note}" in summary(str(log))
    assert headline(str(log)).startswith(f"div.h5: {note}")
    # (a process of its own too: the same BLAS threads, OMP_NUM_THREADS=1, as the run above)
    quiet = _cli("train", "--model=mlp", "--lr=10", "--steps=6", "--divergence=0",
                 f"--log={tmp_path / 'quiet.h5'}", "--progress=false")
    assert quiet.returncode == 0 and "diverged" not in quiet.stdout + quiet.stderr
    assert "divergence" not in read_run(str(tmp_path / "quiet.h5")).plan
    loss = quiet.stdout.split("result: loss=")[1].split(",")[0]
    assert f"result: loss={loss}," in p.stdout             # the watch changes nothing else
