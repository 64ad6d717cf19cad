"""Signals to ``mpiexec`` during a run (:mod:`hpcnn.signals`): SIGINT and SIGTERM end every rank
with the log closed as "interrupted"; the stop signal (SIGUSR1) stops every rank at the same
step with a checkpoint, and the run resumed from it continues bit for bit as if uninterrupted.

Each case launches ``hpcnn train`` under MPICH's hydra, which forwards these signals to every
rank, waits for the first progress line (the run is in its steps), sends the signal to
``mpiexec`` and times how long the job takes to end.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcnn.log import read_run
from mpi_util import ROOT, mpiexec

GPT = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=8", "--eval_interval=0", "--log_interval=5"]
BOUND_S = 10.0          # generous under load; ~0.7 s measured on 2 busy cores


def launch(n, log, *args):
    """``hpcnn train`` on ``n`` ranks, started; returns the Popen once the first progress line
    is printed (the run is past set-up)."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcnn", "train",
           f"--log={log}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, cwd=ROOT)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("step "):
            return p, seen
    p.wait()
    pytest.fail("the run ended before its first step line:\n" + "".join(seen))


def ranks_left(marker: str) -> list:
    """Pids of processes whose command line contains ``marker`` (this run's log path)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def signal_and_time(p, sig, marker):
    """Send ``sig`` to mpiexec; seconds until it and every rank are gone (killed after
    :data:`BOUND_S` * 3 so that a failing test leaves nothing behind)."""
    t0 = time.perf_counter()
    p.send_signal(sig)
    try:
        out, _ = p.communicate(timeout=BOUND_S * 3)
    except subprocess.TimeoutExpired:
        for pid in ranks_left(marker):
            os.kill(pid, signal.SIGKILL)
        p.kill()
        out, _ = p.communicate()
    while ranks_left(marker) and time.perf_counter() - t0 < BOUND_S * 3:
        time.sleep(0.05)
    return time.perf_counter() - t0, out


@pytest.mark.parametrize("n,sig,layout", [
    (4, signal.SIGINT, ["--dp=4"]),
    (4, signal.SIGTERM, ["--dp=4"]),
    (2, signal.SIGINT, ["--pp=2", "--n_layers=2", "--microbatches=2"]),
], ids=["dp4-int", "dp4-term", "pp2-int"])
def test_interrupt_ends_every_rank(tmp_path, n, sig, layout):
    """Default allreduce (shm on one node): every rank ends, the log says "interrupted" and
    holds every step up to the one it stopped at, the exit status is 128 + signal."""
    log = str(tmp_path / "run.h5")
    p, _ = launch(n, log, *GPT, "--steps=100000", *layout)
    took, out = signal_and_time(p, sig, log)
    print(f"{signal.Signals(sig).name} -> every rank gone after {took:.2f} s")
    assert not ranks_left(log), out
    assert took < BOUND_S, out
    assert p.returncode == 128 + sig, out
    run = read_run(log)
    assert run.attrs["status"] == "interrupted"
    steps = run.metrics["step"]
    assert len(steps) >= 5 and np.array_equal(steps, np.arange(len(steps)))
    assert np.isfinite(run.metrics["loss"]).all()
    assert f"interrupted by a signal after step {len(steps)}" in out


def test_stop_signal_checkpoints_and_resumes_bit_for_bit(tmp_path):
    """SIGUSR1 on 2 ranks: both stop at the same step k, write the checkpoint, log "stopped",
    exit 0; resumed from it the run's losses equal the uninterrupted run's, bit for bit."""
    args = [*GPT, "--steps=300", "--dp=2", "--lr_schedule=cosine", "--dropout=0.1"]
    ckpt = str(tmp_path / "run.ckpt.h5")
    ref = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnn",
                            "train", f"--log={tmp_path / 'ref.h5'}", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1",
                                              PYTHONPATH=ROOT))          # alongside: saves time
    p, _ = launch(2, str(tmp_path / "a.h5"), *args, f"--checkpoint={ckpt}")
    _, out = signal_and_time(p, signal.SIGUSR1, str(tmp_path / "a.h5"))
    assert p.returncode == 0, out
    first = read_run(str(tmp_path / "a.h5"))
    k = len(first.metrics["step"])
    assert first.attrs["status"] == "stopped" and 0 < k < 300, out
    assert f"stopped by a signal after step {k}, checkpoint {ckpt}" in out
    p2, _ = launch(2, str(tmp_path / "b.h5"), *args, f"--resume={ckpt}")
    out2, _ = p2.communicate(timeout=120)
    assert p2.returncode == 0, out2
    ref_out, _ = ref.communicate(timeout=120)
    assert ref.returncode == 0, ref_out
    whole = read_run(str(tmp_path / "ref.h5")).metrics
    second = read_run(str(tmp_path / "b.h5"))
    assert second.attrs["status"] == "finished"
    assert np.array_equal(second.metrics["step"], np.arange(k, 300))
    assert np.array_equal(first.metrics["loss"], whole["loss"][:k])
    assert np.array_equal(second.metrics["loss"], whole["loss"][k:])


@pytest.mark.parametrize("sig,status,code", [(signal.SIGUSR1, "stopped", 0),
                                             (signal.SIGTERM, "interrupted", 128 + 15)])
def test_serial_run_stops_on_a_signal(tmp_path, sig, status, code):
    """Without MPI: the signal (sent to this process while it trains) ends the run at the next
    step with the log's status and the exit code; on the stop signal, a checkpoint of that step.
    The handlers in place before the run are back after it."""
    import threading
    from hpcnn import checkpoint
    from hpcnn.config import parse_overrides
    from hpcnn.train import train
    before = signal.getsignal(sig)
    ck = str(tmp_path / "ck-{step}.h5")

    def signal_when_training():          # once the step-5 checkpoint exists: past set-up
        while not os.path.exists(ck.format(step=5)):
            time.sleep(0.01)
        os.kill(os.getpid(), sig)

    cfg = parse_overrides(["--model=mlp", "--hidden=8", "--steps=1000000", "--eval_interval=0",
                           "--progress=false", f"--log={tmp_path / 'run.h5'}",
                           f"--checkpoint={ck}", "--checkpoint_every=5"])
    threading.Thread(target=signal_when_training, daemon=True).start()
    r = train(cfg)
    assert (r["status"], r["exit_code"]) == (status, code)
    run = read_run(str(tmp_path / "run.h5"))
    k = len(run.metrics["step"])
    assert run.attrs["status"] == status and 5 <= k < 1000000
    assert (r["steps_done"], r["steps"]) == (k, 1000000)        # done, of the planned count
    assert np.array_equal(run.metrics["step"], np.arange(k))
    assert os.path.exists(ck.format(step=k)) == (status == "stopped" or k % 5 == 0)
    if status == "stopped":
        assert checkpoint.summary(ck.format(step=k))["step"] == k
    assert signal.getsignal(sig) is before


@pytest.mark.parametrize("second", [False, True], ids=["grace-expired", "second-interrupt"])
def test_an_unhonoured_interrupt_ends_the_process(second):
    """A rank that never reaches a step boundary (stuck, or a very long step) still ends: after
    GRACE_SECONDS, or at once on a second interrupt, with 128 + the signal and one line."""
    code = ("import os, signal, time\n"
            "import hpcnn.signals as S\n"
            "S.GRACE_SECONDS = 60.0 if TWICE else 0.2\n"
            "s = S.StopSignals(None)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.05)\n"
            "if TWICE:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "t0 = time.time()\n"
            "while time.time() - t0 < 30:\n"       # no poll(): a step that never ends
            "    time.sleep(0.01)\n").replace("TWICE", str(second))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == (130 if second else 143), p.stderr
    assert p.stderr.strip() == ("hpcnn: SIGINT, a second interrupt: ending this rank now" if second
                                else "hpcnn: SIGTERM, not honoured at a step boundary within "
                                     "0.2 s: ending this rank now"), p.stderr
