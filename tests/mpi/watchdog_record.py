"""The allreduce hot paths (C when built, and Python) record each call for the watchdog, and an
armed fault hands the call to the recorded general path, which skips it.

    mpiexec -n 2 python -m mpi4py tests/mpi/watchdog_record.py
"""
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.parallel.collectives import CommStats, Communicator, stats, watchdog

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
c_path = Communicator(world.Dup(), CommStats(), "cpath")
saved, stats._LEAN = stats._LEAN, False                   # force the Python closure
py_path = Communicator(world.Dup(), CommStats(), "pypath")
stats._LEAN = saved
for comm in (c_path, py_path):
    buf = np.ones(3)
    seq = watchdog._calls[0]
    none_refs = sys.getrefcount(None)
    for _ in range(1000):
        comm.allreduce(buf)
    assert abs(sys.getrefcount(None) - none_refs) < 50, "records leak references"
    assert watchdog.current_call() is None
    assert watchdog.last_call() == (seq + 1000, "allreduce", comm.name, -1, 24), \
        watchdog.last_call()
    comm.allreduce(np.ones(2, np.complex128))                 # the general path records too
    assert watchdog.last_call()[1:] == ("allreduce", comm.name, -1, 32), watchdog.last_call()
    # a fault armed on rank 1: its next allreduce is skipped (rank 0 gets only its own ones)
    watchdog.arm_fault(rank, {"HPCNN_FAULT": "skip_collective:rank=1:step=0:kind=allreduce"})
    watchdog.at_step(0)
    buf = np.ones(4)
    if rank == 1:
        comm.allreduce(buf)
        np.testing.assert_array_equal(buf, np.ones(4))       # skipped: untouched
    comm.allreduce(buf)                                        # paired with rank 0's call
    assert watchdog._fault[0] is None
if rank == 0:
    print(f"watchdog_record OK on {p} ranks (C path: {type(c_path.allreduce).__name__})")
