"""A run log's timeline as a Chrome-trace JSON file (Perfetto and chrome://tracing open it).

One track per rank (a thread of process "hpcnn"); every ``/timeline`` event becomes a complete
event ("ph": "X") whose category says what the rank was doing:

- ``compute``: the schedule's F, B, W and the remat ops, the optimizer step (and, in logs written
  before the step engine, "forward"/"backward");
- ``communication``: SEND_*/RECV_*, the wait for the gradient allreduce (``allreduce_wait``),
  any kind naming a collective (AR, allreduce, allgather, reduce_scatter, bcast);
- ``idle``: an emulated slowdown, and the gaps between a rank's consecutive events, added as
  events named "idle" so that the track shows where the rank waited (or did untimed work).

Times are microseconds from the log's time origin (each rank's own clock, as logged)::

    hpcnn report RUN.h5 --trace OUT.json
"""
from __future__ import annotations

import json

import numpy as np

from hpcnn.log.runlog import read_run

COMPUTE = ("F", "B", "W", "F_ck", "F_n", "F_all", "forward", "backward", "optimizer", "held")
COMMUNICATION = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD", "allreduce_wait", "AR",
                 "AR_WAIT", "allreduce", "allgather", "reduce_scatter", "bcast", "alltoall")


def category(kind: str) -> str:
    """compute, communication or idle for an event kind (unknown kinds count as compute)."""
    if kind in COMMUNICATION:
        return "communication"
    if kind == "emulated_slowdown" or kind == "idle":
        return "idle"
    return "compute"


def trace_events(timeline: dict, min_gap_s: float = 1e-6) -> list[dict]:
    """Chrome-trace events for a ``/timeline`` table (columns rank, kind, microbatch, t_start,
    t_end): one complete event per row, the idle gaps of at least ``min_gap_s`` between a rank's
    consecutive events, and a thread name per rank."""
    ranks = np.asarray(timeline["rank"])
    kinds = np.asarray(timeline["kind"]).astype(str)
    mbs = np.asarray(timeline["microbatch"])
    t0, t1 = np.asarray(timeline["t_start"], float), np.asarray(timeline["t_end"], float)
    events = []
    for r in sorted(set(ranks.tolist())):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": int(r),
                       "args": {"name": f"rank {int(r)}"}})
        rows = np.flatnonzero(ranks == r)
        rows = rows[np.argsort(t0[rows], kind="stable")]
        end = None
        for i in rows:
            if end is not None and t0[i] - end >= min_gap_s:
                events.append(_complete("idle", "idle", r, end, t0[i], -1))
            events.append(_complete(kinds[i], category(kinds[i]), r, t0[i], t1[i], mbs[i]))
            end = t1[i] if end is None else max(end, t1[i])
    return events


def _complete(name, cat, rank, start, end, mb) -> dict:
    event = {"ph": "X", "name": str(name), "cat": cat, "pid": 0, "tid": int(rank),
             "ts": float(start) * 1e6, "dur": max(0.0, float(end - start)) * 1e6}
    if int(mb) >= 0:
        event["args"] = {"microbatch": int(mb)}
    return event


def write_trace(h5_path, json_path) -> int:
    """Write the run log's timeline as a Chrome-trace JSON file; returns the number of events.
    A log without timeline events gives a ValueError naming the file."""
    run = read_run(h5_path)
    if not run.timeline or len(run.timeline.get("rank", ())) == 0:
        raise ValueError(f"{h5_path}: the run log has no timeline events")
    events = trace_events(run.timeline)
    with open(json_path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"source": str(h5_path)}}, f)
    return len(events)
