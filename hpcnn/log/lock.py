"""One writer per file: the lock file ``<path>.lock`` (host, pid, start time, as JSON) of a run
log, and of a checkpoint path (``role`` and ``option`` name which, in the refusals).

:func:`acquire` creates it atomically (written under a temporary name, then ``os.link``, which
fails if the name exists), so of two runs started together on one log exactly one gets it. A lock
whose holder is a dead process on this host is stale: it is taken over with a note. A holder on
another host cannot be checked from here and counts as alive. :func:`refusal` is the same test
without taking anything, for the checks every rank makes before MPI starts
(:func:`hpcnn.preflight.check`).
"""
from __future__ import annotations

import json
import os
import socket
from datetime import datetime, timezone


class LogLockedError(FileExistsError):
    """The run log is being written by another run (the message names the path and the holder)."""


def lock_path(path: str) -> str:
    return os.fspath(path) + ".lock"


def holder(path: str) -> dict | None:
    """The lock's content (host, pid, start_time), ``{}`` if unreadable, None if there is none."""
    try:
        with open(lock_path(path)) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, killed but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _stale(who: dict) -> bool:
    return (who.get("host") == socket.gethostname() and isinstance(who.get("pid"), int)
            and not alive(who["pid"]))


def _describe(path: str, who: dict, role: str = "run log", option: str = "--log") -> str:
    if not who:
        return (f"{role} {path} is locked by {lock_path(path)}, which cannot be read; "
                f"remove it if no run writes this {role}")
    return (f"{role} {path} is being written by another run (host {who.get('host')}, "
            f"pid {who.get('pid')}, started {who.get('start_time')}); pass another {option}, or "
            f"remove {lock_path(path)} if that run is dead")


def refusal(path: str, role: str = "run log", option: str = "--log") -> str | None:
    """Why a run may not write ``path`` now (a live holder of its lock), or None."""
    who = holder(path)
    return None if who is None or _stale(who) else _describe(path, who, role, option)


def acquire(path: str, role: str = "run log", option: str = "--log") -> str | None:
    """Take the lock of ``path`` for this process; returns a note if a stale lock was taken over.

    Raises
    ------
    LogLockedError
        Another live run holds it.
    """
    path = os.fspath(path)
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "start_time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    tmp = f"{lock_path(path)}.{me['host']}.{me['pid']}"
    with open(tmp, "w") as f:
        f.write(json.dumps(me))
    note = None
    try:
        for _ in range(2):
            try:
                os.link(tmp, lock_path(path))
                return note
            except FileExistsError:
                who = holder(path)
                if who is None:
                    continue                      # released meanwhile: try again
                if not _stale(who):
                    raise LogLockedError(_describe(path, who, role, option)) from None
                note = (f"note: took over the stale lock {lock_path(path)} of pid {who['pid']} "
                        f"(no longer running on {who['host']})")
                os.unlink(lock_path(path))
        raise LogLockedError(_describe(path, holder(path) or {}, role, option))
    finally:
        os.unlink(tmp)


def release(path: str) -> None:
    """Remove the lock of ``path`` if this process holds it."""
    who = holder(path)
    if who and who.get("pid") == os.getpid() and who.get("host") == socket.gethostname():
        os.unlink(lock_path(path))
