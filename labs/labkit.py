"""The labs' grading harness: run a student's file under mpiexec, check it, say what is wrong.

A lab's ``grade.py`` defines ``checks(ck, comm, out)``, which every rank runs on the student's
module, and calls :func:`grade_main` when run as a script::

    python labs/01-collectives/grade.py                 # grades labs/01-collectives/student.py
    python labs/01-collectives/grade.py solution.py     # any file with the same functions

:func:`grade_main` (the parent) starts ``mpiexec -n NP python -m mpi4py labs/labkit.py --worker
LAB STUDENT OUT`` with a timeout. Each rank (:func:`worker`) loads the student's file and runs the
lab's checks through a :class:`Checker`: ``ck.step(name)`` announces a step (the parent keeps the
last one each rank started, to name where a hang happened), ``ck.call(name, ...)`` calls a
student function (a ``NotImplementedError`` becomes "not written yet"), ``ck.close`` and
``ck.equal`` compare against the reference and raise :class:`LabFailure` with the rank, the
step, what was expected and what came, and a hint. The first failure on any rank ends the job
(``MPI_Abort``); the parent prints it and exits 1. A run past the timeout is killed and reported
with each rank's last step. Workers talk to the parent in tagged lines on stdout:
``@step``, ``@info``, ``@fail`` (JSON, one line) and ``@pass``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

TAGS = re.compile(r"@(step|info|fail|pass) ")

LABS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(LABS)


class LabFailure(Exception):
    """A check that did not hold: ``message`` is what the student reads."""


def emit(tag: str, text: str) -> None:
    """One tagged line to the parent, in a single write (ranks share the output stream)."""
    sys.stdout.write(f"@{tag} {text}\n")
    sys.stdout.flush()


def load_module(path: str, name: str):
    """Import the Python file at ``path`` as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def show(a, limit: int = 6) -> str:
    """A short printout of an array or value: shape and the first elements."""
    if isinstance(a, np.ndarray):
        flat = a.reshape(-1)
        head = np.array2string(flat[:limit], precision=6, separator=", ")
        more = f" ... ({flat.size} elements)" if flat.size > limit else ""
        return f"shape {a.shape}: {head}{more}"
    return repr(a)


class Checker:
    """What a grading rank holds: the student's module, its rank, the step it is at."""

    def __init__(self, module, path: str, rank: int, size: int):
        self.module, self.path, self.rank, self.size = module, path, rank, size
        self.where = "loading the file"

    def step(self, name: str) -> None:
        self.where = name
        emit("step", f"{self.rank} {name}")

    def info(self, text: str) -> None:
        """A line the parent prints for the student (rank 0's only)."""
        if self.rank == 0:
            emit("info", text)

    def fail(self, what: str, hint: str, expected=None, got=None):
        lines = [f"rank {self.rank}, step '{self.where}': {what}"]
        if expected is not None or got is not None:
            lines += [f"  expected {show(expected)}", f"  got      {show(got)}"]
        lines.append(f"  hint: {hint}")
        raise LabFailure("\n".join(lines))

    def function(self, name: str):
        fn = getattr(self.module, name, None)
        if fn is None:
            self.fail(f"{os.path.basename(self.path)} has no `{name}`",
                      "keep the names and signatures of skeleton.py")
        return fn

    def call(self, name: str, *args, **kw):
        """Call the student's ``name``; an unwritten function is named as such."""
        fn = self.function(name) if isinstance(name, str) else name
        try:
            return fn(*args, **kw)
        except NotImplementedError:
            label = name if isinstance(name, str) else getattr(fn, "__qualname__", str(fn))
            raise LabFailure(f"rank {self.rank}, step '{self.where}': `{label}` is not written "
                             f"yet (it raises NotImplementedError).\n  hint: write its body in "
                             f"{self.path}, following its docstring") from None

    def equal(self, what: str, got, expected, hint: str) -> None:
        if got != expected:
            self.fail(what, hint, expected, got)

    def close(self, what: str, got, expected, hint: str, rtol: float = 1e-10) -> None:
        """``got`` equals ``expected`` to ``rtol`` relative to the largest |expected|."""
        expected = np.asarray(expected)
        if not isinstance(got, np.ndarray) and not np.isscalar(got):
            self.fail(f"{what}: not an array", hint, expected, got)
        got = np.asarray(got)
        if got.shape != expected.shape:
            self.fail(f"{what}: wrong shape", hint, expected, got)
        scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-300)
        err = np.abs(got - expected) / scale
        if not np.all(np.isfinite(got)) or err.size and float(err.max()) > rtol:
            worst = int(np.argmax(np.where(np.isfinite(err), err, np.inf)))
            idx = np.unravel_index(worst, expected.shape) if expected.ndim else ()
            self.fail(f"{what}: largest relative error {float(err.reshape(-1)[worst]):.2e} "
                      f"(allowed {rtol:g}) at index {tuple(int(i) for i in idx)}",
                      hint, expected, got)


class Recorder:
    """An mpi4py communicator that records the methods called on it (``calls``: (name, args,
    kwargs); ``marks``: the value of ``mark`` at each call, which the grader sets).

    ``allowed``: if given, the only methods the student may call; another raises an
    AttributeError saying so. ``before(name, args, kwargs)``: called before each call is made
    (a check that must fail before MPI does)."""

    def __init__(self, comm, allowed=None, before=None):
        self._comm, self._allowed, self.calls, self.marks, self.mark = comm, allowed, [], [], None
        self._before = before
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def __getattr__(self, name):
        if self._allowed is not None and name not in self._allowed:
            raise AttributeError(f"this exercise is built from {sorted(self._allowed)} only: "
                                 f"comm.{name} is not available here")
        attr = getattr(self._comm, name)
        if not callable(attr) or name in ("Get_rank", "Get_size"):
            return attr

        def recorded(*args, **kw):
            if self._before is not None:
                self._before(name, args, kw)
            self.calls.append((name, args, kw))
            self.marks.append(self.mark)
            return attr(*args, **kw)
        return recorded

    def names(self) -> list:
        return [c[0] for c in self.calls]


def describe_error(exc: BaseException, student: str) -> str:
    """An exception from the student's code, with the line of the student's file it came from."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(student)]
    where = (f" at {os.path.basename(student)} line {frames[-1].lineno} "
             f"(`{frames[-1].line}`)" if frames else "")
    return f"{type(exc).__name__}: {exc}{where}"


def worker(lab_dir: str, student: str, out: str) -> None:
    """One rank: run the lab's checks on the student's file; on a failure, report and abort."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    grade = load_module(os.path.join(lab_dir, "grade.py"), "lab_grade")
    ck = Checker(None, student, rank, comm.Get_size())
    try:
        ck.module = load_module(student, "student")
        grade.checks(ck, comm, out)
    except LabFailure as e:
        message = str(e)
    except Exception as e:        # the student's code raised: say what and where
        message = (f"rank {rank}, step '{ck.where}': your code raised "
                   f"{describe_error(e, student)}\n  hint: {getattr(grade, 'ERROR_HINT', '')}")
    else:
        comm.Barrier()
        emit("pass", str(rank))
        return
    emit("fail", json.dumps(message))
    time.sleep(0.5)         # let mpiexec forward the line before the abort kills the ranks
    comm.Abort(1)


def parse_output(text: str):
    """(last step per rank, info lines, failure messages, ranks passed) from a worker's output."""
    steps, info, fails, passed = {}, [], [], set()
    marks = list(TAGS.finditer(text))        # a rank's line may land inside another's
    for mark, after in zip(marks, marks[1:] + [None]):
        tag = "@" + mark.group(1)
        rest = text[mark.end():after.start() if after else len(text)].split("\n")[0].strip()
        if tag == "@step":
            r, _, name = rest.partition(" ")
            steps[int(r)] = name
        elif tag == "@info":
            info.append(rest)
        elif tag == "@fail":
            fails.append(json.loads(rest))
        elif tag == "@pass":
            passed.add(int(rest))
    return steps, info, fails, passed


def launch(lab_dir: str, student: str, out: str, ranks: int, timeout: float):
    """Run the workers under mpiexec; returns (exit code or None on a timeout, output)."""
    sys.path.insert(0, ROOT)        # hpcnn, for the mpiexec beside this Python
    from hpcnn import scripts
    cmd = [scripts.mpiexec(), *scripts.mpiexec_flags(), "-n", str(ranks), sys.executable,
           "-m", "mpi4py", os.path.abspath(__file__), "--worker", lab_dir, student, out]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile("w+") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
        try:
            code = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)         # mpiexec and every rank it started
            job.wait()
            code = None
        log.seek(0)
        return code, log.read()


def report(title: str, code, text: str, ranks: int, timeout: float, hang_hint: str) -> int:
    """Print the verdict for the student; returns the exit status (0: passed)."""
    steps, info, fails, passed = parse_output(text)
    if fails:
        print(f"FAIL {title}\n{fails[0]}")
        return 1
    if code is None:
        where = "\n".join(f"  rank {r}: '{s}'" for r, s in sorted(steps.items()))
        print(f"FAIL {title}: the ranks did not finish within {timeout:g} s (a hang). The last "
              f"step each rank started:\n{where or '  (none: the file did not load)'}\n"
              f"  hint: {hang_hint}")
        return 1
    if code != 0 or len(passed) != ranks:
        print(f"FAIL {title}: the job ended with status {code} before every rank passed; its "
              f"output:\n{text[-3000:]}")
        return 1
    for line in info:
        print(line)
    print(f"PASS {title} ({ranks} rank{'s' if ranks != 1 else ''})")
    return 0


def grade_main(lab_file: str, title: str, ranks: int = 4, timeout: float = 60,
               hang_hint: str = "") -> int:
    """The command line of a lab's grade.py (``lab_file`` is its ``__file__``)."""
    lab_dir = os.path.dirname(os.path.abspath(lab_file))
    ap = argparse.ArgumentParser(description=f"Grade {title}: run a student's file under "
                                 f"mpiexec and check it against the reference.")
    ap.add_argument("student", nargs="?", default=os.path.join(lab_dir, "student.py"),
                    help="the file to grade (default: student.py in the lab's folder)")
    ap.add_argument("--np", type=int, default=ranks, help="how many ranks")
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds before a hang ends")
    ap.add_argument("--out", help="the results file (default: runs/<file name>.h5 in the lab)")
    args = ap.parse_args()
    student = os.path.abspath(args.student)
    rel = os.path.relpath(lab_dir, os.getcwd())
    if not os.path.exists(student):
        print(f"No {os.path.relpath(student)}. To start the lab, copy the skeleton and fill in the functions "
              f"that raise NotImplementedError:\n  cp {rel}/skeleton.py {rel}/student.py\n"
              f"then read {rel}/README.md and grade again.")
        return 2
    name = os.path.splitext(os.path.basename(student))[0]
    out = os.path.abspath(args.out or os.path.join(lab_dir, "runs", f"{name}.h5"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(f"grading {os.path.relpath(student)} on {args.np} ranks ...", flush=True)
    code, text = launch(lab_dir, student, out, args.np, args.timeout)
    status = report(title, code, text, args.np, args.timeout, hang_hint)
    if status == 0:
        print(f"measurements: {os.path.relpath(out)}; the figure: python {rel}/plot.py {os.path.relpath(out)}")
    return status


def plot_args(lab_file: str, description: str):
    """The command line of a lab's plot.py: (results file, figure path)."""
    lab_dir = os.path.dirname(os.path.abspath(lab_file))
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("results", nargs="?", default=os.path.join(lab_dir, "runs", "student.h5"),
                    help="the grader's results file (default: runs/student.h5 in the lab)")
    ap.add_argument("figure", nargs="?", help="the PNG to write (default: the results file's "
                    "name with .png)")
    args = ap.parse_args()
    if not os.path.exists(args.results):
        sys.exit(f"no {args.results}: grade the lab first (make lab N=...), it writes the file")
    return args.results, args.figure or os.path.splitext(args.results)[0] + ".png"


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    import labkit       # the module the labs' grade.py import, so that one LabFailure is caught
    labkit.worker(*sys.argv[2:5])
