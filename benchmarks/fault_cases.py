"""Bad input, signals and faults against one or more checkouts: exit code, seconds, log status.

Runs the reliability cases (a path typo, an unwritable destination, another model's checkpoint,
a stale temporary file, interrupts during long steps, a long evaluation, two interrupts, a stuck
rank, oversubscribed threads, a rank that raises, a model too large for memory, a log at a
directory, bad files for ``report``, ``plan`` with nothing that fits, a tiny ``--hang_timeout``,
a diverging loss) under ``hpcnn train``/``report``/``plan`` of each CHECKOUT (a source tree:
``git archive REV | tar -x -C /tmp/old`` makes an older one; build its C fast path with ``python
-m hpcnn.parallel.collectives.lean_build``), and prints one markdown table per checkout: the exit
code, the seconds from the start (or from the signal) to the end, the run log's status and steps,
and the last line hpcnn or Python printed. A case still running after 60 s is killed and said so.

    python benchmarks/fault_cases.py /tmp/old .
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import h5py

from hpcnn import scripts

GPT = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=8", "--eval_interval=0"]
LONG = [*GPT, "--dp=2", "--log_interval=1", "--slowdown=0:300,1:300", "--steps=100000"]  # 0.9 s


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("checkouts", nargs="+", help="source trees to run the cases of")
    return ap


def log_status(path: str) -> str:
    """"status, N steps" of a run log, read with h5py alone (any version's log)."""
    try:
        with h5py.File(path, "r") as f:
            steps = f["metrics/step"].shape[0] if "metrics/step" in f else 0
            return f"{f.attrs.get('status')}, {steps} steps"
    except (OSError, KeyError) as e:
        return f"unreadable ({type(e).__name__})"


def run(env, tmp, cmd, log=None, sig=None, after="step ", wait=0.0, again=None) -> tuple:
    """(exit code, seconds, log status, last line) of ``cmd``; with ``sig``: sent once a line
    starts with ``after`` and ``wait`` s more (again ``again`` s later), timed from the signal."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, cwd=tmp)
    seen = []
    if sig:
        for line in p.stdout:
            seen.append(line)
            if line.startswith(after):
                break
        time.sleep(wait)
        t0 = time.perf_counter()
        p.send_signal(sig)
        if again:
            time.sleep(again)
            p.send_signal(sig)
    try:
        rest, killed = p.communicate(timeout=60)[0], ""
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-9", "-f", tmp])
        p.kill()
        rest, killed = p.communicate()[0], " (killed at 60 s)"
    said = [ln for ln in ("".join(seen) + rest).splitlines()
            if ln.startswith("hpcnn") or "Error" in ln]
    return (f"{p.returncode}{killed}", time.perf_counter() - t0,
            log_status(log) if log else "-", said[-1][:140] if said else "")


def cases(py, mpiexec, tmp):
    """(name, keyword arguments of :func:`run`) of every case, in order (some use files the
    earlier ones made)."""
    train, ck = [py, "-m", "hpcnn", "train"], f"{tmp}/a.ckpt.h5"

    def mp(n, launcher=("-m", "mpi4py")):
        return [mpiexec, "-n", str(n), py, *launcher, "-m", "hpcnn", "train"]
    yield "a checkpoint to work on", dict(cmd=train + GPT + ["--steps=5", f"--checkpoint={ck}",
                                                              f"--log={tmp}/a.h5"], log=f"{tmp}/a.h5")
    yield "--resume=P --log=P", dict(cmd=train + GPT + ["--steps=10", f"--resume={ck}", f"--log={ck}"])
    yield "--checkpoint=P --log=P", dict(cmd=train + GPT + ["--steps=3", f"--checkpoint={tmp}/b.h5",
                                                            f"--log={tmp}/b.h5"])
    os.makedirs(f"{tmp}/dir.h5")
    yield "--checkpoint at a directory", dict(cmd=train + GPT + ["--steps=3", f"--log={tmp}/c.h5",
                                                                 f"--checkpoint={tmp}/dir.h5"])
    yield "another model's checkpoint at the path", dict(
        cmd=train + GPT + ["--dim=32", "--steps=3", f"--checkpoint={ck}", f"--log={tmp}/d.h5"])
    with open(f"{ck}.tmp999999", "wb") as f:
        f.write(b"x" * 1000)
    yield "a killed save's temporary file", dict(
        cmd=train + GPT + ["--steps=6", f"--resume={ck}", f"--checkpoint={ck}", f"--log={tmp}/e.h5"],
        log=f"{tmp}/e.h5")
    yield "SIGINT in step 3 of 0.9 s steps", dict(
        cmd=mp(2) + LONG + [f"--log={tmp}/f.h5"], log=f"{tmp}/f.h5", sig=signal.SIGINT,
        after="step      2/", wait=0.3)
    yield "SIGINT in a long evaluation", dict(
        cmd=mp(2) + GPT + ["--dp=2", "--log_interval=1", "--steps=100000", "--eval_interval=3",
                           "--eval_batches=20000", f"--log={tmp}/g.h5"],
        log=f"{tmp}/g.h5", sig=signal.SIGINT, after="step      2/", wait=0.5)
    yield "two SIGINT 50 ms apart", dict(cmd=mp(2) + LONG + [f"--log={tmp}/h.h5"],
                                         log=f"{tmp}/h.h5", sig=signal.SIGINT,
                                         after="step      2/", again=0.05)
    yield "SIGTERM, rank 1 stuck in a collective", dict(
        cmd=mp(2) + GPT + ["--dp=2", "--log_interval=1", "--steps=100000", "--hang_timeout=60",
                           f"--log={tmp}/i.h5"], log=f"{tmp}/i.h5", sig=signal.SIGTERM,
        after="step      3/", env={"HPCNN_FAULT": "stall_collective:rank=1:step=3"})
    yield "OMP_NUM_THREADS unset, 4 ranks on 2 cores", dict(
        cmd=mp(4) + GPT + ["--dp=4", "--steps=5", f"--log={tmp}/j.h5"], log=f"{tmp}/j.h5",
        unset="OMP_NUM_THREADS")
    yield "a rank raises, no -m mpi4py", dict(
        cmd=mp(2, ()) + GPT + ["--dp=2", "--steps=50", f"--log={tmp}/k.h5"], log=f"{tmp}/k.h5",
        env={"HPCNN_FAULT": "raise_error:rank=1:step=3"})
    yield "gpt --dim=100000 --n_layers=1000", dict(
        cmd=train + ["--model=gpt", "--dim=100000", "--n_layers=1000", f"--log={tmp}/l.h5"])
    yield "--log at a directory", dict(cmd=train + GPT + ["--steps=3", f"--log={tmp}/dir.h5"])
    with open(f"{tmp}/a.h5", "rb") as f, open(f"{tmp}/trunc.h5", "wb") as g:
        g.write(f.read()[:5000])
    yield "report on a truncated log", dict(cmd=[py, "-m", "hpcnn", "report", f"{tmp}/trunc.h5"])
    yield "plan when nothing fits", dict(cmd=[py, "-m", "hpcnn", "plan", "--n_layers=2", "--dim=64",
                                              "--n_heads=4", "--seq=32", "--vocab=65", "--batch=8",
                                              "--machine=local-2vcpu", "--memory_gb=1e-6"])
    yield "--hang_timeout=0.001", dict(cmd=train + GPT + ["--steps=5", "--hang_timeout=0.001",
                                                          f"--log={tmp}/m.h5"])
    yield "AdamW diverging (mlp, lr=10)", dict(
        cmd=train + ["--model=mlp", "--lr=10", "--steps=30", f"--log={tmp}/n.h5"], log=f"{tmp}/n.h5")


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    mpiexec = scripts.mpiexec()
    for checkout in a.checkouts:
        root = os.path.abspath(checkout)
        tmp = tempfile.mkdtemp(prefix="hpcnn-faults-")
        print(f"\n{root}\n\n| case | exit | seconds | log | last line |\n|---|---|---|---|---|")
        for name, kw in cases(sys.executable, mpiexec, tmp):
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root, **kw.pop("env", {}))
            env.pop(kw.pop("unset", ""), None)
            code, seconds, status, line = run(env, tmp, **kw)
            print(f"| {name} | {code} | {seconds:.1f} | {status} | {line.replace('|', '/')} |",
                  flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
