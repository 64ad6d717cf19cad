"""Collectives: the Communicator and the allreduce engine behind it.

This package owns every call to MPI that the parallel layers and the training loop make: the
:class:`Communicator` (named, counted collectives on one MPI communicator, small-object
collectives, and :meth:`Communicator.single`, a one-rank communicator without MPI for serial
runs), the allreduce algorithms and their choice (:mod:`.algorithms`: segmented ring and
recursive doubling in :mod:`.ring`, intra-node shared memory in :mod:`.shm`, cross-memory attach
in :mod:`.cma`), their shared state (:class:`~.state.Collectives`, one per Communicator, as
``comm.collectives``), the saved calibration of ``auto`` (:mod:`.autotune`), the counters
(:class:`CommStats`, :mod:`.stats`), what they all need from mpi4py (:mod:`.mpi_base`) and the
optional C fast path of ``allreduce`` (``_lean.c``, built by :mod:`.lean_build`).

Importing it does not import mpi4py: MPI is loaded on the first call that needs it.

    from hpcnn.parallel.collectives import Communicator
    comm = Communicator.single()                 # serial; Communicator(MPI.COMM_WORLD) under MPI
"""
from hpcnn.parallel.collectives.comm import Communicator, SelfCommunicator, library_version
from hpcnn.parallel.collectives.mpi_base import Request
from hpcnn.parallel.collectives.stats import CommStats

__all__ = ["Communicator", "SelfCommunicator", "CommStats", "Request", "as_communicator",
           "library_version", "world"]


def world(name: str = "world") -> Communicator:
    """A Communicator over every rank of the job (``MPI_COMM_WORLD``; imports mpi4py)."""
    from hpcnn.parallel.collectives.mpi_base import _mpi
    return Communicator(_mpi().COMM_WORLD, name=name)


def as_communicator(comm, name: str = "comm"):
    """``comm`` as a :class:`Communicator`: itself if it is one, None if None (callers keep their
    serial path), else a Communicator over the ``mpi4py`` communicator given."""
    if comm is None or isinstance(comm, Communicator):
        return comm
    return Communicator(comm, name=name)
