"""Grade lab 8 (a hang) on 4 ranks: the watchdog's report read, the mismatched collective fixed,
the deadlocked pipeline schedule found.

    python labs/08-hang/grade.py [FILE]    # default: student.py beside this file

Part A. Every rank runs the README's buggy step (``buggy_global_grad_norm``, then the step's
closing barrier) with rank 3's gradients all zero, under hpcnn's watchdog (1 s timeout). Rank 3
skips the allreduce and waits in the barrier, the others in the allreduce. So that the job can
go on after the report, the calls are not made on MPI: each rank tells the watchdog it entered
the call (``watchdog.enter``, as hpcnn's communicator does) and waits there until the report is
out. The watchdog's records and its table are real; ``diagnose`` must name rank 3 and the
allreduce, and the apart ranks of a second, made-up report. The fixed ``global_grad_norm`` must
make the same calls on every rank (checked on a recording communicator first, so that a rank
left out is reported, not hung) and equal the serial norm to 1e-10.

Part B. ``blocked`` on valid schedules (hpcnn's GPipe, 1F1B, ZB-H1: nothing blocked), on 1F1B
whose stage 1 has no warm-up (the planted deadlock: hpcnn's validator must call it one, and
``blocked`` must say where every rank waits) and on a schedule missing a SEND. The report's
table and the verdicts go to the results file for plot.py.
"""
import math
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402

TITLE = "lab 8 (a hang)"
TIMEOUT = 1.0                  # the watchdog's, seconds
ZERO_RANK = 3                  # whose gradients are all zero
ERROR_HINT = "run the file on its own under mpiexec to see the whole traceback"
HANG_HINT = ("this is the lab's very bug: a rank skipped a collective its peers wait in; every "
             "rank must call comm.allreduce once in global_grad_norm")


class Released(Exception):
    """The emulated call returns: the report is out."""


def buggy_global_grad_norm(comm, grads):
    """The README's bug: a rank with nothing to add skips the allreduce."""
    local = sum(float((g * g).sum()) for g in grads)
    if local == 0.0:
        return 0.0
    return math.sqrt(comm.allreduce(local))


class Watched:
    """A communicator whose blocking calls are recorded by hpcnn's watchdog and wait, as stuck
    ranks do, until ``released`` (the report is out)."""

    def __init__(self, released):
        self.released = released

    def _stuck(self, kind, nbytes):
        from hpcnn.parallel.collectives import watchdog
        prev = watchdog.enter(kind, "world", -1, nbytes)
        try:
            while not os.path.exists(self.released):
                time.sleep(0.02)
        finally:
            watchdog.leave(prev)
        raise Released

    def allreduce(self, value):
        return self._stuck("allreduce", 8)

    def Barrier(self):
        return self._stuck("barrier", 0)


def grads_of(rank):
    rng = np.random.default_rng([4, rank])
    if rank == ZERO_RANK:
        return [np.zeros((3, 4)), np.zeros(4)]
    return [rng.standard_normal((3, 4)), rng.standard_normal(4)]


def hang_report(ck, comm):
    """The buggy step under the watchdog: (records, table) on rank 0, (None, None) elsewhere."""
    import io
    from hpcnn.parallel.collectives import watchdog
    ck.step("the watchdog's report of the buggy step")
    folder = comm.bcast(tempfile.mkdtemp(prefix="lab8-") if ck.rank == 0 else None)
    side, released, out = os.path.join(folder, "side"), os.path.join(folder, "released"), \
        io.StringIO()

    def release(code):
        open(released, "w").close()
    dog = watchdog.Watchdog(ck.rank, comm.Get_size(), side, TIMEOUT, abort=release,
                            out=out).start()
    wc = Watched(released)
    try:
        buggy_global_grad_norm(wc, grads_of(ck.rank))
        wc.Barrier()                                   # the step's end
    except Released:
        pass
    dog.stop()
    comm.Barrier()
    if ck.rank != 0:
        return None, None
    records = watchdog.read_records(side)
    import shutil
    shutil.rmtree(folder, ignore_errors=True)
    return records, out.getvalue()


def made_up_report():
    """A second report: rank 2 finished its step (in no call), rank 1 left no record, ranks 0
    and 3 wait in a broadcast."""
    base = {"host": "h", "pid": 1, "written": 0.0, "comm": "world", "peer": -1, "seq": 7}
    return {0: dict(base, rank=0, in_call=True, kind="bcast", nbytes=64, since=1.0),
            2: dict(base, rank=2, in_call=False, kind="allreduce", nbytes=8, since=None),
            3: dict(base, rank=3, in_call=True, kind="bcast", nbytes=64, since=1.0)}


def check_diagnose(ck, records, table):
    ck.step("diagnose")
    hint = ("the majority call is the (kind, comm) most ranks wait in (in_call true); every other "
            "rank, in another call, in none or without a record, is apart")
    got = ck.call("diagnose", records, ck.size)
    ck.equal("diagnose(the watchdog's records of the buggy step)", tuple(got),
             ([ZERO_RANK], "allreduce"), hint)
    got = ck.call("diagnose", made_up_report(), 4)
    ck.equal("diagnose(a report where rank 2 finished and rank 1 left no record)", tuple(got),
             ([1, 2], "bcast"), hint)
    if "ranks wait in different calls" not in table:
        ck.fail("the watchdog's table does not show the mismatch", "a grader problem: report it",
                "ranks wait in different calls", table)


class Counting:
    """A communicator that records the collectives called and answers as one rank would."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kw):
            self.calls.append(name)
            return args[0] if args else None
        return call


def check_norm(ck, comm):
    ck.step("global_grad_norm: the same calls on every rank")
    grads = grads_of(ck.rank)
    dry = Counting()
    ck.call("global_grad_norm", dry, [g.copy() for g in grads])
    every = comm.allgather(dry.calls)
    if any(c != every[0] for c in every):
        ck.fail("the ranks' collective calls in global_grad_norm differ: " + "; ".join(
                f"rank {r}: {c}" for r, c in enumerate(every)), HANG_HINT, every[0],
                every[ZERO_RANK])
    ck.step("global_grad_norm: the value")
    got = ck.call("global_grad_norm", comm, [g.copy() for g in grads])
    want = math.sqrt(sum(float((g * g).sum()) for r in range(ck.size) for g in grads_of(r)))
    ck.close("global_grad_norm", got, want, "the square root of the sum over ranks of each "
             "rank's sum of squares (not the sum of the ranks' norms)")


def reference_blocked(lists):
    """Eager sends, blocking receives: {rank: (position, op)} of the ranks that cannot finish."""
    from collections import Counter
    pc, sent, moved = [0] * len(lists), Counter(), True
    while moved:
        moved = False
        for r, lst in enumerate(lists):
            while pc[r] < len(lst):
                op = lst[pc[r]]
                key = (op.kind[5:], op.mb, op.stage)
                if op.kind.startswith("RECV"):
                    if not sent[key]:
                        break
                    sent[key] -= 1
                elif op.kind.startswith("SEND"):
                    sent[key] += 1
                pc[r] += 1
                moved = True
    return {r: (pc[r], lst[pc[r]]) for r, lst in enumerate(lists) if pc[r] < len(lst)}


def no_warmup_1f1b(S, M):
    """1F1B whose stage 1 starts its steady state at once (no warm-up): the planted deadlock."""
    from hpcnn.schedule.pipeline import _one_f_one_b_order, with_comm
    compute = [_one_f_one_b_order(s, S, M) for s in range(S)]
    compute[1] = [(k, mb, 1) for mb in range(M) for k in ("F", "B")]
    return with_comm(compute, S, S)


def schedule_cases(S, M):
    from hpcnn.schedule.pipeline import SCHEDULES
    missing = [list(lst) for lst in SCHEDULES["gpipe"](S, M, S)]
    missing[0] = [op for op in missing[0] if not (op.kind == "SEND_ACT" and op.mb == 2)]
    return [(name, SCHEDULES[name](S, M, S), False) for name in ("gpipe", "1f1b", "zb_h1")] + \
        [("1f1b, stage 1 without warm-up", no_warmup_1f1b(S, M), True),
         ("gpipe, rank 0 without SEND_ACT(mb=2)", missing, True)]


def check_blocked(ck):
    """``blocked`` against the reference on valid and deadlocked schedules; the rows to save."""
    from hpcnn.schedule.pipeline import validate
    S, M, rows = 4, 4, []
    for name, lists, deadlocked in schedule_cases(S, M):
        ck.step(f"blocked({name})")
        try:
            validate(lists, S, M, S)
            verdict = "valid"
        except ValueError as e:
            verdict = str(e)
        if deadlocked != ("deadlock" in verdict):
            ck.fail(f"hpcnn's validate on {name}: {verdict}", "a grader problem: report it")
        want = reference_blocked(lists)
        got = ck.call("blocked", lists)
        ck.equal(f"blocked({name})", {r: tuple(v) for r, v in dict(got).items()}, want,
                 "a SEND never waits (eager); a RECV waits until its SEND (same ACT/GRAD, mb, "
                 "stage) has run; keep moving every rank until none can; report every rank "
                 "that did not reach its end")
        rows += [{"case": name, "rank": r, "position": k, "op": str(op), "length": len(lists[r]),
                  "validate": verdict} for r, (k, op) in sorted(want.items())]
        rows += [{"case": name, "rank": r, "position": len(lists[r]), "op": "end",
                  "length": len(lists[r]), "validate": verdict}
                 for r in range(S) if r not in want]
    return rows


def checks(ck, comm, out):
    records, table = hang_report(ck, comm)
    if ck.rank == 0:
        check_diagnose(ck, records, table)
    comm.Barrier()
    check_norm(ck, comm)
    rows = check_blocked(ck)
    if ck.rank == 0:
        from hpcnn.log.results import save_table
        now = max(rec["written"] for rec in records.values())
        save_table(out, "report", [
            {"rank": r, "in_call": bool(rec["in_call"]), "kind": rec.get("kind", ""),
             "waited_s": now - rec["since"] if rec.get("since") else 0.0}
            for r, rec in sorted(records.items())], attrs={"timeout_s": TIMEOUT})
        save_table(out, "schedules", rows)
        ck.info("the watchdog's report of the buggy step (the README's bug):")
        for line in table.split("\n(records")[0].split("\n"):
            ck.info("  " + line)


if __name__ == "__main__":
    sys.exit(labkit.grade_main(__file__, TITLE, ranks=4, timeout=90, hang_hint=HANG_HINT))
