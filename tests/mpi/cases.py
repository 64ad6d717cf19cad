"""Several scenarios (or one scenario with several argument lists) in one MPI job, so that the
ranks start up once (Python, NumPy, mpi4py, hpcnn, scikit-learn: about a second per rank) for
all of them rather than once each.

    mpiexec -n N python -m mpi4py tests/mpi/cases.py 'SCENARIO ARGS...' 'SCENARIO ARGS...' ...

Each case is a shell-quoted line: a scenario under tests/mpi/ and its arguments. It runs as that
script would alone (``__main__``, ``sys.argv`` = the script and its arguments, a fresh
namespace); then every rank meets at a barrier and rank 0 prints ``case K done``. An exception
aborts the whole job (``python -m mpi4py``), as in a run of the scenario alone, so the cases
after a failed one do not run: tests/mpi_util.py's :class:`~mpi_util.CaseRuns` tells each
case's test which case ended the job.
"""
import os
import runpy
import shlex
import sys

from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
cases = sys.argv[1:]
for k, line in enumerate(cases):
    scenario, *args = shlex.split(line)
    script = os.path.join(HERE, scenario + ".py")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"case {k} done", flush=True)
