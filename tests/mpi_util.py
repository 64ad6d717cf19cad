"""Run a multi-rank scenario under mpiexec from inside pytest, with a timeout.

A scenario is a script under tests/mpi/ that asserts on every rank and exits non-zero on failure;
it is launched as ``mpiexec -n N python -m mpi4py tests/mpi/<name>.py [args]`` so that an exception
on one rank aborts the whole job, and the timeout turns a deadlock into a failed test.
"""
import os
import shlex
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mpiexec() -> str:
    """The mpiexec next to this Python (the MPICH wheel's), else the one on PATH
    (:func:`hpcnn.scripts.mpiexec`)."""
    from hpcnn import scripts
    try:
        return scripts.mpiexec()
    except FileNotFoundError as e:
        pytest.fail(str(e))


def _launch(script: str, n: int, args, timeout: float, env=None) -> subprocess.CompletedProcess:
    """``mpiexec -n n python -m mpi4py tests/mpi/<script>.py args``; returncode None on a timeout."""
    from hpcnn import scripts
    cmd = [mpiexec(), "-n", str(n), *scripts.mpiexec_flags()]     # Open MPI: --oversubscribe
    # a shared window kept at free() because an array still uses it is a leak: fail the scenario
    cmd += [sys.executable, "-W", "error:shm:ResourceWarning", "-m", "mpi4py",
            os.path.join(HERE, "mpi", script + ".py"), *map(str, args)]
    e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(cmd, None, exc.stdout or "", exc.stderr or "")


def _output(p: subprocess.CompletedProcess) -> str:
    return f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"


def run_mpi(scenario: str, n: int, *args, timeout: float = 120, env=None) -> str:
    """Run tests/mpi/<scenario>.py on ``n`` ranks; return stdout, fail the test on error/timeout."""
    p = _launch(scenario, n, args, timeout, env)
    if p.returncode is None:
        pytest.fail(f"{scenario} on {n} ranks timed out after {timeout}s (deadlock?)\n"
                    f"{p.stdout}{p.stderr}")
    if p.returncode != 0:
        pytest.fail(f"{scenario} on {n} ranks failed (exit {p.returncode})\n{_output(p)}")
    return p.stdout


class CaseRuns:
    """Scenario runs that share one MPI job per world size (tests/mpi/cases.py): each rank
    starts up once for all of a test file's cases on that many ranks instead of once per case.

    ``cases`` lists ``(n, scenario, args)``; an argument equal to :attr:`FOLDER` stands for a
    fresh folder of the case's own under ``folder``. :meth:`stdout` launches every case with
    that ``n`` together the first time one of them is asked for, and fails the asking test,
    naming its case, if that case did not run through (its own failure, a timeout, or an
    earlier case in the job that ended it); else it returns what rank 0 printed during that
    case (where the scenario prints its OK line). ``timeout``: seconds per case (a job gets its cases' sum).
    """
    FOLDER = "<a folder of its own>"

    def __init__(self, cases, folder=None, timeout: float = 120):
        self.cases = [(n, scenario, tuple(map(str, args))) for n, scenario, args in cases]
        self.argv = []                          # the arguments as run, folders filled in
        for k, (n, scenario, args) in enumerate(self.cases):
            if self.FOLDER in args:
                case_dir = os.path.join(str(folder), f"case{k}-{scenario}")
                os.makedirs(case_dir)
                args = tuple(case_dir if a == self.FOLDER else a for a in args)
            self.argv.append(args)
        self.timeout, self._jobs = timeout, {}

    def stdout(self, n: int, scenario: str, *args) -> str:
        """Rank 0's stdout during the case ``(n, scenario, args)`` (as listed); fails the
        calling test if that case did not pass."""
        case = self.cases.index((n, scenario, tuple(map(str, args))))
        together = [k for k, c in enumerate(self.cases) if c[0] == n]
        if n not in self._jobs:
            lines = [shlex.join([self.cases[k][1], *self.argv[k]]) for k in together]
            self._jobs[n] = _launch("cases", n, lines, self.timeout * len(lines))
        p = self._jobs[n]
        position = together.index(case)
        if f"case {position} done" in p.stdout:
            # rank 0's output of this case: between the end of the one before and its own end
            before = p.stdout.find(f"case {position - 1} done\n") if position else -1
            start = 0 if before < 0 else before + len(f"case {position - 1} done\n")
            return p.stdout[start:p.stdout.index(f"case {position} done")]
        done = sum(f"case {j} done" in p.stdout for j in range(len(together)))
        name = f"{shlex.join([scenario, *self.argv[case]])} on {n} ranks"
        if done < position:
            first = together[done]
            pytest.fail(f"{name} did not run: the case before it in the same job, "
                        f"{shlex.join([self.cases[first][1], *self.argv[first]])}, failed\n"
                        f"{_output(p)}")
        why = "timed out (deadlock?)" if p.returncode is None else f"failed (exit {p.returncode})"
        pytest.fail(f"{name} {why}\n{_output(p)}")


def single(name: str = "self"):
    """A Communicator of one rank without MPI (:meth:`Communicator.single`)."""
    from hpcnn.parallel.collectives import Communicator
    return Communicator.single(name)
