"""Hang diagnosis: every blocking communication call is recorded; a watchdog thread reports a rank
stuck in one for longer than ``hpcnn train --hang_timeout`` and aborts the job.

A rank that enters a different collective than its peers (or none) leaves them waiting forever.
To say which rank waits where, each process keeps, in module state, its **current call**: a tuple
(sequence number, kind, communicator name, peer, bytes), set by :func:`enter` and cleared by
:func:`leave` at one choke point per kind (the :class:`~.comm.Communicator` methods, its
allreduce hot path, the waits of the requests of :mod:`.mpi_base`, :mod:`.ring` and :mod:`.shm`),
and its **last call**. Non-blocking starts (``isend``, ``irecv``, ``iallreduce``) are recorded by
:func:`started` as a last call only: it is their ``wait`` that blocks. A record reads no clock and
costs little enough to stay always on (``benchmarks/watchdog_overhead.py``;
docs/results/collectives.md).

The :class:`Watchdog` is a daemon thread (mpi4py releases the GIL inside blocking MPI calls). It
polls the current call and times it from when it first saw its sequence number; only time spent
*inside* a communication call counts. When the call has lasted more than the timeout, or another
rank's has, it writes this rank's record as a small JSON file in a **side channel**: a directory
rank 0 named and broadcast at start (:func:`side_channel`, next to the run log), so that no MPI is
needed on the stuck communicators. Rank 0 (or, if it does not answer within a grace period, the
first rank to claim the report) gathers the files. If some rank is still in its call after more
than the timeout, it prints one table (which rank waits in which call since when), runs the
``on_hang`` callback (rank 0: the run log marked "failed" with the ranks in a call, and which of
them for more than the timeout: never none; given at most two seconds) and calls ``MPI_Abort``
on ``MPI.COMM_WORLD``. Otherwise the call that lasted too long has returned meanwhile: no hang,
nothing is printed, and the reporter removes the side channel, so that every rank watches
afresh.

A test-only fault hook, ``HPCNN_FAULT=skip_collective:rank=R:step=S`` (optionally ``:kind=K``),
read once by :func:`arm_fault`, makes rank R skip its first recorded call (of kind K) from step S
on (:func:`at_step` is told each step): the hang this module diagnoses, on purpose.
``stall_collective:...`` instead stops rank R before that call for good, and
``raise_error:rank=R:step=S`` raises a RuntimeError on rank R when step S starts (a rank that
fails alone). Never set it outside tests.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from hpcnn import to_stderr

_now = time.monotonic

# [sequence number of the last call, current call or None, last call or None]; a call is
# (seq, kind, communicator, peer, bytes)
_calls = [0, None, None]
_fault = [None]             # the armed fault: {"rank", "step", "kind"}, once its step has come
_pending = [None]           # the fault read from HPCNN_FAULT, waiting for its step
SKIP = object()             # what enter/started return when the fault hook skips the call


def enter(kind: str, comm: str, peer: int, nbytes: int):
    """Record the start of a blocking call; returns what :func:`leave` restores (the enclosing
    call, or None), or :data:`SKIP` when the test-only fault hook makes this rank skip it."""
    c = _calls
    prev = c[1]
    seq = c[0] = c[0] + 1
    c[1] = (seq, kind, comm, peer, nbytes)
    if _fault[0] is not None and _fires(kind):
        c[0], c[1] = seq - 1, prev          # as if the call were not in this rank's code
        return SKIP                         # (stall_collective does not return)
    return prev


def leave(prev) -> None:
    """Record the end of the current call (``prev``: what :func:`enter` returned)."""
    c = _calls
    c[2] = c[1]
    c[1] = prev


def started(kind: str, comm: str, peer: int, nbytes: int) -> bool:
    """Record a non-blocking start as the last call; True when the fault hook skips it."""
    if _fault[0] is not None and _fires(kind):
        return True
    c = _calls
    seq = c[0] = c[0] + 1
    c[2] = (seq, kind, comm, peer, nbytes)
    return False


def recorded_allreduce(general, comm: str):
    """``general(buf, algorithm)`` (``Communicator.allreduce``, what the hot path hands on)
    with its calls recorded, and skipped by an armed fault. The hot path records its own calls
    (:func:`record_in`; :func:`~.state._python_allreduce`), and hands every call to this one
    while a fault is armed."""
    def allreduce(buf, algorithm: str = "mpi"):
        prev = enter("allreduce", comm, -1, buf.nbytes)
        if prev is SKIP:
            return buf
        try:
            return general(buf, algorithm)
        finally:
            leave(prev)
    allreduce.__doc__ = general.__doc__
    return allreduce


def record_in(lean, comm: str) -> None:
    """Let the C hot path ``lean`` (:mod:`.lean_build`) record its calls here, as made on
    the communicator named ``comm``."""
    lean.record, lean.fault, lean.name = _calls, _fault, comm


def current_call():
    """This process's current call tuple, or None (not in a communication call)."""
    return _calls[1]


def last_call():
    """This process's last started or finished call tuple, or None."""
    return _calls[2]


# -- the test-only fault hook --------------------------------------------------------------------
def parse_fault(text: str) -> dict | None:
    """``skip_collective:rank=R:step=S[:kind=K]`` -> {"rank", "step", "kind"}; "" -> None; a
    ValueError naming the text otherwise."""
    if not text:
        return None
    what, *fields = text.split(":")
    keys = dict(f.split("=", 1) for f in fields if "=" in f)
    if what not in ("skip_collective", "stall_collective", "raise_error") or "rank" not in keys or "step" not in keys or \
            len(keys) != len(fields) or set(keys) - {"rank", "step", "kind"}:
        raise ValueError(f"HPCNN_FAULT={text!r}: expected skip_collective:rank=R:step=S[:kind=K], "
                         "stall_collective:... or raise_error:... (a test-only fault hook)")
    try:
        return {"rank": int(keys["rank"]), "step": int(keys["step"]), "kind": keys.get("kind"),
                "stall": what == "stall_collective", "raise": what == "raise_error"}
    except ValueError:
        raise ValueError(f"HPCNN_FAULT={text!r}: rank and step must be integers") from None


def arm_fault(rank: int, environ=os.environ) -> None:
    """Read ``HPCNN_FAULT`` once (test-only); keep it if it concerns ``rank``."""
    fault = parse_fault(environ.get("HPCNN_FAULT", ""))
    _pending[0] = fault if fault is not None and fault["rank"] == rank else None
    _fault[0] = None


def at_step(step: int) -> None:
    """The training loop starts ``step``: arm a pending fault whose step has come."""
    f = _pending[0]
    if f is not None and step >= f["step"]:
        _fault[0], _pending[0] = f, None
        if f["raise"]:
            _fault[0] = None
            raise RuntimeError(f"HPCNN_FAULT: rank {f['rank']} raises at step {step} "
                               "(test-only fault hook)")


def _fires(kind: str) -> bool:
    """True if the armed fault skips this call of ``kind``; a stall never returns."""
    f = _fault[0]
    if f["kind"] is not None and f["kind"] != kind:
        return False
    _fault[0] = None
    to_stderr(f"hpcnn: HPCNN_FAULT: rank {f['rank']} {'stalls before' if f['stall'] else 'skips'} "
              f"its {kind} call (step {f['step']}, test-only fault hook)")
    if f["stall"]:
        _calls[1] = None                    # in no call: only the peers wait
        while True:
            time.sleep(1.0)
    return True


# -- the side channel and the report ---------------------------------------------------------
def side_channel(log_path: str, world) -> str:
    """The job-unique directory of the watchdog's side channel, next to ``log_path``: chosen by
    rank 0 and broadcast on ``world`` (a Communicator) at start, created only on a hang."""
    name = None
    if world.rank == 0:
        name = os.path.join(os.path.dirname(os.path.abspath(log_path)),
                            f".hpcnn-hang-{os.getpid()}-{time.time_ns()}")
    return world.bcast_object(name, root=0)


def _record(rank: int, in_call, since: float | None) -> dict:
    """This rank's record: the current call (``in_call``, waited in since the wall time
    ``since``) or the last one."""
    call = in_call if in_call is not None else _calls[2]
    rec = {"rank": rank, "host": os.uname().nodename, "pid": os.getpid(),
           "in_call": in_call is not None, "written": time.time()}
    if call is not None:
        seq, kind, comm, peer, nbytes = call
        rec.update(seq=seq, kind=kind, comm=comm, peer=peer, nbytes=nbytes,
                   since=since if in_call is not None else None)
    return rec


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def read_records(directory: str) -> dict:
    """{rank: record} of the ``rank*.json`` files in ``directory`` (unreadable ones skipped)."""
    out = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for n in names:
        if n.startswith("rank") and n.endswith(".json"):
            try:
                with open(os.path.join(directory, n)) as f:
                    r = json.load(f)
                out[int(r["rank"])] = r
            except (OSError, ValueError, KeyError):
                pass
    return out


def table(records: dict, size: int, timeout: float, now: float | None = None) -> str:
    """The report: one line per rank of ``size``: where it waits (call, communicator, peer,
    bytes, since when and for how long) or that it is in no call (its last call), or that it
    left no record."""
    now = time.time() if now is None else now
    lines = [f"hpcnn: hang: a communication call lasted more than --hang_timeout={timeout:g} s; "
             "where each rank is:",
             f"{'rank':>4}  {'state':<12} {'seq':>7}  {'call':<18} {'comm':<10} {'peer':>4} "
             f"{'bytes':>10}  {'since':<8} {'waited':>8}"]
    for r in range(size):
        rec = records.get(r)
        if rec is None:
            lines.append(f"{r:>4}  {'no record':<12} (finished its run, or not responding)")
            continue
        state = "waiting" if rec["in_call"] else "not in call"
        if "kind" not in rec:
            lines.append(f"{r:>4}  {state:<12} (no communication call yet)")
            continue
        t = rec.get("since")
        since = time.strftime("%H:%M:%S", time.localtime(t)) if t is not None else "-"
        waited = f"{now - t:.1f}s" if t is not None else "-"
        peer = str(rec["peer"]) if rec["peer"] >= 0 else "-"
        lines.append(f"{r:>4}  {state:<12} {rec['seq']:>7}  {rec['kind']:<18} "
                     f"{rec['comm']:<10} {peer:>4} {rec['nbytes']:>10}  {since:<8} {waited:>8}")
    groups: dict = {}
    for r, rec in sorted(records.items()):
        if rec["in_call"]:
            groups.setdefault((rec["kind"], rec["comm"]), []).append(r)
    if len(groups) > 1:
        lines.append("ranks wait in different calls: " + "; ".join(
            f"{kind} on {comm}: ranks {rs}" for (kind, comm), rs in groups.items()))
    idle = [r for r in range(size) if r not in records or not records[r]["in_call"]]
    if idle:
        lines.append(f"ranks {idle} are in no communication call: they run on, finished, or "
                     "skipped the call their peers wait in")
    return "\n".join(lines)


class Watchdog:
    """The daemon thread that reports a hang and aborts the job (see the module docstring).

    ``rank``/``size``: this process in ``MPI.COMM_WORLD``; ``directory``: the side channel
    (:func:`side_channel`); ``timeout``: seconds inside one call that make a hang; ``on_hang``:
    called with the reason on the reporting rank before the abort (at most ``2`` s); ``abort``:
    ``abort(code)`` (default: ``MPI.COMM_WORLD.Abort``; :func:`for_run`: the run's world's);
    ``grace``: seconds the reporter waits for the others' records (default: a quarter of the
    timeout, 1-5 s)."""

    def __init__(self, rank: int, size: int, directory: str, timeout: float, on_hang=None,
                 abort=None, grace: float | None = None, out=None):
        self.rank, self.size, self.directory, self.timeout = rank, size, directory, timeout
        self.on_hang, self._abort, self.out = on_hang, abort, out
        self.grace = grace if grace is not None else min(5.0, max(1.0, timeout / 4))
        self.poll = min(0.5, max(0.02, timeout / 8))
        self._stop = threading.Event()
        self._written, self._written_seq = False, None   # the seq in this rank's file
        self._seen = None           # (seq, monotonic, wall time) of the call first seen current
        self.thread = threading.Thread(target=self._run, name="hpcnn-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def stop(self) -> None:
        """End the thread (the run is over, whatever way); a no-op if it never started."""
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * self.poll + 1)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _write_mine(self) -> None:
        """Write this rank's record (not if the reporter withdrew the side channel meanwhile:
        then the next poll tries again, if there is still cause)."""
        call = _calls[1]
        since = self._since(call)
        try:
            os.makedirs(self.directory, exist_ok=True)
            _write_json(self._path(f"rank{self.rank}.json"), _record(self.rank, call, since))
        except OSError:
            return
        self._written, self._written_seq = True, call[0] if call is not None else None

    def _since(self, call):
        """Wall time at which this thread first saw ``call`` (None: not in a call)."""
        if call is None:
            self._seen = None
            return None
        if self._seen is None or self._seen[0] != call[0]:
            self._seen = (call[0], _now(), time.time())
        return self._seen[2]

    def _claim(self) -> bool:
        """True for the one rank that reports (an exclusive create of ``report``)."""
        try:
            os.close(os.open(self._path("report"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except OSError:             # another rank's claim, or the side channel withdrawn
            return False

    def _run(self) -> None:
        hung_at = None              # when this rank wrote its record
        while not self._stop.wait(self.poll):
            call = _calls[1]
            self._since(call)
            stuck = call is not None and _now() - self._seen[1] > self.timeout
            seen = os.path.isdir(self.directory)
            if self._written and not seen:      # the reporter withdrew it: no hang after all
                self._written, hung_at = False, None
            if (stuck or seen) and not self._written:
                self._write_mine()
                hung_at = _now() if self._written else None
            elif self._written and (call[0] if call is not None else None) != self._written_seq:
                self._write_mine()  # moved on since: keep the record current
            if hung_at is None:
                continue
            # rank 0 reports at once; another rank only if nobody did within the grace period
            if (self.rank == 0 or _now() - hung_at > 2 * self.grace) and self._claim():
                if self._report():
                    return
                self._written, hung_at = False, None

    def _report(self) -> bool:
        """Gather the records (the grace period at most), then, if some rank has waited in its
        current call for more than the timeout, print the table, run ``on_hang`` with the ranks
        in a call (and those of them stuck that long) and abort (True); else nobody is stuck any
        more (the call that lasted too long returned): withdraw the side channel, so that every
        rank watches afresh, and report nothing (False)."""
        deadline = _now() + self.grace
        while _now() < deadline and len(read_records(self.directory)) < self.size:
            time.sleep(min(0.05, self.poll))
        self._write_mine()
        records, now = read_records(self.directory), time.time()
        waiting = sorted(r for r, rec in records.items() if rec["in_call"])
        stuck = [r for r in waiting if now - (records[r].get("since") or now) > self.timeout]
        if not stuck:
            shutil.rmtree(self.directory, ignore_errors=True)
            return False
        text = table(records, self.size, self.timeout, now) + f"\n(records in {self.directory})"
        print(text, file=self.out or sys.stderr, flush=True)
        reason = (f"hang: ranks {waiting} wait in a communication call, ranks {stuck} for more "
                  f"than --hang_timeout={self.timeout:g} s; " + "; ".join(
                      f"rank {r} in {records[r].get('kind')} on {records[r].get('comm')}"
                      for r in waiting))
        if self.on_hang is not None:    # e.g. the run log marked failed; never blocks the abort
            t = threading.Thread(target=self._safe_on_hang, args=(reason,), daemon=True)
            t.start()
            t.join(timeout=2.0)
        if self._abort is not None:
            self._abort(3)
        else:                           # pragma: no cover - ends the process
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(3)
        return True

    def _safe_on_hang(self, reason: str) -> None:
        try:
            self.on_hang(reason)
        except Exception as e:          # the abort goes on; say why the log was not marked
            to_stderr(f"hpcnn: hang: could not mark the run log failed: {e}")


def for_run(timeout: float, log_path: str, world, log=None) -> Watchdog | None:
    """The watchdog of a training run on ``world`` (a Communicator), started; None on one rank
    or with ``timeout`` 0. Collective: agrees on the side channel. Arms ``HPCNN_FAULT``.
    ``log``: rank 0's :class:`~hpcnn.log.RunLog`, closed as "failed" with the reason on a
    hang."""
    arm_fault(world.rank)
    if world.size == 1 or timeout <= 0:
        return None
    directory = side_channel(log_path, world)

    def mark_failed(reason: str) -> None:
        log.set_plan({"failure": reason})
        log.close(status="failed")
    return Watchdog(world.rank, world.size, directory, timeout, abort=world.comm.Abort,
                    on_hang=mark_failed if log is not None else None).start()
