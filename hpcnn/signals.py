"""Ending a run on a signal: every rank at the same step, the log closed, no collective left open.

Two kinds of signal end a run:

* an *interrupt*, SIGINT (Ctrl-C) or SIGTERM: the run stops at the next step boundary every rank
  agrees on, flushes its log rows and closes the log with status ``"interrupted"``; the process
  exits with 128 + the signal's number;
* the *stop signal* (``--stop_signal``, default SIGUSR1; Slurm's ``--signal=USR1@120`` and
  PBS's ``kill -USR1`` send it before the time limit): the run stops at the next agreed step
  boundary, writes a checkpoint there (if ``--checkpoint`` is set) and closes the log with status
  ``"stopped"``; the process exits with 0, so that a job script can resume from the checkpoint.

Why a flag and not an exception: MPICH's ``mpiexec`` forwards SIGINT, SIGTERM and SIGUSR1 to
every rank, but each rank receives it somewhere else: inside a collective, between two, in the
optimizer. Python runs a handler only between bytecodes, so a rank blocked in an MPI call sees
nothing until the call returns; a ``KeyboardInterrupt`` raised on the others sends them into
cleanup that is collective (freeing the shared-memory window, gathering the log rows), where
they wait for a rank still waiting in the step's allreduce: every rank spins until killed. Here
the handler only records the signal; the step runs to its end on every rank, and at each step
boundary :meth:`StopSignals.poll` learns whether any rank has seen one (MAX over the world of
each rank's flag, a 4-byte ``Iallreduce`` on a communicator of its own, started at one boundary
and completed at the next, so it overlaps a step and costs no synchronisation of its own). All
ranks thus read the same answer at the same boundary, even when the signal reached only some of
them or at different times, and stop together at most two steps after the signal.

A second interrupt ends the process at once (exit status 128 + the signal), and so does a first
one that is not honoured within :data:`GRACE_SECONDS` (a step that long, or a rank stuck in a
collective because a peer is gone): the log then stays ``"running"`` with every flushed row,
as after a kill.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import numpy

from hpcnn.parallel.collectives import as_communicator

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
STOP_SIGNALS = ("USR1", "USR2", "none")        # --stop_signal's choices
NONE, STOP, INTERRUPT = 0, 1, 2                # flags, by priority (reduced with MAX)
STATUS = {STOP: "stopped", INTERRUPT: "interrupted"}
GRACE_SECONDS = 10.0


class StopSignals:
    """Signal handlers for one run and the agreement on when to stop (collective: make it on
    every rank of ``comm``: a Communicator, an MPI communicator, or None for a serial run).

    Handlers are installed only from the main thread and restored by :meth:`close`.
    """

    def __init__(self, comm, stop_signal: str = "USR1"):
        self.local = NONE              # what this rank has seen
        self.signum = 0                # the interrupt seen first (for the exit status)
        self.agreed = NONE             # what every rank agreed on at the last boundary
        comm = as_communicator(comm, "signals")
        self.comm = comm.dup("signals") if comm is not None and comm.size > 1 else None
        self._send, self._recv = numpy.zeros(1, numpy.int32), numpy.zeros(1, numpy.int32)
        self._req, self._timer, self._saved = None, None, {}
        watched = list(INTERRUPTS)
        if stop_signal != "none":
            watched.append(getattr(signal, "SIG" + stop_signal))
        if threading.current_thread() is threading.main_thread():
            for s in watched:
                self._saved[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum not in INTERRUPTS:
            self.local = max(self.local, STOP)
            return
        if self.local == INTERRUPT:                      # the second one: end now
            self._die(signum, "a second interrupt")
        self.local, self.signum = INTERRUPT, signum
        self._timer = threading.Timer(GRACE_SECONDS, self._die,
                                      (signum, f"not honoured at a step boundary within "
                                               f"{GRACE_SECONDS:g} s"))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _die(signum, why: str) -> None:
        """End the process at once with 128 + ``signum`` (no cleanup, no collective; from the
        timer's thread too, where the signal's disposition cannot be changed)."""
        print(f"hpcnn: {signal.Signals(signum).name}, {why}: ending this rank now",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def poll(self) -> int:
        """At a step boundary, on every rank: the flag every rank agrees on (the MAX of all
        ranks' flags as they were at the previous boundary; serial: this rank's flag now).
        Returns :data:`NONE`, :data:`STOP` or :data:`INTERRUPT`, the same on every rank."""
        if self.comm is None:
            self.agreed = self.local
            return self.agreed
        if self._req is not None:       # flag * 256 + interrupt number: every rank exits alike
            self._req.wait()
            self.agreed, signum = divmod(int(self._recv[0]), 256)
            self.signum = signum if self.agreed == INTERRUPT else self.signum
        self._send[0] = self.local * 256 + self.signum
        self._req = self.comm.ireduce_max(self._send, self._recv)
        return self.agreed

    @property
    def status(self) -> str:
        """The run log's status for the agreed flag ("" when no signal stopped the run)."""
        return STATUS.get(self.agreed, "")

    def exit_code(self) -> int:
        """What the process should exit with: 128 + the interrupt's number, 0 otherwise."""
        return 128 + (self.signum or signal.SIGINT) if self.agreed == INTERRUPT else 0

    def close(self, collective: bool = True) -> None:
        """Restore the handlers; complete the pending agreement and free its communicator when
        ``collective`` (every rank is here: a run that ended normally or by agreement), else
        leave them (a rank that failed alone must not wait for the others)."""
        for s, h in self._saved.items():
            signal.signal(s, h)
        self._saved = {}
        if self._timer is not None:
            self._timer.cancel()
        if self.comm is not None and collective:
            if self._req is not None:
                self._req.wait()
            self.comm.free()
        self.comm = self._req = None
