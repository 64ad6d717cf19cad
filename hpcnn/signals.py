"""Ending a run on a signal: every rank at the same step, the log closed, no collective left open.

Two kinds of signal end a run:

* an *interrupt*, SIGINT (Ctrl-C) or SIGTERM: the run stops at the next safe point every rank
  reaches (a step boundary, a round of evaluation batches, a chunk of a checkpoint being
  written), flushes its log rows and closes the log with status ``"interrupted"``; the process
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
the handler only records the signal; at each safe point :meth:`StopSignals.poll` learns whether
any rank has seen one (MAX over the world of each rank's flag, a 4-byte ``Iallreduce`` on a
communicator of its own), so all ranks read the same answer at the same point, even when the
signal reached only some of them or at different times. While steps are short (under
:data:`BLOCKING_STRETCH_S`) the reduction started at one safe point is completed at the next, so
it overlaps a step and costs no synchronisation, and the run stops one short step after the
first point every rank reaches; once they are longer it is completed at once (one rendezvous)
and the run stops at that first point. An interrupt abandons a checkpoint being written
(:func:`hpcnn.checkpoint.save`'s ``abandon``: the previous checkpoint kept).

A second interrupt ends the process at once, and so does a first one that is not honoured within
the grace period (:meth:`StopSignals.grace`: three times the longest stretch between two safe
points :meth:`StopSignals.poll` has measured, at least :data:`GRACE_SECONDS`; before one is,
the ``--hang_timeout``): a rank stuck in a collective because a peer is gone. Then ``last_words``
(the run's: rank 0 closes the log as ``"interrupted"`` with every row it holds and the reason)
runs before the exit with 128 + the signal, from a thread of its own, so that a write of the log
in progress on the main thread completes first. Already at the first interrupt ``first_words``
(rank 0: :meth:`hpcnn.log.runlog.RunLog.mark` flushes the log and sets ``"interrupted"``) runs
in a thread: a SIGKILL after the signal (hydra on a second Ctrl-C, Slurm after ``KillWait``)
cannot leave the log saying ``"running"``.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy

from hpcnn import to_stderr
from hpcnn.parallel.collectives import as_communicator

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
STOP_SIGNALS = ("USR1", "USR2", "none")        # --stop_signal's choices
NONE, STOP, INTERRUPT = 0, 1, 2                # flags, by priority (reduced with MAX)
STATUS = {STOP: "stopped", INTERRUPT: "interrupted"}
GRACE_SECONDS = 10.0        # the least grace (HPCNN_GRACE_SECONDS overrides it)
GRACE_FACTOR = 3.0          # the grace, in longest stretches between two safe points
BLOCKING_STRETCH_S = 0.1    # stretches longer than this: the agreement completed at once


def least_grace() -> float:
    """:data:`GRACE_SECONDS`, or ``HPCNN_GRACE_SECONDS`` when set (seconds)."""
    return float(os.environ.get("HPCNN_GRACE_SECONDS", GRACE_SECONDS))


def _noted(signum, frame) -> None:
    """The Python-level handler: nothing (the watching thread handles the signal)."""


class StopSignals:
    """Signal handlers for one run and the agreement on when to stop (collective: make it on
    every rank of ``comm``: a Communicator, an MPI communicator, or None for a serial run).
    ``first_grace``: the grace (s) before any stretch between two safe points is measured
    (:meth:`poll` measures them).

    Handlers are installed only from the main thread and restored by :meth:`close`.
    """

    def __init__(self, comm, stop_signal: str = "USR1", first_grace: float = 0.0):
        self.local = NONE              # what this rank has seen
        self.signum = 0                # the interrupt seen first (for the exit status)
        self.agreed = NONE             # what every rank agreed on at the last safe point
        self.longest = 0.0             # the longest stretch between two safe points (s)
        self.first_grace = float(first_grace)
        self.last_words = None         # f(why): run before the process ends on its own
        self.first_words = None        # f(): run on the first interrupt (rank 0: mark the log)
        comm = as_communicator(comm, "signals")
        self.comm = comm.dup("signals") if comm is not None and comm.size > 1 else None
        self._send, self._recv = numpy.zeros(1, numpy.int32), numpy.zeros(1, numpy.int32)
        self._req, self._blocking, self._since = None, False, None
        self._timer, self._saved, self._ending = None, {}, threading.Lock()
        self._wakeup = self._pipe = None
        watched = list(INTERRUPTS)
        if stop_signal != "none":
            watched.append(getattr(signal, "SIG" + stop_signal))
        if threading.current_thread() is threading.main_thread():
            self._watch(watched)

    def _watch(self, watched) -> None:
        """Handle ``watched`` in a thread of its own, woken by the signal's number written to
        a socket by the interpreter's C-level handler (``signal.set_wakeup_fd``): at once, also
        while the main thread waits in an MPI call or a BLAS kernel (both release the GIL),
        where a Python-level handler would run only when the call returns. The Python-level
        handlers are no-ops."""
        self._pipe = socket.socketpair()
        self._pipe[1].setblocking(False)
        self._wakeup = signal.set_wakeup_fd(self._pipe[1].fileno(), warn_on_full_buffer=False)
        for s in watched:
            self._saved[s] = signal.signal(s, _noted)
        numbers = set(int(s) for s in watched)

        def loop(sock=self._pipe[0]):
            while True:
                try:
                    got = sock.recv(64)
                except OSError:
                    return
                if not got:                     # closed by close()
                    return
                for signum in got:
                    if signum in numbers:
                        self._handle(signum, None)
        threading.Thread(target=loop, name="hpcnn-signals", daemon=True).start()

    def grace(self) -> float:
        """Seconds an interrupt waits to be honoured before the process ends on its own."""
        if self.longest == 0.0:
            return max(least_grace(), self.first_grace)
        return max(least_grace(), GRACE_FACTOR * self.longest)

    def interrupted(self) -> bool:
        """True once this rank has seen an interrupt (agreed or not)."""
        return self.local == INTERRUPT

    def _handle(self, signum, frame) -> None:
        if signum not in INTERRUPTS:
            self.local = max(self.local, STOP)
            return
        if self.local == INTERRUPT:                      # the second one: end now
            self._end_soon(signum, "a second interrupt")
            return
        self.local, self.signum = INTERRUPT, signum
        if self.first_words is not None:
            threading.Thread(target=self._quietly, args=(self.first_words,), daemon=True).start()
        grace = self.grace()
        self._timer = threading.Timer(grace, self._die,
                                      (signum, f"not honoured at a step boundary within "
                                               f"{grace:.3g} s"))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _quietly(f, *args) -> None:
        """``f(*args)``; an error in it is one line (it runs where nothing can catch it)."""
        try:
            f(*args)
        except BaseException as e:
            to_stderr(f"hpcnn: could not write the run log: {e}")

    def _end_soon(self, signum, why: str) -> None:
        """:meth:`_die` from a thread of its own: a write of the log in progress on the main
        thread (where this handler runs) completes before ``last_words`` writes it too."""
        threading.Thread(target=self._die, args=(signum, why), daemon=True).start()

    def _die(self, signum, why: str) -> None:
        """End the process at once with 128 + ``signum`` after ``last_words`` (no other cleanup,
        no collective; from the timer's thread too, where the signal's disposition cannot be
        changed). Only the first caller does it."""
        if not self._ending.acquire(blocking=False):
            return
        name = signal.Signals(signum).name
        to_stderr(f"hpcnn: {name}, {why}: ending this rank now")
        if self.last_words is not None:         # never keep a process that must end
            self._quietly(self.last_words, f"{name}, {why}")
        os._exit(128 + signum)

    def poll(self) -> int:
        """At a safe point, on every rank: the flag every rank agrees on. Returns :data:`NONE`,
        :data:`STOP` or :data:`INTERRUPT`, the same on every rank (serial: this rank's flag).

        Each call starts the MAX over the world of every rank's flag (a 4-byte ``Iallreduce``).
        While stretches between safe points are short, it is completed at the next call, so it
        overlaps the step and a signal is agreed one stretch later; once a rank reports a
        stretch longer than :data:`BLOCKING_STRETCH_S` (a bit carried by the same reduction,
        so that every rank switches at the same call), it is completed at once and a signal
        is agreed at the first safe point after it."""
        stretch = 0.0 if self._since is None else time.perf_counter() - self._since
        self.longest = max(self.longest, stretch)       # (the grace grows with the longest)
        slow = int(stretch > BLOCKING_STRETCH_S)
        if self.comm is None:
            self.agreed = self.local
            self._since = time.perf_counter()
            return self.agreed
        if self._req is not None:
            self._req.wait()
            self._read()
        self._send[0] = (self.local * 256 + self.signum) * 2 + slow    # every rank exits alike
        self._req = self.comm.ireduce_max(self._send, self._recv)
        if self._blocking:
            self._req.wait()
            self._req = None
            self._read()
        self._since = time.perf_counter()
        return self.agreed

    def _read(self) -> None:
        """Take the completed reduction: the agreed flag, the interrupt's number and whether
        the next calls complete it at once."""
        word = int(self._recv[0])
        self._blocking = bool(word & 1)
        self.agreed, signum = divmod(word >> 1, 256)
        self.signum = signum if self.agreed == INTERRUPT else self.signum

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
        if self._pipe is not None:
            signal.set_wakeup_fd(self._wakeup)
            for sock in self._pipe:               # the watching thread sees the end and returns
                sock.close()
            self._pipe = None
        if self._timer is not None:
            self._timer.cancel()
        if self.comm is not None and collective:
            if self._req is not None:
                self._req.wait()
            self.comm.free()
        self.comm = self._req = None
