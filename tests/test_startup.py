"""Start-up of ``hpcnn train``: a warning when the ranks of a node times their BLAS/OpenMP threads
oversubscribe its cores; under ``mpiexec`` without ``python -m mpi4py``, an uncaught exception on
one rank aborts the job at once (not after ``--hang_timeout``); Ctrl-C before the run's signal
handlers are in place ends the process with one line and exit status 130, no traceback, also
where an import turned its KeyboardInterrupt into an error or lost it."""
import os
import signal
import subprocess
import sys
import time

import pytest

from hpcnn import cli
from mpi_util import ROOT, mpiexec

MLP = ["--model=mlp", "--steps=2", "--eval_interval=0", "--no-progress"]


def _env(**extra):
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OPENBLAS_NUM_THREADS="", **extra)


def _mpi_train(n, args, env, launcher=("-m", "mpi4py"), timeout=120, main=("-m", "hpcnn")):
    cmd = [mpiexec(), "-n", str(n), sys.executable, *launcher, *main, "train", *args]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    return p, time.perf_counter() - t0


def test_oversubscribed_cores_are_named_once_with_the_fix(tmp_path):
    cores = len(os.sched_getaffinity(0))
    many = str(2 * cores)        # each rank's pool takes every core: 2 ranks oversubscribe them
    p, _ = _mpi_train(2, MLP + ["--dp=2", f"--log={tmp_path}/a.h5"], _env(OMP_NUM_THREADS=many))
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "oversubscribed" in ln]
    assert len(lines) == 1 and "OMP_NUM_THREADS=1" in lines[0] and "2 rank(s)" in lines[0], \
        p.stderr
    assert f"on {cores} core(s)" in lines[0], lines
    p, _ = _mpi_train(2, MLP + ["--dp=2", f"--log={tmp_path}/b.h5"], _env(OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "oversubscribed" not in p.stderr, p.stderr


def test_a_rank_that_raises_without_the_launcher_aborts_the_job(tmp_path):
    """No ``-m mpi4py``: rank 1 raises at step 1; the job ends in seconds with its traceback,
    not after the 60 s hang timeout with rank 0 still waiting in the allreduce."""
    args = MLP + ["--dp=2", "--steps=20", "--hang_timeout=60", f"--log={tmp_path}/r.h5"]
    env = _env(OMP_NUM_THREADS="1", HPCNN_FAULT="raise_error:rank=1:step=1")
    p, seconds = _mpi_train(2, args, env, launcher=())
    assert p.returncode != 0, p.stdout + p.stderr
    assert seconds < 40, (seconds, p.stderr)
    assert "RuntimeError: HPCNN_FAULT: rank 1 raises at step 1" in p.stderr, p.stderr
    assert "hpcnn: rank 1 of 2 failed (RuntimeError): aborting the job" in p.stderr, p.stderr


def test_refusal_without_the_launcher_still_exits_2_once(tmp_path):
    args = ["--model=mlp", "--dp=3", f"--log={tmp_path}/x.h5"]        # 3 != 2 ranks
    p, _ = _mpi_train(2, args, _env(OMP_NUM_THREADS="1"), launcher=())
    assert p.returncode == 2 and p.stderr.count("hpcnn train:") == 1, p.stderr
    assert "Traceback" not in p.stderr and "aborting" not in p.stderr, p.stderr


def _loaded(p, library: str, timeout: float = 60.0) -> None:
    """Wait until a library whose file name contains ``library`` is mapped into the process of
    ``p`` (``/proc/PID/maps``, polled each millisecond)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                if library in f.read():
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.001)
    p.kill()
    pytest.fail(f"{library} not loaded within {timeout:g} s: {p.communicate()}")


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path):
    """SIGINT at 0, 0.3 and 1 s after NumPy's C extension is loaded: in NumPy's own
    initialisation (where an import in C can turn the KeyboardInterrupt into an ImportError);
    while the rest loads; while the data set is read. Counted from there, not from the start:
    under load Python's own start-up (site, the environment's .pth files) takes longer than a
    fixed delay, and a Ctrl-C there ends in Python's traceback before any of hpcnn has run."""
    cmd = [sys.executable, "-m", "hpcnn", "train", "--model=gpt", "--steps=100000",
           f"--log={tmp_path}/s.h5"]
    for delay in (0.0, 0.3, 1.0):
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_env(OMP_NUM_THREADS="1"), cwd=ROOT)
        _loaded(p, "_multiarray_umath")
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 130, (delay, out, err)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        # before the run's handlers: the start-up line; after: the run's own interrupted stop
        assert err.strip() in ("", cli.START_UP), err


# ``python -m hpcnn ...`` as -m runs it (runpy), with a finder that, at the first import of
# NumPy, sends this process SIGINT and lets its KeyboardInterrupt end as an import can end it:
# "error", turned into an ImportError (NumPy's own, when the signal hits its import of datetime:
# seen about once in 60 Ctrl-Cs under load); "swallowed", eaten by an ``except ImportError``
# around an optional import, the import going on; "dropped", raised in a callback that cannot
# raise (Python prints "Exception ignored in" and goes on: seen in importlib's module-lock
# callback, the Ctrl-C lost and the run trained on). argv: -c HOW hpcnn's arguments.
SIGINT_IN_IMPORT = """
import runpy, signal, sys, weakref

class SigintInImport:
    def find_spec(self, name, path=None, target=None):
        if name != "numpy":
            return None
        sys.meta_path.remove(self)
        if HOW == "dropped":
            lock = type("Lock", (), {})()
            gone = weakref.ref(lock, lambda ref: signal.raise_signal(signal.SIGINT))
            del lock
            return None
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            if HOW == "swallowed":
                return None
            raise ImportError('PyCapsule_Import could not import module "datetime"') from None
        raise AssertionError("SIGINT raised no KeyboardInterrupt")

HOW = sys.argv[1]
sys.argv = ["hpcnn", *sys.argv[2:]]
sys.meta_path.insert(0, SigintInImport())
runpy.run_module("hpcnn", run_name="__main__", alter_sys=True)
"""
ENDINGS = ["error", "swallowed", "dropped"]


@pytest.mark.parametrize("how", ENDINGS)
def test_ctrl_c_that_an_import_turns_into_an_error_or_loses_is_the_interrupt(tmp_path, how):
    """Without the start-up handler: a traceback and status 1 ("error"), or a run that trains
    on as if no Ctrl-C had come ("swallowed", "dropped")."""
    cmd = [sys.executable, "-c", SIGINT_IN_IMPORT, how, "train", *MLP, f"--log={tmp_path}/s.h5"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(OMP_NUM_THREADS="1"),
                       cwd=ROOT, timeout=120)
    assert p.returncode == 130, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.strip() == cli.START_UP, p.stderr


@pytest.mark.parametrize("how", ENDINGS)
def test_ctrl_c_that_an_import_ends_so_on_every_rank_is_one_line_each_and_130(tmp_path, how):
    """Under ``python -m mpi4py``: each rank leaves by :func:`hpcnn.cli.interrupted_at_start`
    (MPI finalized once every rank is there), not by the launcher's abort of the error."""
    args = MLP + ["--dp=2", f"--log={tmp_path}/m.h5"]
    p, _ = _mpi_train(2, args, _env(OMP_NUM_THREADS="1"), main=("-c", SIGINT_IN_IMPORT, how))
    assert p.returncode == 130, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.splitlines() == [cli.START_UP] * 2, p.stderr


def test_the_start_up_handler_leaves_an_ignored_sigint_ignored():
    """A background job of a shell without job control starts with SIGINT ignored: it stays
    so (where SIGINT is Python's default, the start-up handler takes its place)."""
    code = ("import signal, hpcnn\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "hpcnn.note_start_up_interrupts()\n"
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "hpcnn.note_start_up_interrupts()\n"
            "assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler\n"
            "assert not hpcnn.start_up_interrupted()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                       cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
