"""Tests of the HDF5 run log (hpcnn.log): schema round trip, sparse metrics, flushing, crash safety."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import hpcnn
from hpcnn.log import RunLog, read_run
from hpcnn.log.report import make_report, summary

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"model": "mlp", "lr": 0.1, "steps": 30, "layers": [784, 64, 10], "amp": False}


def test_config_with_numpy_and_paths(tmp_path):
    cfg = {"lr": np.float32(0.5), "n": np.int64(3), "shape": np.arange(3), "out": tmp_path}
    RunLog(tmp_path / "r.h5", cfg, command_line="x").close()
    assert read_run(tmp_path / "r.h5").config == {"lr": 0.5, "n": 3, "shape": [0, 1, 2],
                                                 "out": str(tmp_path)}


def make_log(path, **kw):
    kw.setdefault("command_line", "python train.py --lr=0.1")
    return RunLog(path, CONFIG, **kw)


def test_round_trip_all_groups(tmp_path):
    path = tmp_path / "run.h5"
    with make_log(path, world_size=4, mpi_library="MPICH 4.1", extra_attrs={"host": "n01", "tags": [1, 2]},
                  flush_every=3) as log:
        log.set_plan({"dp": 2, "tp": 2, "pp": 1, "schedule": "1f1b", "stages": [[0, 3], [3, 6]],
                      "predicted": {"step_s": 0.25}})
        for s in range(7):
            log.log_metrics(s, loss=2.0 - 0.1 * s, lr=0.1, step_time=0.01 * (s + 1))
            log.log_ranks(s, [{"rank": r, "compute_s": s + 0.1 * r, "comm_s": 0.5, "idle_s": 0.0,
                               "bytes_sent": 1000 * r, "peak_mem_bytes": 2**20} for r in range(4)])
            log.log_events([(r, "F", s, s + 0.1 * r, s + 0.2) for r in range(4)]
                           + [{"rank": 0, "kind": "ALLREDUCE", "microbatch": -1, "t_start": s, "t_end": s + 1}])
    run = read_run(path)
    assert run.status == "finished"
    a = run.attrs
    assert a["hpcnn_version"] == hpcnn.__version__ and a["schema_version"] == 1
    assert a["command_line"] == "python train.py --lr=0.1" and a["world_size"] == 4
    assert a["mpi_library"] == "MPICH 4.1" and a["backend"] == "cpu" and a["host"] == "n01"
    assert json.loads(a["tags"]) == [1, 2]
    assert a["start_time"].endswith("+00:00") and a["end_time"] >= a["start_time"]
    assert run.config == CONFIG
    assert run.plan == {"dp": 2, "tp": 2, "pp": 1, "schedule": "1f1b", "stages": [[0, 3], [3, 6]],
                        "predicted": {"step_s": 0.25}}
    m = run.metrics
    assert sorted(m) == ["loss", "lr", "step", "step_time"]
    assert m["step"].dtype == np.int64 and m["loss"].dtype == np.float64
    np.testing.assert_array_equal(m["step"], np.arange(7))
    np.testing.assert_allclose(m["loss"], 2.0 - 0.1 * np.arange(7))
    r = run.ranks
    assert len(r["step"]) == 28
    np.testing.assert_array_equal(r["rank"], np.tile(np.arange(4), 7))
    np.testing.assert_array_equal(r["step"], np.repeat(np.arange(7), 4))
    np.testing.assert_allclose(r["compute_s"], r["step"] + 0.1 * r["rank"])
    np.testing.assert_array_equal(r["bytes_sent"], 1000 * r["rank"])
    t = run.timeline
    assert len(t["rank"]) == 35 and t["rank"].dtype == np.int32
    assert list(t["kind"][:5]) == ["F", "F", "F", "F", "ALLREDUCE"]
    np.testing.assert_array_equal(t["microbatch"][:5], [0, 0, 0, 0, -1])
    with h5py.File(path, "r") as f:   # what h5dump shows
        assert f["config"].attrs["lr"] == 0.1 and f["config"].attrs["model"] == "mlp"
        assert "layers" not in f["config"].attrs
        assert json.loads(f["config"].attrs["json"]) == CONFIG
        assert json.loads(f["timeline"].attrs["kind_names"]) == ["F", "ALLREDUCE"]
        assert f["ranks"].dtype.names[:3] == ("step", "rank", "compute_s") and len(f["ranks"]) == 28
        assert f["metrics/loss"].maxshape == (None,) and f["metrics/loss"].chunks is not None


def test_sparse_metrics_are_nan(tmp_path):
    path = tmp_path / "run.h5"
    with make_log(path, flush_every=4) as log:
        for s in range(10):
            extra = {"test_acc": 0.5 + 0.01 * s} if s % 3 == 0 else {}
            log.log_metrics(s, loss=1.0 / (s + 1), **extra)
    m = read_run(path).metrics
    acc = m["test_acc"]
    assert len(acc) == 10
    np.testing.assert_allclose(acc[::3], 0.5 + 0.01 * np.arange(0, 10, 3))
    assert np.isnan(np.delete(acc, np.arange(0, 10, 3))).all()
    assert np.isfinite(m["loss"]).all()


def test_metric_appearing_mid_run_is_backfilled(tmp_path):
    path = tmp_path / "run.h5"
    with make_log(path, flush_every=3) as log:
        for s in range(8):                                  # grad_norm from step 5: after 1 flush
            log.log_metrics(s, loss=float(s), **({"grad_norm": 10.0 + s} if s >= 5 else {}))
    m = read_run(path).metrics
    assert len(m["grad_norm"]) == len(m["step"]) == 8
    assert np.isnan(m["grad_norm"][:5]).all()
    np.testing.assert_allclose(m["grad_norm"][5:], [15.0, 16.0, 17.0])


def test_flush_boundaries_visible_before_close(tmp_path):
    path = tmp_path / "run.h5"
    log = make_log(path, flush_every=5)
    for s in range(7):
        log.log_ranks(s, [{"rank": 0, "compute_s": 1.0}])     # before log_metrics: same flush
        log.log_metrics(s, loss=float(s))
        with h5py.File(path, "r") as f:                     # the log object is alive, file closed
            n = len(f["metrics/step"])
            assert n == (5 if s >= 4 else 0), (s, n)
            assert len(f["ranks"]) == n
            assert f.attrs["status"] == "running"
    assert log.flushed_steps == 5 and log.n_flushes == 1 and log.last_flush_s > 0
    log.flush()
    assert len(read_run(path).metrics["step"]) == 7
    log.close()
    run = read_run(path)
    assert run.status == "finished" and run.ranks["bytes_sent"][0] == -1
    assert np.isnan(run.ranks["comm_s"]).all()
    with pytest.raises(RuntimeError, match="closed"):
        log.log_metrics(8, loss=0.0)


def test_refuses_to_overwrite(tmp_path):
    path = tmp_path / "run.h5"
    make_log(path).close()
    with pytest.raises(FileExistsError, match=str(path)):
        make_log(path)
    make_log(path, overwrite=True).close()
    assert read_run(path).metrics["step"].size == 0


def test_bad_input_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="status"):
        make_log(tmp_path / "x.h5", extra_attrs={"status": "ok"})
    log = make_log(tmp_path / "run.h5")
    log.log_metrics(3, loss=1.0)
    with pytest.raises(ValueError, match="step 3 <= last logged step 3"):
        log.log_metrics(3, acc=1.0)
    with pytest.raises(ValueError, match="'a/b'"):
        log.log_metrics(4, **{"a/b": 1.0})
    with pytest.raises(KeyError, match="compute"):
        log.log_ranks(3, [{"rank": 0, "compute": 1.0}])
    with pytest.raises(ValueError, match="'done'"):
        log.close("done")
    log.close()


def test_context_manager_marks_failed(tmp_path):
    path = tmp_path / "run.h5"
    with pytest.raises(ZeroDivisionError):
        with make_log(path) as log:
            log.log_metrics(0, loss=1.0)
            1 / 0
    run = read_run(path)
    assert run.status == "failed" and "end_time" in run.attrs
    assert run.metrics["loss"].tolist() == [1.0]          # buffered rows flushed on failure too


def test_killed_run_keeps_flushed_steps(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from _killed_writer import acc_of, loss_of
    path = tmp_path / "killed.h5"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_killed_writer.py"), str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    printed, deadline = [], time.monotonic() + 30
    try:
        while len(printed) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break                                       # writer died: report its stderr below
            printed.append(int(line))
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    assert len(printed) >= 3, f"writer printed {printed}; stderr:\n{err}"
    assert proc.returncode == -signal.SIGKILL
    assert printed[:3] == [5, 10, 15]
    run = read_run(path)
    assert run.status == "running" and "end_time" not in run.attrs
    step = run.metrics["step"]
    k = len(step)
    assert k >= printed[-1] and k % 5 == 0                  # whole flushes only
    np.testing.assert_array_equal(step, np.arange(k))
    np.testing.assert_allclose(run.metrics["loss"], [loss_of(s) for s in range(k)])
    acc = run.metrics["test_acc"]
    np.testing.assert_allclose(acc[::10], [acc_of(s) for s in range(0, k, 10)])
    assert np.isnan(acc[1:10]).all()
    np.testing.assert_array_equal(run.ranks["step"], np.arange(k))
    assert list(run.timeline["kind"][:4]) == ["F", "B", "F", "B"]


def _report_run(path):
    cfg = {"model": {"name": "tiny-mlp", "width": 8}}
    with RunLog(path, cfg, command_line="train", flush_every=7) as log:
        for s in range(40):
            extra = {"test_acc": 0.5 + s / 100, "test_loss": 1.5 / (s + 1)} if s % 10 == 9 else {}
            log.log_metrics(s, loss=1.0 / (s + 1), train_acc=0.4 + s / 100, step_time=0.002 + 1e-5 * s,
                            samples_per_s=1000.0 + s, **extra)


def test_make_report_and_summary(tmp_path):
    path = tmp_path / "rep.h5"
    _report_run(path)
    png = make_report(path)
    assert png == str(tmp_path / "rep.png")
    data = Path(png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    other = make_report(path, tmp_path / "other.png")
    assert Path(other).read_bytes()[:4] == b"\x89PNG"
    text = summary(path)
    assert "tiny-mlp" in text and "finished" in text
    assert "steps    40" in text
    assert "final 0.025" in text                            # loss at step 39 = 1/40
    assert "best test_acc 0.8900" in text
    assert "median step_time 2.195 ms" in text


def test_report_on_empty_run(tmp_path):
    path = tmp_path / "empty.h5"
    RunLog(path, {}, command_line="x")                      # never closed: "running"
    assert Path(make_report(path)).stat().st_size > 0
    assert "running" in summary(path) and "steps    0" in summary(path)


def test_result_tables_round_trip(tmp_path):
    from hpcnn.log.results import load_table, save_table
    path = str(tmp_path / "r.h5")
    save_table(path, "t", [{"a": 1, "b": 2.5, "c": "x"}, {"a": 2, "b": 3.5, "c": "yy"}],
               attrs={"n": 3, "cfg": {"k": [1, 2]}})
    cols, attrs = load_table(path, "t")
    assert cols["a"].tolist() == [1, 2] and cols["b"].tolist() == [2.5, 3.5]
    assert cols["c"].tolist() == ["x", "yy"] and attrs["n"] == 3
    save_table(path, "u", [{"a": 1}], attrs=attrs)          # attrs read back (NumPy scalars)
    assert load_table(path, "u")[1]["n"] == 3


def test_mark_and_close_at_exit_from_another_thread(tmp_path):
    """What a run's signal handling does when the process must end on its own: ``mark``
    (from a thread) flushes the buffered rows and sets the status, the log still open;
    ``close_at_exit`` records why, closes it and releases the lock, then keeps the file's
    update lock: a later write of the main thread would wait, never interleave."""
    import threading
    from hpcnn.log import lock
    p = str(tmp_path / "run.h5")
    log = RunLog(p, {"a": 1}, command_line="x", flush_every=100)
    for s in range(3):
        log.log_metrics(s, loss=1.0 / (s + 1))
    t = threading.Thread(target=log.mark, args=("interrupted",))
    t.start(), t.join()
    run = read_run(p)
    assert run.attrs["status"] == "interrupted" and list(run.metrics["step"]) == [0, 1, 2]
    assert lock.holder(p) is not None                  # still open: the run goes on
    log.log_metrics(3, loss=0.25)
    done = []
    t = threading.Thread(target=lambda: done.append(log.close_at_exit("interrupted", "why")))
    t.start(), t.join()
    run = read_run(p)
    assert done == [True] and run.attrs["status"] == "interrupted"
    assert list(run.metrics["step"]) == [0, 1, 2, 3] and run.plan["ended"] == "why"
    assert lock.holder(p) is None
    assert not log._io.acquire(timeout=0.05)           # held by the (ended) closing thread
