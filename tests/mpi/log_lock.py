"""A run whose log another run locked after the checks: every rank stops alike, none hangs.

    mpiexec -n 2 python -m mpi4py tests/mpi/log_lock.py RUN.h5

The test wrote a lock held by another host's pid 4242 next to RUN.h5. The checks before MPI
(hpcnn.preflight) would refuse the run; they are skipped here (``_log_errors`` returns nothing),
as when the other run takes the lock between them and rank 0 creating the log. Rank 0 then
fails to take the lock, and every rank must raise the same ConfigError naming the path and the
holder, at the same point, before any step.
"""
import sys

from mpi4py import MPI

from hpcnn import preflight
from hpcnn.config import ConfigError, parse_overrides
from hpcnn.train import train

path = sys.argv[1]
preflight._log_errors = lambda cfg: []
cfg = parse_overrides(["--model=mlp", "--dp=2", "--steps=2", "--progress=false", f"--log={path}"])
try:
    train(cfg, comm=MPI.COMM_WORLD)
except ConfigError as e:
    assert path in str(e) and "pid 4242" in str(e) and "host elsewhere" in str(e), str(e)
    print(f"rank {MPI.COMM_WORLD.Get_rank()} refused")
else:
    raise AssertionError("the run was not refused")
