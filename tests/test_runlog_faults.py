"""The run log under faults: a write cut at a random byte (SIGKILL, power loss), a full disk
(ENOSPC) at a random write, a real full tmpfs, and two runs on one log path (the lock).

The injector replaces ``os.pwrite``, ``os.ftruncate`` and ``os.fsync``, through which every write
of an update reaches the disk (:mod:`hpcnn.log.journal`); HDF5 itself only writes into memory.
It lets a budget of bytes through (a ``ftruncate`` or ``fsync`` counts 1) and then, mid-write:
``kill`` stops the process there (an exception nothing catches, files left as they are), ``power``
does the same after dropping at random the writes not yet fsync'ed, ``enospc`` fails the write
with ENOSPC as a full disk does.
"""
import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcnn.log import RunLog, journal, lock, read_run

ROOT = Path(__file__).resolve().parents[1]
FLUSH = 3


class Killed(BaseException):
    """The process died here (BaseException: no ``except Exception`` or ``OSError`` cleans up)."""


class Injector:
    def __init__(self, monkeypatch, budget: int, mode: str, rng, journal_free=False):
        self.budget, self.mode, self.rng, self.fired = budget, mode, rng, False
        self.journal_free = journal_free          # the journal's writes cost nothing: the
        #                                           cut lands in the file's writes
        self.unsynced: dict[int, list] = {}       # fd -> (offset, old bytes) not yet fsync'ed
        self.real = os.pwrite, os.ftruncate
        monkeypatch.setattr(os, "pwrite", self.pwrite)
        monkeypatch.setattr(os, "ftruncate", self.ftruncate)
        monkeypatch.setattr(os, "fsync", self.fsync)

    def _die(self):
        self.fired = True
        if self.mode == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.mode == "power":          # the OS cache is lost: undo some unsynced overwrites
            for fd, writes in self.unsynced.items():
                for off, old in reversed(writes):
                    if self.rng.random() < 0.5:
                        self.real[0](fd, old, off)
        raise Killed

    def pwrite(self, fd, data, off):
        data = bytes(data)
        if self.journal_free and os.readlink(f"/proc/self/fd/{fd}").endswith("-journal"):
            return self.real[0](fd, data, off)
        grows = off + len(data) > os.fstat(fd).st_size
        if self.budget <= 0 and (grows or self.mode != "enospc"):    # a full disk still
            self._die()                                              # lets overwrites through
        n = min(len(data), max(self.budget, 0)) if grows or self.mode != "enospc" else len(data)
        old = os.pread(fd, n, off)
        if len(old) == n:
            self.unsynced.setdefault(fd, []).append((off, old))
        self.budget -= n
        return self.real[0](fd, data[:n], off)           # a short write: the caller retries

    def ftruncate(self, fd, size):
        if self.budget <= 0 and self.mode != "enospc":
            self._die()
        self.budget -= 1
        return self.real[1](fd, size)

    def fsync(self, fd):
        if self.budget <= 0 and self.mode != "enospc":
            self._die()
        self.budget -= 1
        self.unsynced.pop(fd, None)


def loss_of(s):
    return 1.0 / (1.0 + s)


def log_steps(log, steps, new_metric=False):
    for s in steps:
        log.log_ranks(s, [{"rank": r, "compute_s": s + 0.25 * r, "bytes_sent": 10 * s + r}
                          for r in range(2)])
        log.log_events([(r, "F" if s % 2 else "B", s, s, s + 0.5) for r in range(2)])
        extra = {"test_acc": s / 100.0} if new_metric else {}
        log.log_metrics(s, loss=loss_of(s), **extra)


def check_prefix(path, n_steps, plan=None):
    """The log opens and holds exactly steps 0..n_steps-1, whole and right."""
    run = read_run(path)
    m = run.metrics
    np.testing.assert_array_equal(m["step"], np.arange(n_steps))
    np.testing.assert_allclose(m.get("loss", []), [loss_of(s) for s in range(n_steps)])
    assert all(len(c) == n_steps for c in m.values())
    np.testing.assert_array_equal(run.ranks["step"], np.repeat(np.arange(n_steps), 2))
    np.testing.assert_array_equal(run.ranks["bytes_sent"], 10 * run.ranks["step"] + run.ranks["rank"])
    np.testing.assert_array_equal(run.timeline["microbatch"], np.repeat(np.arange(n_steps), 2))
    assert set(run.timeline["kind"]) <= {"F", "B"}
    if plan is not None:
        assert run.plan == plan
    return run


def _both(path):
    """The bytes of the log and of its journal (b"" if none)."""
    j = Path(journal.journal_path(str(path)))
    return path.read_bytes(), j.read_bytes() if j.exists() else b""


def _fault_trial(tmp_path, monkeypatch, rng, mode, i, budget_max):
    """Some whole flushes, then one update (flush, flush adding a metric, set_plan or close) cut
    at a random byte; the file must hold the whole flushes (and the cut update if it got through).
    Returns (cut, journal left hot)."""
    path = tmp_path / f"t{i}.h5"
    log = RunLog(path, {"trial": i}, command_line="x", flush_every=FLUSH, durable=False)
    k = int(rng.integers(0, 4))
    log.set_plan({"dp": 1})
    log_steps(log, range(k * FLUSH))
    op = ["flush", "new_metric", "plan", "close"][int(rng.integers(0, 4))]
    before = path.read_bytes()
    log.durable = True                     # (the syncs of the cut update only: the injector's)
    with monkeypatch.context() as mp:
        inj = Injector(mp, int(np.exp(rng.uniform(0, np.log(budget_max)))) - 1, mode, rng,
                       journal_free=i % 2 == 1)
        try:
            if op in ("flush", "new_metric"):
                log_steps(log, range(k * FLUSH, (k + 1) * FLUSH), new_metric=op == "new_metric")
            elif op == "plan":
                log.set_plan({"dp": 2, "stages": [[0, 1]]})
            else:
                log.close()
        except Killed:
            pass
    done = not inj.fired
    if mode == "enospc":
        assert (log.error is not None) == inj.fired
    steps = (k + 1) * FLUSH if done and op in ("flush", "new_metric") else k * FLUSH
    plan = {"dp": 2, "stages": [[0, 1]]} if done and op == "plan" else {"dp": 1}
    hot = journal.read_journal(str(path)) is not None
    files = _both(path)
    run = check_prefix(path, steps, plan)
    assert run.status == ("finished" if done and op == "close" else "running")
    assert _both(path) == files                  # reading modified nothing
    journal.rollback(str(path))             # the writer's way (on disk) gives the same file:
    if not done:                            # exactly the last committed one
        assert path.read_bytes() == before
    lock.release(str(path))
    return inj.fired, hot


def _flush_bytes(tmp_path):
    """Bytes and syncs one flush sends to the disk (the injector's budget unit), at most."""
    log = RunLog(tmp_path / "size.h5", {}, command_line="x", flush_every=FLUSH, durable=False)
    sizes = []
    orig = os.pwrite

    def counting(fd, data, off):
        sizes[-1] += len(data)
        return orig(fd, data, off)
    os.pwrite = counting
    try:
        for k in range(3):
            sizes.append(0)
            log_steps(log, range(k * FLUSH, (k + 1) * FLUSH), new_metric=k == 2)
    finally:
        os.pwrite = orig
    log.close()
    return max(sizes) + 10


@pytest.mark.parametrize("mode,trials", [("kill", 60), ("power", 50), ("enospc", 40)])
def test_cut_updates_keep_every_committed_flush(tmp_path, monkeypatch, mode, trials):
    rng = np.random.default_rng({"kill": 1, "power": 2, "enospc": 3}[mode])
    budget_max = _flush_bytes(tmp_path)
    results = [_fault_trial(tmp_path, monkeypatch, rng, mode, i, budget_max)
               for i in range(trials)]
    cut, hot = sum(c for c, _ in results), sum(h for _, h in results)
    print(f"{mode}: {trials} trials, {cut} cut, {hot} left the journal hot")
    assert cut > trials // 2                                     # most trials were really cut
    assert hot > trials // 4 if mode != "enospc" else hot == 0   # and many half way through


def test_enospc_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    path = tmp_path / "full.h5"
    log = RunLog(path, {}, command_line="x", flush_every=FLUSH, durable=False)
    log_steps(log, range(6))
    with monkeypatch.context() as mp:
        Injector(mp, 0, "enospc", None)
        log_steps(log, range(6, 30))              # 8 flushes fail: no exception
        log.set_plan({"x": 1})
        log.close()                              # the disk is still full: status stays
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and str(path) in err and "No space left" in err
    assert "6 steps" in err
    run = check_prefix(path, 6)
    assert run.status == "running" and not os.path.exists(lock.lock_path(path))

    path2 = tmp_path / "freed.h5"                 # the disk fills, then space is freed
    log = RunLog(path2, {}, command_line="x", flush_every=FLUSH, durable=False)
    log_steps(log, range(3))
    with monkeypatch.context() as mp:
        Injector(mp, 0, "enospc", None)
        log_steps(log, range(3, 9))
    log.close()
    run = check_prefix(path2, 3)
    assert run.status == "failed" and "No space left" in run.attrs["log_error"]


def test_old_schema_1_log_reads_the_same(tmp_path):
    """A log written the old way (plain h5py, no journal, no lock) reads as before."""
    path = tmp_path / "old.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(schema_version=1, status="finished", command_line="old")
        f.create_group("config").attrs["json"] = "{\"lr\": 0.1}"
        f.create_group("plan").attrs["dp"] = 2
        g = f.create_group("metrics")
        g["step"], g["loss"] = np.arange(4), np.linspace(1, 0, 4)
    run = read_run(path)
    assert run.status == "finished" and run.config == {"lr": 0.1} and run.plan == {"dp": 2}
    np.testing.assert_allclose(run.metrics["loss"], np.linspace(1, 0, 4))


def _mount_tmpfs(where, size):
    where.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_real_full_tmpfs(tmp_path, capsys):
    """A 400 KB tmpfs fills up: the run goes on, the log opens with every committed flush."""
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, "400k"):
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        path = mnt / "run.h5"
        log = RunLog(path, {}, command_line="x", flush_every=10, durable=False)
        for s in range(3000):
            log.log_ranks(s, [{"rank": r, "compute_s": 1.0} for r in range(8)])
            log.log_events([(r, "F", s, s, s + 0.5) for r in range(8)])
            log.log_metrics(s, loss=loss_of(s))
        log.close()
        assert log.error is not None and "No space left" in log.error
        run = read_run(path)
        n = log.flushed_steps
        assert 0 < n < 3000 and n % 10 == 0
        np.testing.assert_array_equal(run.metrics["step"], np.arange(n))
        assert len(run.ranks["step"]) == 8 * n
        assert capsys.readouterr().err.count("warning") == 1
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=10)


def test_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path, capsys):
    path = tmp_path / "run.h5"
    log = RunLog(path, {}, command_line="x")
    with pytest.raises(lock.LogLockedError, match=f"{path}.*pid {os.getpid()}"):
        RunLog(path, {}, command_line="y", overwrite=True)
    assert str(os.getpid()) in lock.refusal(str(path))
    log.close()
    assert lock.refusal(str(path)) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    Path(lock.lock_path(path)).write_text(
        f'{{"host": "{os.uname().nodename}", "pid": {dead.pid}, "start_time": "then"}}')
    assert lock.refusal(str(path)) is None
    RunLog(path, {}, command_line="z", overwrite=True).close()
    assert f"stale lock {lock.lock_path(path)} of pid {dead.pid}" in capsys.readouterr().err
    Path(lock.lock_path(path)).write_text('{"host": "elsewhere", "pid": 1, "start_time": "t"}')
    with pytest.raises(lock.LogLockedError, match="host elsewhere, pid 1"):
        RunLog(path, {}, command_line="w", overwrite=True)


def test_two_trainings_on_one_log(tmp_path):
    """Two serial ``hpcnn train`` started together with one --log: one runs, one exits 2."""
    path = tmp_path / "same.h5"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "hpcnn", "train", "--model=mlp", "--epochs=1",
           "--progress=false", f"--log={path}"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], (codes, outs)
    loser = next(i for i, p in enumerate(procs) if p.returncode == 2)
    winner = procs[1 - loser]
    err = outs[loser][1]
    assert str(path) in err and f"pid {winner.pid}" in err, err
    assert "Traceback" not in err
    run = read_run(path)
    assert run.status == "finished"
    np.testing.assert_array_equal(run.metrics["step"], np.arange(len(run.metrics["step"])))
    assert not os.path.exists(lock.lock_path(path))


def _foreign_lock(path):
    Path(lock.lock_path(path)).write_text('{"host": "elsewhere", "pid": 4242, "start_time": "t"}')


def test_locked_log_refused_once_under_mpi(tmp_path):
    """Refused by the checks before MPI, on every rank: one line, exit code 2."""
    from test_refusals import assert_refused, run_mpi_cli
    path = tmp_path / "run.h5"
    _foreign_lock(path)
    p = run_mpi_cli(2, "--model=mlp", "--dp=2", "--steps=2", f"--log={path}", timeout=120)
    assert_refused(p.returncode, p.stderr, str(path), "host elsewhere, pid 4242")
    assert not path.exists()


def test_lock_taken_after_the_checks_stops_every_rank(tmp_path):
    from mpi_util import run_mpi
    path = tmp_path / "run.h5"
    _foreign_lock(path)
    out = run_mpi("log_lock", 2, path, timeout=120)
    assert sorted(re.findall(r"rank \d refused", out)) == ["rank 0 refused", "rank 1 refused"], out
    assert not path.exists()


def test_existing_log_refused_without_overwrite(tmp_path, capsys):
    """--overwrite=false and a log at the path: refused by the checks (before: a traceback)."""
    from hpcnn.cli import main
    path = tmp_path / "done.h5"
    RunLog(path, {}, command_line="x").close()
    assert main(["train", "--model=mlp", "--steps=1", "--progress=false", "--overwrite=false",
                 f"--log={path}"]) == 2
    err = capsys.readouterr().err
    assert f"log='{path}' already exists" in err and "--overwrite=true" in err
    assert read_run(path).config == {}


def test_train_log_durable_fsyncs_every_flush(tmp_path, monkeypatch):
    """--log_durable=true reaches the run log: every flush fsyncs (journal and file), and the
    log reads whole; the default does not fsync."""
    from hpcnn.config import parse_overrides
    from hpcnn.train import train
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    for durable in (False, True):
        calls.clear()
        log = tmp_path / f"d{durable}.h5"
        cfg = parse_overrides(["--model=mlp", "--hidden=16", "--steps=10", "--log_interval=5",
                               "--progress=false",
                               "--eval_interval=0", f"--log={log}", f"--log_durable={durable}"])
        train(cfg)
        run = read_run(log)
        assert run.status == "finished" and len(run.metrics["step"]) == 10
        assert (len(calls) >= 2 * 2) if durable else not calls, (durable, len(calls))
