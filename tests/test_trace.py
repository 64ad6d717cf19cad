"""hpcnn report --trace: a run log's timeline as a Chrome-trace JSON (one track per rank)."""
import json
import subprocess
import sys

import pytest

from hpcnn.config import parse_overrides
from hpcnn.log import RunLog, read_run
from hpcnn.log.chrome import category, trace_events, write_trace
from hpcnn.train import train


def test_events_tracks_categories_and_idle_gaps():
    timeline = {"rank": [0, 0, 1, 1, 0], "kind": ["F", "B", "RECV_ACT", "F", "optimizer"],
                "microbatch": [0, 0, 0, 0, -1],
                "t_start": [0.0, 0.002, 0.0, 0.001, 0.010],
                "t_end": [0.001, 0.004, 0.001, 0.003, 0.011]}
    ev = trace_events(timeline)
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1"}
    done = [e for e in ev if e["ph"] == "X"]
    r0 = [(e["name"], e["cat"], round(e["ts"]), round(e["dur"])) for e in done if e["tid"] == 0]
    assert r0 == [("F", "compute", 0, 1000), ("idle", "idle", 1000, 1000),
                  ("B", "compute", 2000, 2000), ("idle", "idle", 4000, 6000),
                  ("optimizer", "compute", 10000, 1000)]
    r1 = [(e["name"], e["cat"]) for e in done if e["tid"] == 1]
    assert r1 == [("RECV_ACT", "communication"), ("F", "compute")]    # no gap: no idle
    assert [e["args"]["microbatch"] for e in done if e["name"] == "F"] == [0, 0]
    assert category("allreduce_wait") == "communication"
    assert category("emulated_slowdown") == "idle"


def test_report_trace_of_a_real_run(tmp_path):
    log = tmp_path / "run.h5"
    train(parse_overrides(["--model=mlp", "--steps=3", "--progress=false", "--grad_accum=2",
                           f"--log={log}"]))
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, "-m", "hpcnn", "report", str(log), "--trace", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    done = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] != "idle"]
    run = read_run(log)
    assert len(done) == len(run.timeline["kind"])                  # every logged event
    assert sorted(e["name"] for e in done) == sorted(run.timeline["kind"].tolist())
    assert {e["name"] for e in done} == {"F", "B", "optimizer"}
    assert all(e["dur"] >= 0 for e in data["traceEvents"] if e["ph"] == "X")


def test_report_trace_refusals(tmp_path):
    log = tmp_path / "empty.h5"
    RunLog(str(log), {"model": "mlp"}, command_line="test").close()
    with pytest.raises(ValueError, match="no timeline events"):
        write_trace(log, tmp_path / "x.json")
    r = subprocess.run([sys.executable, "-m", "hpcnn", "report", str(log), "--trace"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--trace needs one run log and one output path" in r.stderr
    r = subprocess.run([sys.executable, "-m", "hpcnn", "report", str(tmp_path / "no.h5"),
                        "--trace", str(tmp_path / "x.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "no such file" in r.stderr
