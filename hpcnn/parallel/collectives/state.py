"""What the allreduce algorithms of one Communicator share: :class:`Collectives`.

Every :class:`~.comm.Communicator` holds one, ``comm.collectives``,
made with it. The algorithm modules (:mod:`.algorithms`, :mod:`.ring`, :mod:`.shm`, :mod:`.cma`)
read and write the algorithms' state here and nowhere else; the Communicator itself reads only
what its hot paths need (:attr:`Collectives.iauto_mpi_below`, the bound :attr:`Collectives.fast`).
The state:

- what ``auto`` chooses: the table (:attr:`Collectives.table`, set by calibration), its compiled
  form (:attr:`Collectives.lookup`) and the sizes below which ``auto`` is the library's
  Allreduce (blocking, :attr:`Collectives.auto_mpi_below`; non-blocking,
  :attr:`Collectives.iauto_mpi_below`);
- the :class:`Workspace` made on first use by an algorithm: a private duplicate of the MPI
  communicator and its tag counter, scratch buffers, the shared-memory node of :mod:`.shm` (its
  windows, the :func:`~.shm.zeros` arrays) and the peers' process ids
  of :mod:`.cma`;
- the hot path of ``allreduce`` bound to this communicator (:meth:`Collectives.bind_allreduce`):
  the C module's ``Lean`` when it is built (:mod:`.lean_build`), else a Python closure.
"""
from __future__ import annotations

import time

import numpy

from hpcnn import backend
from hpcnn.parallel.collectives.mpi_base import _mpi
from hpcnn.parallel.collectives.stats import SAMPLE_EVERY, SAMPLED_BELOW, _c_lean
from hpcnn.parallel.collectives.watchdog import _calls, _fault, record_in

_TAGS = 30000               # MPI guarantees tags up to 32767
_perf = time.perf_counter
_ndarray = numpy.ndarray


class Workspace:
    """The algorithms' MPI resources for one communicator, made on first use (collective: Dup):
    the private communicator and tag counter, scratch buffers, the shared-memory node (made by
    :func:`.shm.node_of`) and the cma peers (:mod:`.cma`)."""

    def __init__(self, mpi_comm):
        self.pcomm, self.seq = mpi_comm.Dup(), 0
        self.scratch, self.pool = {}, []    # dtype -> array for blocking calls; free arrays
        self.node = None                    # shm.Node, or False when the ranks span several nodes
        self.cma_pids = None                # cma: the peers' process ids ([]: refused), once known
        self.levels = None                  # hier.Levels, or False where it does not apply

    def tag(self) -> int:
        self.seq += 1
        return 1 + self.seq % _TAGS

    def blocking_scratch(self, dtype, n):
        a = self.scratch.get(dtype)
        if a is None or a.size < n:
            a = self.scratch[dtype] = backend.xp.empty(max(n, 1), dtype)
        return a[:n]

    def take(self, dtype, n):
        for i, a in enumerate(self.pool):
            if a.dtype == dtype and a.size >= n:
                return self.pool.pop(i)
        return backend.xp.empty(max(n, 1), dtype)

    def free(self) -> None:
        """Free the shared windows, the levels and the private communicator (collective)."""
        if self.node:
            self.node.free()
        if self.levels:
            self.levels.free()
        self.pcomm.Free()


class Collectives:
    """The shared state of the allreduce algorithms of ``comm`` (a Communicator; see the module
    docstring). Made by the Communicator; nothing here is collective but :meth:`get_workspace`
    and :meth:`free`."""

    def __init__(self, comm):
        self.comm = comm
        self.workspace = None               # Workspace, made by get_workspace()
        self.fast = None                    # allreduce's hot path, once bound (more than 1 rank)
        self.iauto_mpi_below = 0            # iallreduce "auto" is "mpi" below this (once known)
        self._below = [0]                   # allreduce "auto" is "mpi" below _below[0]; a list
        self.table = None                   # so that the Python hot path reads it by reference

    # -- what "auto" chooses ------------------------------------------------------------------
    @property
    def table(self):
        """The table ``auto`` reads (``{"sizes": [...], "choice": [...]}``) or None (the
        defaults of :func:`~.algorithms.default_table`)."""
        return self._table

    @table.setter
    def table(self, table) -> None:
        self._table = table
        self.lookup = None                  # compiled on the next "auto" call
        self.set_auto_mpi_below(0)

    @property
    def auto_mpi_below(self) -> int:
        """Blocking ``auto`` runs the library's Allreduce below this many bytes (0: not known
        yet, every ``auto`` call goes through the algorithm choice)."""
        return self._below[0]

    def set_auto_mpi_below(self, nbytes: int, private_below: int = 0, shared_ranges=()) -> None:
        """Let the hot path run blocking ``auto`` as the library's Allreduce below ``nbytes``;
        the C path also below ``private_below`` for a buffer outside ``shared_ranges`` ((start,
        stop) addresses of the shared windows, which may take shm's zero-copy path)."""
        self._below[0] = nbytes
        fast = self.fast
        if hasattr(fast, "auto_below"):     # the C path keeps its own copies
            fast.auto_below = nbytes
            fast.private_below = private_below
            fast.shared = list(shared_ranges)

    def forget_auto(self) -> None:
        """Recompute ``auto``'s choices on the next call (shared arrays were made)."""
        self.lookup = None
        self.set_auto_mpi_below(0)
        self.iauto_mpi_below = 0

    # -- the algorithms' MPI resources ----------------------------------------------------------
    def get_workspace(self) -> Workspace:
        """The :class:`Workspace`, made on first use (collective: duplicates the communicator)."""
        ws = self.workspace
        if ws is None:
            ws = self.workspace = Workspace(self.comm.comm)
        return ws

    def free(self) -> None:
        """Free the workspace (collective); it is made again on next use."""
        if self.workspace is not None:
            self.workspace.free()
            self.workspace = None

    # -- the hot path ---------------------------------------------------------------------------
    def bind_allreduce(self, general, counter, name: str = ""):
        """The hot path of ``Communicator.allreduce``, bound to ``counter`` (the communicator's
        allreduce counter), kept as :attr:`fast` and returned; ``general`` (the method itself)
        handles every call the hot path does not.

        A NumPy buffer reduced by the library (``mpi``, or ``auto`` below
        :attr:`auto_mpi_below`) costs a type and a size check, two counter increments and the
        bound ``Allreduce`` (timed one call in ``SAMPLE_EVERY`` below ``SAMPLED_BELOW`` bytes).
        The C module's ``Lean`` when built (and ``counter`` is its ``Counter``), else a closure
        over the bound ``Allreduce``, constants and counter (cell loads instead of attribute
        loads: about half the per-call cost of a method). The difference matters only next to
        a bare ``Allreduce`` of a few KiB (~3-5 us here). Both record each call they make
        for the hang watchdog (:mod:`.watchdog`) as made on the communicator ``name``, and
        hand every call to ``general`` while its test-only fault is armed."""
        lean, mpi_comm = _c_lean(), self.comm.comm
        if lean is not None and type(counter) is lean.Counter:
            fast = lean.Lean(mpi_comm, counter, general, _ndarray, SAMPLED_BELOW, SAMPLE_EVERY)
            record_in(fast, name)
        else:
            fast = _python_allreduce(mpi_comm.Allreduce, counter, self._below, general, name)
        self.fast = fast
        self.set_auto_mpi_below(self._below[0])
        return fast


def _python_allreduce(Allreduce, c, lim, general, name=""):
    """The hot path written in Python (see :meth:`Collectives.bind_allreduce`); the watchdog's
    record written out (:func:`.watchdog.enter` and ``leave``: two calls fewer)."""
    MPI = _mpi()
    IN_PLACE, SUM, ndarray = MPI.IN_PLACE, MPI.SUM, _ndarray
    sampled, every = SAMPLED_BELOW, SAMPLE_EVERY - 1
    rec, fault = _calls, _fault

    def allreduce(buf, algorithm: str = "mpi"):
        if type(buf) is ndarray and fault[0] is None:
            n = buf.nbytes
            if algorithm == "mpi" or algorithm == "auto" and n < lim[0]:
                c.calls += 1
                c.raw += n
                prev = rec[1]
                seq = rec[0] = rec[0] + 1
                rec[1] = (seq, "allreduce", name, -1, n)
                try:
                    if n < sampled and c.calls & every:
                        Allreduce(IN_PLACE, buf, SUM)              # untimed (sampled)
                        return buf
                    t = _perf()
                    Allreduce(IN_PLACE, buf, SUM)
                    c.seconds += (_perf() - t) * (every + 1 if n < sampled else 1)
                    return buf
                finally:
                    rec[2] = rec[1]
                    rec[1] = prev
        return general(buf, algorithm)
    allreduce.__doc__ = general.__doc__
    return allreduce
