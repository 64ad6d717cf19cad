"""The hang watchdog (hpcnn/parallel/collectives/watchdog.py): recording, the report, and whole
runs where the test-only fault hook HPCNN_FAULT makes one rank skip or never reach a call.

The MPI runs must end with a nonzero exit (MPI_Abort), so they call mpiexec directly rather than
through ``mpi_util.run_mpi`` (which fails on a nonzero exit); they start together, each is bounded
by a timeout far above the 2 s hang timeout, and the fault comes at step 1 so that little runs
before it."""
import os
import re
import subprocess
import sys
import time

import pytest

from hpcnn.parallel.collectives import watchdog
from mpi_util import ROOT, mpiexec


@pytest.fixture(autouse=True)
def _clean_state():
    watchdog._calls[:] = [0, None, None]
    watchdog._fault[0] = watchdog._pending[0] = None
    yield
    watchdog._calls[:] = [0, None, None]
    watchdog._fault[0] = watchdog._pending[0] = None


def test_enter_leave_nest_and_count():
    outer = watchdog.enter("allreduce", "dp", -1, 64)
    assert outer is None and watchdog.current_call()[:5] == (1, "allreduce", "dp", -1, 64)
    inner = watchdog.enter("wait iallreduce", "dp", -1, 64)
    assert watchdog.current_call()[:2] == (2, "wait iallreduce")
    watchdog.leave(inner)
    assert watchdog.current_call()[:2] == (1, "allreduce")       # back in the outer call
    watchdog.leave(outer)
    assert watchdog.current_call() is None and watchdog.last_call()[:2] == (1, "allreduce")
    assert watchdog.started("isend", "pp", 1, 8) is False
    assert watchdog.current_call() is None and watchdog.last_call()[:4] == (3, "isend", "pp", 1)


def test_fault_hook_parses_arms_at_its_step_and_skips_once():
    assert watchdog.parse_fault("") is None
    assert watchdog.parse_fault("skip_collective:rank=1:step=2:kind=isend") == \
        {"rank": 1, "step": 2, "kind": "isend", "stall": False, "raise": False}
    for bad in ("skip:rank=1:step=2", "skip_collective:rank=1", "skip_collective:rank=x:step=2",
                "skip_collective:rank=1:step=2:when=3"):
        with pytest.raises(ValueError, match="HPCNN_FAULT"):
            watchdog.parse_fault(bad)
    watchdog.arm_fault(0, {"HPCNN_FAULT": "skip_collective:rank=1:step=2"})   # another rank
    watchdog.at_step(5)
    assert watchdog.enter("allreduce", "dp", -1, 8) is None
    watchdog.leave(None)
    watchdog.arm_fault(1, {"HPCNN_FAULT": "skip_collective:rank=1:step=2:kind=bcast"})
    watchdog.at_step(1)
    assert watchdog.enter("bcast", "pp", -1, 8) is None             # step 1: not yet
    watchdog.leave(None)
    watchdog.at_step(2)
    assert watchdog.enter("allreduce", "dp", -1, 8) is None         # not its kind
    watchdog.leave(None)
    assert watchdog.enter("bcast", "pp", -1, 8) is watchdog.SKIP
    assert watchdog.current_call() is None and watchdog._calls[0] == 3  # as if never called
    assert watchdog.enter("bcast", "pp", -1, 8) is None             # once only
    watchdog.leave(None)


def test_table_names_waiting_and_idle_ranks():
    now = time.time()
    recs = {0: {"rank": 0, "in_call": True, "seq": 9, "kind": "wait irecv", "comm": "pp",
                "peer": 1, "nbytes": 2048, "since": now - 3.0},
            1: {"rank": 1, "in_call": False, "seq": 8, "kind": "allreduce", "comm": "dp",
                "peer": -1, "nbytes": 64, "since": now - 4.0},
            2: {"rank": 2, "in_call": True, "seq": 9, "kind": "bcast", "comm": "pp",
                "peer": -1, "nbytes": 8, "since": now - 3.0}}
    text = watchdog.table(recs, 4, 2.0, now=now)
    rows = {int(m.group(1)): m.group(0) for m in re.finditer(r"^\s+(\d+)\s.*$", text, re.M)}
    assert "waiting" in rows[0] and "wait irecv" in rows[0] and "3.0s" in rows[0]
    assert "not in call" in rows[1] and "allreduce" in rows[1]
    assert "no record" in rows[3]
    assert "wait irecv on pp: ranks [0]; bcast on pp: ranks [2]" in text
    assert "ranks [1, 3] are in no communication call" in text


def _watch(tmp_path, timeout, **kw):
    aborted, reasons = [], []
    w = watchdog.Watchdog(0, 2, str(tmp_path / "side"), timeout, on_hang=reasons.append,
                          abort=aborted.append, grace=0.2, out=open(os.devnull, "w"), **kw)
    return w, aborted, reasons


def test_watchdog_ignores_time_outside_calls(tmp_path):
    """A long compute step (no current call) never fires it; stop() ends the thread."""
    w, aborted, _ = _watch(tmp_path, 0.05)
    watchdog.leave(watchdog.enter("allreduce", "dp", -1, 8))       # a finished call
    w.start()
    time.sleep(0.4)                                                 # 8 timeouts of "compute"
    w.stop()
    assert not w.thread.is_alive() and w.thread.daemon
    assert aborted == [] and not os.path.exists(tmp_path / "side")


def test_watchdog_reports_a_stuck_call_and_aborts(tmp_path):
    w, aborted, reasons = _watch(tmp_path, 0.05)
    watchdog.enter("allgather", "tp", -1, 96)                       # never left: stuck
    w.start()
    w.thread.join(timeout=10)
    assert aborted == [3]
    assert reasons and "ranks [0]" in reasons[0] and "allgather on tp" in reasons[0]
    recs = watchdog.read_records(str(tmp_path / "side"))
    assert list(recs) == [0] and recs[0]["kind"] == "allgather" and recs[0]["in_call"]


def test_a_call_that_returns_before_the_report_is_no_hang(tmp_path):
    """A call outlasts the timeout, then returns while the records are gathered: no report
    (before, one said "ranks [] waited"), the side channel withdrawn, the watch going on; a
    call that stays stuck afterwards is reported with its rank."""
    w, aborted, reasons = _watch(tmp_path, 0.05)
    out = w.out = open(tmp_path / "out.txt", "w")
    side = tmp_path / "side"
    prev = watchdog.enter("allreduce", "dp", -1, 8)
    w.start()
    t0 = time.monotonic()
    while not side.exists() and time.monotonic() - t0 < 10:       # the record is written
        time.sleep(0.005)
    watchdog.leave(prev)                                           # ... and the call returns
    time.sleep(0.6)                                                # (grace 0.2 s)
    assert aborted == [] and reasons == [] and not side.exists() and w.thread.is_alive()
    watchdog.enter("bcast", "pp", -1, 16)                          # now stuck for good
    w.thread.join(timeout=10)
    out.close()
    assert aborted == [3] and "bcast on pp" in reasons[0]
    assert reasons[0].startswith("hang: ranks [0] wait in a communication call, ranks [0] for "
                                 "more than --hang_timeout=0.05 s")
    assert (tmp_path / "out.txt").read_text().count("hpcnn: hang:") == 1


def test_a_hang_timeout_below_a_second_is_refused():
    from hpcnn.config import ConfigError, parse_overrides
    for ok in ("0", "1", "300"):
        parse_overrides([f"--hang_timeout={ok}"]).resolved()
    with pytest.raises(ConfigError, match=r"hang_timeout=0.001: pass 0 \(no watchdog\) or at "
                                          r"least 1 s") as e:
        parse_overrides(["--hang_timeout=0.001"]).resolved()
    assert "\n" not in str(e.value)


# -- whole runs under MPI -----------------------------------------------------------------------
GPT = ["--model=gpt", "--n_layers=1", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=4", "--max_plays=1"]


# name: (ranks, HPCNN_FAULT, arguments)
HUNG = {"dp": (2, "skip_collective:rank=1:step=1:kind=iallreduce",
               GPT + ["--dp=2", "--allreduce=mpi"]),
        "tp": (2, "stall_collective:rank=1:step=1", GPT + ["--tp=2"]),
        "pp": (4, "skip_collective:rank=1:step=1:kind=isend",
               GPT + ["--pp=2", "--dp=2", "--microbatches=2", "--n_layers=2", "--allreduce=mpi"]),
        "rank0": (4, "stall_collective:rank=0:step=1", GPT + ["--tp=2", "--dp=2"])}


# make test-long: the 4-rank hangs (a pipeline's skipped send; rank 0 in no call, so that another
# rank reports); make test's name a rank waiting in its dp or tp allreduce and one in no call
LONG_HUNG = ("pp", "rank0")


def _started(tmp_path_factory, names):
    """The hung runs ``names``, started together: each spends most of its time waiting out the
    2 s timeout, so together they take little more than the longest one alone."""
    runs = {}
    for name in names:
        n, fault, args = HUNG[name]
        log = tmp_path_factory.mktemp(f"hung_{name}") / "run.h5"
        cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcnn", "train",
               *args, "--steps=6", "--eval_interval=0", "--hang_timeout=2", f"--log={log}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HPCNN_FAULT=fault,
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        runs[name] = (n, log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               text=True, env=env, cwd=ROOT))
    yield runs
    for _, _, p in runs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.fixture(scope="module")
def hung_runs(tmp_path_factory):
    yield from _started(tmp_path_factory, [name for name in HUNG if name not in LONG_HUNG])


@pytest.fixture(scope="module")
def long_hung_runs(tmp_path_factory):
    yield from _started(tmp_path_factory, LONG_HUNG)


def _hung_run(hung_runs, name):
    n, log, p = hung_runs[name]
    out, err = p.communicate(timeout=90)
    assert p.returncode != 0, out + err
    rows = {int(m.group(1)): m.group(2) for m in
            re.finditer(r"^\s+(\d+)\s+(waiting .*|not in call .*|no record.*)$", err, re.M)}
    assert err.count("hpcnn: hang:") == 1, err                      # one table, printed once
    assert sorted(rows) == list(range(n)), err
    return rows, err, log


def test_dp_rank_skipping_its_gradient_allreduce_is_named(hung_runs):
    from hpcnn.log.runlog import read_run
    rows, err, log = _hung_run(hung_runs, "dp")
    assert rows[0].startswith("waiting") and "wait iallreduce" in rows[0] and " dp " in rows[0]
    assert "wait iallreduce" not in rows[1], err           # rank 1 went on to the next call
    run = read_run(str(log))
    assert run.status == "failed" and run.plan["failure"].startswith("hang: ranks [0")


def test_tp_rank_that_never_enters_its_allreduce_is_named(hung_runs):
    rows, err, _ = _hung_run(hung_runs, "tp")
    assert rows[0].startswith("waiting") and "allreduce" in rows[0] and " tp " in rows[0]
    assert rows[1].startswith("not in call"), err
    assert "ranks [1] are in no communication call" in err


@pytest.mark.long
def test_pp_rank_skipping_its_send_leaves_its_peer_in_irecv(long_hung_runs):
    rows, err, _ = _hung_run(long_hung_runs, "pp")
    # rank 1 skipped a send: its pipeline peer waits for it in irecv, rank 1 in its own next
    # irecv, and the other pipeline's ranks in the data-parallel allreduce that pairs them
    assert {r for r in rows if re.match(r"waiting\s+\d+\s+wait irecv\s+pp ", rows[r])} == \
        {1, 3}, err
    assert {r for r in rows if re.match(r"waiting\s+\d+\s+allreduce\s+dp ", rows[r])} == \
        {0, 2}, err


@pytest.mark.long
def test_rank0_that_never_enters_a_call_still_reports(long_hung_runs):
    rows, err, _ = _hung_run(long_hung_runs, "rank0")
    assert rows[0].startswith("not in call"), err
    assert rows[1].startswith("waiting") and " tp " in rows[1], err   # rank 0's tp peer


def test_hot_paths_record_and_skip_under_mpi():
    from mpi_util import run_mpi
    assert "watchdog_record OK on 2 ranks" in run_mpi("watchdog_record", 2, timeout=120)
