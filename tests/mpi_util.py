"""Run a multi-rank scenario under mpiexec from inside pytest, with a timeout.

A scenario is a script under tests/mpi/ that asserts on every rank and exits non-zero on failure;
it is launched as ``mpiexec -n N python -m mpi4py tests/mpi/<name>.py [args]`` so that an exception
on one rank aborts the whole job, and the timeout turns a deadlock into a failed test.
"""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mpiexec() -> str:
    """The mpiexec next to this Python (the MPICH wheel's), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = local if os.path.exists(local) else shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec found: install the 'localmpi' extra or a system MPI")
    return found


def run_mpi(scenario: str, n: int, *args, timeout: float = 120, env=None) -> str:
    """Run tests/mpi/<scenario>.py on ``n`` ranks; return stdout, fail the test on error/timeout."""
    cmd = [mpiexec(), "-n", str(n)]
    if "Open MPI" in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout:
        cmd += ["--oversubscribe", "--allow-run-as-root"]
    # a shared window kept at free() because an array still uses it is a leak: fail the scenario
    cmd += [sys.executable, "-W", "error:shm:ResourceWarning", "-m", "mpi4py",
            os.path.join(HERE, "mpi", scenario + ".py"), *map(str, args)]
    e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{scenario} on {n} ranks timed out after {timeout}s (deadlock?)\n"
                    f"{exc.stdout or ''}{exc.stderr or ''}")
    if p.returncode != 0:
        pytest.fail(f"{scenario} on {n} ranks failed (exit {p.returncode})\n"
                    f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}")
    return p.stdout


def single(name: str = "self"):
    """A Communicator of one rank without MPI (:meth:`Communicator.single`)."""
    from hpcnn.parallel.collectives import Communicator
    return Communicator.single(name)
