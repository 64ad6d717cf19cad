"""``hpcnn report`` on bad input: one line naming the path and what is wrong, exit 2, before any
work (a missing file, a directory, a text file, a truncated log, an output it cannot write); a
checkpoint described as one; the headline of a run that did not finish says so."""
import os
import subprocess
import sys

import pytest

from hpcnn import cli
from hpcnn.log import RunLog
from mpi_util import ROOT


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A real 2-step serial run's log and checkpoint, and the bad inputs made from them."""
    d = tmp_path_factory.mktemp("report")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "hpcnn", "train", "--model=mlp", "--steps=2",
                        "--no-progress", f"--log={d / 'run.h5'}", f"--checkpoint={d / 'ck.h5'}"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=d)
    assert p.returncode == 0, p.stderr
    (d / "trunc.h5").write_bytes((d / "run.h5").read_bytes()[:5000])
    (d / "text.txt").write_text("not a run log\n")
    (d / "folder").mkdir()
    return d


def _report(capsys, *args):
    code = cli.main(["report", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name, message", [
    ("nope.h5", "nope.h5: no such file"),
    ("folder", "folder: a directory, not a run log"),
    ("text.txt", "text.txt: not an HDF5 file (file signature not found)"),
    ("trunc.h5", "trunc.h5: a damaged HDF5 file (truncated file: eof = 5000")])
def test_a_bad_input_is_one_line_and_exit_2(files, capsys, name, message):
    path = files / name
    for args in ([path], ["--headline", path], [path, "--trace", files / "o.json"],
                 [files / "run.h5", f"--predicted={path}", f"--gantt={files / 'o.png'}"]):
        code, out, err = _report(capsys, *args)
        assert code == 2 and out == "" and err.count("\n") == 1, (args, err)
        assert err.startswith("hpcnn report") and f"{files}/{message}" in err, (args, err)
    assert not (files / "o.json").exists() and not (files / "o.png").exists()


@pytest.mark.parametrize("out, message", [
    ("folder", "a directory, not a file to write the output into"),
    ("text.txt/r.png", "cannot write the output: {files}/text.txt is not a directory")])
def test_an_output_it_cannot_write_is_refused_first(files, capsys, out, message):
    for args in ([files / "run.h5", files / out], [files / "run.h5", "--trace", files / out],
                 [files / "run.h5", f"--predicted={files / 'run.h5'}", f"--gantt={files / out}"]):
        code, printed, err = _report(capsys, *args)
        assert code == 2 and printed == "", (args, printed)
        assert err == f"hpcnn report: {files / out}: {message.format(files=files)}\n", err


def test_a_checkpoint_is_described_as_one(files, capsys):
    code, out, err = _report(capsys, files / "ck.h5")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"checkpoint {files / 'ck.h5'} (format 2")
    assert lines[1].startswith("step     2 ")
    assert lines[2].startswith("layout   saved at dp=1 x tp=1 x pp=1")
    assert "model=mlp" in lines[3] and "hidden=256,256" in lines[3] and "adamw" in lines[3]
    assert not (files / "ck.png").exists()                 # no figure of a checkpoint
    code, out, err = _report(capsys, "--headline", files / "ck.h5", files / "run.h5")
    assert code == 0 and out.startswith("ck.h5: checkpoint; step 2 "), out
    assert out.splitlines()[1].startswith("run.h5: test_acc ")   # finished: no status shown
    code, out, err = _report(capsys, files / "ck.h5", "--trace", files / "o.json")
    assert code == 2 and "ck.h5: a checkpoint, not a run log" in err


@pytest.mark.parametrize("status", ["failed", "interrupted", "running"])
def test_the_headline_of_a_run_that_did_not_finish(tmp_path, capsys, status):
    path = tmp_path / "run.h5"
    log = RunLog(path, {"model": "mlp", "steps": 100}, command_line="test")
    for step in range(3):
        log.log_metrics(step, loss=1.0 / (step + 1))
    if status == "running":
        log.flush()
    else:
        log.close(status=status)
    code, out, _ = _report(capsys, "--headline", path)
    assert code == 0 and out.startswith(f"run.h5: {status} after 3 of 100 steps; loss 0.3333")
