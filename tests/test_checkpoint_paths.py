"""The files a run writes, checked before step 0: the log, the checkpoint and the resumed file
are not one another (after symbolic links), the checkpoint's folder is writable, another model's
checkpoint or a file that is no checkpoint is not replaced, and the temporary file of a killed
save is removed at the next start. Each refusal: exit code 2, one line, nothing trained."""
import os
import subprocess

import numpy as np
import pytest

from hpcnn import checkpoint
from hpcnn.cli import main
from hpcnn.log import read_run

MLP = ["train", "--model=mlp", "--hidden=8", "--steps=2", "--eval_interval=0", "--progress=false"]


def _refused(capsys, *args) -> str:
    """Run ``hpcnn train ARGS``, expect exit 2 and one line on stderr; return it."""
    assert main([*MLP, *args]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcnn train: invalid configuration: "), err
    assert "result:" not in out and "step " not in out
    return lines[0]


@pytest.fixture
def ck(tmp_path, capsys):
    """A checkpoint of the MLP with --hidden=8 at tmp_path/ck.h5 (and its run log a.h5)."""
    path = tmp_path / "ck.h5"
    assert main([*MLP, f"--log={tmp_path / 'a.h5'}", f"--checkpoint={path}"]) == 0
    capsys.readouterr()
    return path


def test_the_log_is_neither_the_checkpoint_nor_the_resumed_file(tmp_path, ck, capsys):
    """Before: --resume=P --log=P ran (exit 0) and replaced the checkpoint with the run log;
    --checkpoint=P --log=P crashed after the first save (KeyError 'plan')."""
    line = _refused(capsys, f"--log={ck}", f"--resume={ck}", "--steps=3")
    assert f"log='{ck}' and resume='{ck}' are the same file" in line
    assert checkpoint.summary(str(ck))["step"] == 2                 # untouched
    log = tmp_path / "new.h5"
    line = _refused(capsys, f"--log={log}", f"--checkpoint={log}")
    assert f"log='{log}' and checkpoint='{log}' are the same file" in line
    assert not log.exists() and not os.path.exists(f"{log}.lock")
    (tmp_path / "link.h5").symlink_to(ck)                             # through a symbolic link
    line = _refused(capsys, f"--log={tmp_path / 'link.h5'}", f"--resume={ck}", "--steps=3")
    assert "are the same file" in line
    step = tmp_path / "ck-{step}.h5"                                  # one file per save
    line = _refused(capsys, f"--log={tmp_path / 'ck-2.h5'}", f"--checkpoint={step}")
    assert "are the same file" in line
    assert checkpoint.summary(str(ck))["step"] == 2


def test_resume_and_keep_saving_to_one_file_is_allowed(tmp_path, capsys):
    """The resumable job's pattern (jobs/train_resumable.slurm): bit for bit the whole run."""
    import shutil
    assert main([*MLP, "--steps=4", f"--log={tmp_path / 'whole.h5'}", "--checkpoint_every=2",
                 f"--checkpoint={tmp_path / 'whole-{step}.h5'}"]) == 0
    ck = tmp_path / "ck.h5"
    shutil.copy(tmp_path / "whole-2.h5", ck)             # where an earlier slice stopped
    assert main([*MLP, "--steps=4", f"--log={tmp_path / 'rest.h5'}", f"--resume={ck}",
                 f"--checkpoint={ck}"]) == 0
    assert checkpoint.summary(str(ck))["step"] == 4
    import h5py
    with h5py.File(ck, "r") as a, h5py.File(tmp_path / "whole-4.h5", "r") as b:
        for group in ("params", "optim"):
            a[group].visititems(lambda name, ds: np.testing.assert_array_equal(
                ds[...], b[group][name][...], err_msg=name) if hasattr(ds, "shape") else None)


def test_an_unwritable_destination_is_refused_before_step_0(tmp_path, capsys, monkeypatch):
    """Before: the whole run trained, then failed at its first save (exit 2)."""
    log = tmp_path / "run.h5"
    line = _refused(capsys, f"--log={log}", f"--checkpoint={tmp_path}")
    assert f"checkpoint='{tmp_path}' is a directory" in line
    (tmp_path / "plain").write_text("a file")
    line = _refused(capsys, f"--log={log}", f"--checkpoint={tmp_path / 'plain' / 'x.h5'}")
    assert f"cannot be written: {tmp_path / 'plain'} is not a directory" in line
    assert main([*MLP, f"--log={log}", f"--checkpoint={tmp_path / 'new' / 'dir' / 'ck.h5'}"]) == 0
    capsys.readouterr()                                  # missing folders: the save makes them
    real_open = os.open

    def read_only(path, *args, **kw):                    # what a read-only mount answers
        if ".hpcnn-probe" in os.fspath(path):
            raise OSError(30, "Read-only file system")
        return real_open(path, *args, **kw)
    monkeypatch.setattr(os, "open", read_only)
    line = _refused(capsys, f"--log={log}", f"--checkpoint={tmp_path / 'ck.h5'}")
    assert f"cannot create a file in {tmp_path} (Read-only file system)" in line
    assert not (tmp_path / "ck.h5").exists()


def test_a_read_only_mount_is_refused(tmp_path, capsys):
    """A real read-only file system (a tmpfs mounted read-only: needs root)."""
    from test_checkpoint import tmpfs
    with tmpfs(tmp_path / "ro", "ro,size=64k") as disk:
        line = _refused(capsys, f"--log={tmp_path / 'run.h5'}", f"--checkpoint={disk / 'ck.h5'}")
        assert "cannot be written: " in line and line.endswith(str(disk)), line


def test_an_unwritable_log_is_refused_before_step_0(tmp_path, capsys):
    """Before: a traceback (IsADirectoryError at the log's creation, or the read-only file
    system's OSError). A directory, a folder that is a file, a read-only mount (a tmpfs
    mounted read-only where mounting is allowed)."""
    line = _refused(capsys, f"--log={tmp_path}")
    assert f"log='{tmp_path}' is a directory: pass a file name" in line
    (tmp_path / "plain").write_text("a file")
    line = _refused(capsys, f"--log={tmp_path / 'plain' / 'run.h5'}")
    assert f"cannot be written: {tmp_path / 'plain'} is not a directory" in line
    from test_checkpoint import tmpfs
    with tmpfs(tmp_path / "ro", "ro,size=64k") as disk:
        line = _refused(capsys, f"--log={disk / 'run.h5'}")
        assert line.startswith(f"hpcnn train: invalid configuration: log='{disk / 'run.h5'}' "
                               "cannot be written: "), line


def test_one_run_at_a_time_saves_to_a_checkpoint_path(tmp_path, capsys):
    """A live run holding ``P.lock`` (here: this process, as another run would) refuses a
    second run's --checkpoint=P before step 0; a finished run leaves no lock; a dead holder's
    lock is taken over with a note."""
    import json
    import socket
    path = tmp_path / "ck-{step}.h5"
    lock = tmp_path / "ck-{step}.h5.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                "start_time": "now"}))
    line = _refused(capsys, f"--log={tmp_path / 'a.h5'}", f"--checkpoint={path}")
    assert f"checkpoint {path} is being written by another run (host " in line
    assert "pass another --checkpoint, or remove" in line
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1,
                                "start_time": "then"}))      # beyond pid_max: not running
    assert main([*MLP, f"--log={tmp_path / 'b.h5'}", f"--checkpoint={path}"]) == 0
    assert "took over the stale lock" in capsys.readouterr().err
    assert not lock.exists() and (tmp_path / "ck-2.h5").exists()


def test_a_file_system_without_room_for_the_checkpoint_is_refused(tmp_path, capsys):
    """A 64 KiB tmpfs cannot take the checkpoint of the MLP with 256 hidden units (its 19k
    parameters and two AdamW slots in float32, about as large as the file a run writes):
    refused before step 0, naming both sizes; the estimate is checked against a real file."""
    from hpcnn import datasets
    from hpcnn.config import parse_overrides
    from hpcnn.preflight import checkpoint_bytes
    from test_checkpoint import tmpfs
    wide = [a if a != "--hidden=8" else "--hidden=256" for a in MLP]
    assert main([*wide, f"--log={tmp_path / 'a.h5'}", f"--checkpoint={tmp_path / 'ck.h5'}"]) == 0
    capsys.readouterr()
    cfg = parse_overrides([*wide[1:], f"--checkpoint={tmp_path / 'ck.h5'}"]).resolved()
    need = checkpoint_bytes(cfg, datasets.for_config(cfg))
    assert need <= os.path.getsize(tmp_path / "ck.h5") <= need + 64 * 1024
    with tmpfs(tmp_path / "small", "size=64k") as disk:
        assert main([*wide, f"--log={tmp_path / 'b.h5'}", f"--checkpoint={disk / 'ck.h5'}"]) == 2
        line = capsys.readouterr().err.strip()
        assert f"takes {need / 2**20:.1f} MiB, {disk} has 0.1 MiB free" in line, line
        assert "\n" not in line and not os.listdir(disk)


def test_no_other_file_is_replaced(tmp_path, ck, capsys):
    """Before: a run of another model silently replaced the first run's checkpoint."""
    line = _refused(capsys, "--hidden=16", f"--log={tmp_path / 'b.h5'}", f"--checkpoint={ck}")
    assert "holds a checkpoint of another model (--hidden=8 in the checkpoint, 16 here)" in line
    assert checkpoint.summary(str(ck))["config"]["hidden"] == [8]
    line = _refused(capsys, f"--log={tmp_path / 'b.h5'}", f"--checkpoint={tmp_path / 'a.h5'}")
    assert f"{tmp_path / 'a.h5'} exists and is not a checkpoint" in line     # a run log
    assert read_run(tmp_path / "a.h5").attrs["status"] == "finished"
    os.replace(ck, tmp_path / "c-2.h5")
    line = _refused(capsys, "--hidden=16", f"--log={tmp_path / 'b.h5'}",
                    f"--checkpoint={tmp_path / 'c-{step}.h5'}")
    assert "c-2.h5 holds a checkpoint of another model" in line
    assert main([*MLP, f"--log={tmp_path / 'b.h5'}", f"--checkpoint={tmp_path / 'c-{step}.h5'}"]) \
        == 0                                            # the same model's: replaced


def test_a_killed_save_leaves_no_temporary_file_for_good(tmp_path, ck, capsys):
    """A save killed before its rename leaves <path>.tmp<pid>: the next start removes it."""
    stale = tmp_path / f"ck.h5.tmp{_dead_pid()}"
    stale.write_bytes(b"\0" * 1024)
    other = tmp_path / f"ck.h5.tmp{os.getppid()}"        # a live process's: left alone
    other.write_bytes(b"")
    assert main([*MLP, f"--log={tmp_path / 'b.h5'}", f"--checkpoint={ck}"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"hpcnn: removed 1 temporary file(s) of an interrupted checkpoint save: "
                   f"{stale}"], err
    assert not stale.exists() and other.exists()


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
