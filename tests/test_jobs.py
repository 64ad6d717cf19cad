"""Every job script in jobs/ parses, passes only options that exist, and runs on this machine.

No Slurm or PBS here: each script runs under bash in a scratch copy of the project root
(``experiments/``, ``analysis/``, ``machines/``, ``jobs/`` linked), with the variables the
scheduler would set (``SLURM_NTASKS``, ``SLURM_JOB_ID``, ``SLURM_SUBMIT_DIR``, ``PBS_O_WORKDIR``,
``PBS_NODEFILE``, ...) and stand-ins first on PATH: ``srun`` and the PBS scripts' ``mpiexec``
record their options (the binding) and run the command on the ranks through this venv's
mpiexec; ``module``, ``scontrol`` and ``qsub`` record their call and do nothing else. Each
script's header names its small run (``# Small run (tests/test_jobs.py): ARGS="..."``): the
options (and variables) that make it take seconds. A job asking for more than 2 ranks runs on 2
(this machine's cores). What this does not test: a real scheduler, several nodes, a GPU (the GPU
jobs run their command line with ``--device=cpu``), the site's MPI.
"""
import dataclasses
import json
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest

from hpcnn.config import TrainConfig
from mpi_util import ROOT, mpiexec

JOBS_DIR = os.path.join(ROOT, "jobs")
JOBS = sorted(f for f in os.listdir(JOBS_DIR) if f.endswith((".slurm", ".pbs")))
HELPERS = sorted(f for f in os.listdir(JOBS_DIR) if f.endswith(".sh"))
# the jobs left to `make test-long` (`pytest -m long`): an experiment's sweep and figure, or a
# second training job of a kind make test already runs (~5-20 s each on 2 busy cores; the PBS
# one: train_dp.slurm is make test's)
LONG = {"collective_waits.slurm", "graph_features.slurm", "graph_partition.slurm",
        "graph_reduction.slurm", "hetero_weighting.slurm", "pipeline_bubble.slurm",
        "plan_crossover.slurm", "plan_portability.slurm", "plan_scale.slurm",
        "plan_validation.slurm", "remat_tradeoff.slurm", "train_dp.pbs",
        "train_gpu.pbs", "train_gpu.slurm",
        "train_resumable.pbs", "train_resumable.slurm"}
RANKS = 2                   # at most, whatever a job asks for: this machine has 2 cores
TIMEOUT = 240

# Stand-ins. srun: mpiexec -n SLURM_NTASKS (or its -n); with FAKE_SIGNAL_WHEN=PATH it sends the
# ranks SIGUSR1 once PATH exists (Slurm's --signal, at a moment the test chooses).
SRUN = r"""#!/bin/bash
echo "srun $*" >> "${CALLS}"
n="${SLURM_NTASKS}"
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do
    case "$1" in
        --ntasks=*) n="${1#*=}" ;;
        -n|--ntasks) n="$2"; shift ;;
        --*=*|--exclusive|--overlap) ;;
        *) echo "stand-in srun: option $1 not understood" >&2; exit 3 ;;
    esac
    shift
done
if [ -z "${FAKE_SIGNAL_WHEN:-}" ]; then
    exec "${REAL_MPIEXEC}" -n "${n}" "$@"
fi
"${REAL_MPIEXEC}" -n "${n}" "$@" &
run=$!
while [ ! -e "${FAKE_SIGNAL_WHEN}" ] && kill -0 "${run}" 2> /dev/null; do sleep 0.1; done
kill -USR1 "${run}" 2> /dev/null || true
echo "signal USR1 sent" >> "${CALLS}"
wait "${run}"
"""
# the site's mpiexec (PBS jobs): -n/-np kept, placement and binding options recorded and dropped
MPIEXEC = r"""#!/bin/bash
echo "mpiexec $*" >> "${CALLS}"
args=()
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do
    case "$1" in
        -n|-np) args+=(-n "$2"); shift ;;
        --map-by|--bind-to|-bind-to|-ppn|--ppn) shift ;;
        --cpu-bind=*|--depth=*) ;;
        *) echo "stand-in mpiexec: option $1 not understood" >&2; exit 3 ;;
    esac
    shift
done
exec "${REAL_MPIEXEC}" "${args[@]}" "$@"
"""
RECORD = '#!/bin/bash\necho "{name} $*" >> "${{CALLS}}"\n'


def lines(path: str) -> list[str]:
    """The script's command lines: continuations joined, comments and directives left out."""
    with open(path) as f:
        text = re.sub(r"\\\n\s*", " ", f.read())
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def header(path: str) -> str:
    with open(path) as f:
        return "".join(ln for ln in f if ln.startswith("#"))


def small_run(path: str) -> dict:
    """The variables of the script's ``# Small run (tests/test_jobs.py): NAME=value ...`` line."""
    found = re.search(r"^# Small run \(tests/test_jobs\.py[^)]*\): (.*)$", header(path), re.M)
    assert found, f"{path}: no '# Small run (tests/test_jobs.py): ARGS=...' line in its header"
    return dict(w.split("=", 1) for w in shlex.split(found.group(1)))


def programs(path: str) -> list[tuple[str, list[str]]]:
    """(program, options) of each hpcnn or project-script command of the script: the words
    after ``hpcnn train|calibrate`` or ``experiments|analysis/NAME.py``, the arrays it expands
    there (``"${RESUME[@]}"``) and, on the line that passes ``${ARGS:-}``, the options of the
    small run and of the header's examples."""
    script_lines = lines(path)
    arrays = dict(re.findall(r"^(\w+)=\((.*)\)$", "\n".join(script_lines), re.M))
    examples = re.findall(r'ARGS="([^"]*)"', header(path))
    found = []
    for ln in script_lines:
        m = re.search(r"(?:-m hpcnn (train|calibrate|info)|((?:experiments|analysis)/\w+\.py))(.*)", ln)
        if not m:
            continue
        rest = m.group(3)
        for name in re.findall(r'"\$\{(\w+)\[@\]\}"', rest):
            rest += " " + arrays.get(name, "")
        if "${ARGS:-}" in rest:
            rest += " " + " ".join(examples)
        options = re.findall(r"(?:^|\s)--([A-Za-z][\w-]*)", rest)
        found.append((f"hpcnn {m.group(1)}" if m.group(1) else m.group(2), options))
    return found


_HELP = """
import contextlib, io, json, os, re, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv, modules = [script, "--help"], set(sys.modules)
    sys_path = os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, sys_path)                 # as when run as a script
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    del sys.path[0]
    for name in set(sys.modules) - modules:      # experiments/ and analysis/ share module names
        if os.path.dirname(getattr(sys.modules[name], "__file__", None) or "/") == sys_path:
            del sys.modules[name]
    out[script] = re.findall(r"(?:^|[\\s\\[])--([A-Za-z][\\w-]*)", text.getvalue())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def known_options() -> dict:
    """{program: options it accepts}: TrainConfig's fields for ``hpcnn train``, the ``--help``
    of ``hpcnn calibrate`` and of every experiment and analysis script (one interpreter)."""
    scripts = sorted({p for job in JOBS for p, _ in programs(os.path.join(JOBS_DIR, job))
                      if p.endswith(".py")})
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _HELP, *scripts], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    known = json.loads(p.stdout.splitlines()[-1])
    calibrate = subprocess.run([sys.executable, "-m", "hpcnn", "calibrate", "--help"],
                               capture_output=True, text=True, env=env, timeout=60).stdout
    known["hpcnn calibrate"] = re.findall(r"^  --(\w+)=", calibrate, re.M)
    known["hpcnn train"] = [f.name for f in dataclasses.fields(TrainConfig)]
    known["hpcnn info"] = []
    return known


@pytest.mark.parametrize("name", JOBS + HELPERS)
def test_bash_parses(name):
    p = subprocess.run(["bash", "-n", os.path.join(JOBS_DIR, name)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("name", JOBS)
def test_every_option_exists(name, known_options):
    """Each option a job passes (in its command, its arrays, its small run and its header's
    examples) is one its program accepts; the scripts it names exist."""
    path = os.path.join(JOBS_DIR, name)
    found = programs(path)
    assert found, f"{name} runs no hpcnn command nor experiment"
    for program, options in found:
        if program.endswith(".py"):
            assert os.path.exists(os.path.join(ROOT, program)), f"{name}: {program} does not exist"
        unknown = sorted(set(options) - set(known_options[program]))
        assert not unknown, f"{name}: {program} has no option {unknown}"
    assert small_run(path)
    for helper in re.findall(r"jobs/\w+\.sh", "\n".join(lines(path))):
        assert os.path.exists(os.path.join(ROOT, helper)), f"{name}: {helper} does not exist"


def test_every_experiment_has_a_job():
    experiments = {f for f in os.listdir(os.path.join(ROOT, "experiments")) if f.endswith(".py")}
    named = {p.split("/")[1] for job in JOBS for p, _ in programs(os.path.join(JOBS_DIR, job))
             if p.startswith("experiments/")}
    assert experiments - named == set()


def test_the_stop_signal_is_the_one_slurm_sends():
    """A job that asks Slurm for a warning signal sends it to the ranks (no ``B:``) and runs
    hpcnn with that --stop_signal."""
    for name in JOBS:
        path = os.path.join(JOBS_DIR, name)
        asked = re.findall(r"^#SBATCH --signal=(\S+)@\d+", header(path), re.M)
        stop = re.findall(r"--stop_signal=(\w+)", "\n".join(lines(path)))
        if asked:
            assert asked == stop == [asked[0]] and not asked[0].startswith("B:"), name


def requested_ranks(path: str) -> int:
    text = header(path)
    slurm = re.search(r"--ntasks=(\d+)", text)
    per_node = re.search(r"--ntasks-per-node=(\d+)", text)
    nodes = re.search(r"--nodes=(\d+)", text)
    pbs = re.search(r"select=(\d+):\S*mpiprocs=(\d+)", text)
    if slurm:
        return int(slurm.group(1))
    if per_node:
        return int(per_node.group(1)) * int(nodes.group(1) if nodes else 1)
    return int(pbs.group(1)) * int(pbs.group(2))


def run_job(tmp_path, name: str, env_extra: dict = None, work=None):
    """The job ``name`` run by bash as its scheduler would start it, in ``work`` (a scratch
    project root, made on the first call); returns (CompletedProcess, calls recorded, work)."""
    work = work or tmp_path / "work"
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    if not work.exists():
        work.mkdir()
        for folder in ("experiments", "analysis", "machines", "jobs"):
            (work / folder).symlink_to(os.path.join(ROOT, folder))
        bin_dir.mkdir()
        for tool, text in [("srun", SRUN), ("mpiexec", MPIEXEC), ("mpirun", MPIEXEC)] + [
                (t, RECORD.format(name=t)) for t in ("module", "scontrol", "qsub")]:
            (bin_dir / tool).write_text(text)
            (bin_dir / tool).chmod(0o755)
    path = os.path.join(JOBS_DIR, name)
    n = min(requested_ranks(path), RANKS)
    env = dict(os.environ, CALLS=str(calls), REAL_MPIEXEC=mpiexec(), OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable),
                                     os.environ["PATH"]]),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if name.endswith(".slurm"):
        env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="hpcnn-test", SLURM_NTASKS=str(n),
                   SLURM_CPUS_PER_TASK="1", SLURM_SUBMIT_DIR=str(work))
    else:
        nodefile = tmp_path / "nodefile"
        nodefile.write_text(f"{socket.gethostname()}\n" * n)
        env.update(PBS_O_WORKDIR=str(work), PBS_NODEFILE=str(nodefile), PBS_JOBID="4242.pbs",
                   PBS_JOBNAME="hpcnn-test")
    env.update(small_run(path))
    env.update(env_extra or {})
    calls.write_text("")
    try:
        p = subprocess.run(["bash", path], capture_output=True, text=True, env=env, cwd=work,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name} timed out after {TIMEOUT}s\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0 and "Traceback" not in p.stderr, (
        f"{name} exited {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n"
        f"{p.stderr[-3000:]}")
    return p, calls.read_text().splitlines(), work


def run_status(log) -> str:
    from hpcnn.log import read_run
    return read_run(str(log)).attrs["status"]


@pytest.mark.parametrize("name", [pytest.param(j, marks=pytest.mark.long) if j in LONG else j
                                  for j in JOBS])
def test_the_job_runs_at_a_small_size(name, tmp_path):
    """The job's command lines run through the stand-ins: the site's module loaded, the ranks
    bound to cores, every training run's log finished, every figure written."""
    path = os.path.join(JOBS_DIR, name)
    _, calls, work = run_job(tmp_path, name)
    assert "module load openmpi" in calls                      # jobs/site.sh was sourced
    with open(path) as f:
        unconditional = re.findall(r"^(srun|mpiexec) ", f.read(), re.M)    # not inside an if
    launched = [c for c in calls if c.startswith(("srun", "mpiexec"))]
    assert len(launched) >= len(unconditional), calls
    assert all("--cpu-bind=cores" in c for c in launched if c.startswith("srun")), calls
    assert all("--bind-to core" in c for c in launched if c.startswith("mpiexec")), calls
    text = "\n".join(lines(path))
    if "-m hpcnn train" in text:
        logs = [f for f in (work / "runs").glob("*.h5") if ".ckpt" not in f.name]
        assert logs and all(run_status(f) == "finished" for f in logs), logs
    if "analysis/" in text:
        assert list((work / "runs").rglob("*.png")), sorted((work / "runs").rglob("*"))


@pytest.mark.long      # ~20 s: two slices
def test_resumable_slurm_job_stops_requeues_and_resumes(tmp_path):
    """Slice 0 gets SIGUSR1 (as from ``--signal=USR1@120``) once its first checkpoint is on disk:
    it stops, checkpoints, logs "stopped" and requeues the job; slice 1 resumes from that
    checkpoint, finishes and is not requeued."""
    from hpcnn import checkpoint
    ckpt = tmp_path / "work" / "runs" / "long.ckpt.h5"
    first = {"NAME": "long", "CKPT_EVERY": "5", "FAKE_SIGNAL_WHEN": str(ckpt),
             "ARGS": "--steps=100000 --eval_interval=0 --progress=false --allreduce=mpi"}
    _, calls, work = run_job(tmp_path, "train_resumable.slurm", first)
    assert "signal USR1 sent" in calls and "scontrol requeue 4242" in calls, calls
    assert run_status(work / "runs" / "long-4242-0.h5") == "stopped"
    stopped_at = checkpoint.summary(str(ckpt))["step"]
    assert 5 <= stopped_at < 100000
    second = {"NAME": "long", "SLURM_RESTART_COUNT": "1", "CKPT_EVERY": "5",
              "ARGS": f"--steps={stopped_at + 3} --eval_interval=0 --progress=false --allreduce=mpi"}
    _, calls, _ = run_job(tmp_path, "train_resumable.slurm", second, work=work)
    assert any("--resume=runs/long.ckpt.h5" in c for c in calls if c.startswith("srun"))
    assert not any(c.startswith("scontrol") for c in calls), calls
    assert run_status(work / "runs" / "long-4242-1.h5") == "finished"
    assert checkpoint.summary(str(ckpt))["step"] == stopped_at + 3


@pytest.mark.long      # ~25 s: the script's own timer must fire after hpcnn's start-up
def test_resumable_pbs_job_stops_before_the_walltime_and_resubmits(tmp_path):
    """The PBS job's timer sends SIGUSR1 to mpiexec STOP_MARGIN s before WALL_SECONDS; the ranks
    stop with a checkpoint and the job submits its next slice (qsub -V, SLICE=1), which resumes."""
    from hpcnn import checkpoint
    ckpt = tmp_path / "work" / "runs" / "long.ckpt.h5"
    first = {"NAME": "long", "CKPT_EVERY": "5", "WALL_SECONDS": "20", "STOP_MARGIN": "8",
             "ARGS": "--steps=1000000 --eval_interval=0 --progress=false --allreduce=mpi"}
    p, calls, work = run_job(tmp_path, "train_resumable.pbs", first)
    assert "qsub -V " + os.path.join(str(work), "jobs", "train_resumable.pbs") in calls, calls
    assert run_status(work / "runs" / "long-0.h5") == "stopped"
    stopped_at = checkpoint.summary(str(ckpt))["step"]
    second = {"NAME": "long", "SLICE": "1", "CKPT_EVERY": "5",
              "ARGS": f"--steps={stopped_at + 3} --eval_interval=0 --progress=false --allreduce=mpi"}
    _, calls, _ = run_job(tmp_path, "train_resumable.pbs", second, work=work)
    assert not any(c.startswith("qsub") for c in calls), calls
    assert run_status(work / "runs" / "long-1.h5") == "finished"
    assert checkpoint.summary(str(ckpt))["step"] == stopped_at + 3


@pytest.mark.parametrize("visible, expected", [("", ["0", "1"]), ("4,5,6,7", ["4", "5"]),
                                               ("3", ["3", "3"])])
def test_gpu_bind_gives_each_rank_its_gpu(visible, expected):
    """Under mpiexec (MPICH's MPI_LOCALRANKID) each rank sees the GPU of its local index; one
    GPU already given by the scheduler is kept."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    if not visible:
        del env["CUDA_VISIBLE_DEVICES"]
    p = subprocess.run([mpiexec(), "-n", "2", os.path.join(JOBS_DIR, "gpu_bind.sh"), "bash", "-c",
                        'echo "$MPI_LOCALRANKID $CUDA_VISIBLE_DEVICES"'],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert [ln.split()[1] for ln in sorted(p.stdout.splitlines())] == expected
    alone = subprocess.run([os.path.join(JOBS_DIR, "gpu_bind.sh"), "true"], capture_output=True,
                           text=True, env={"PATH": os.environ["PATH"]})
    assert alone.returncode == 2 and "no local rank" in alone.stderr


def test_the_cluster_page_shows_the_scripts_as_they_are():
    """docs/guide/clusters.md quotes jobs/train_dp.slurm and jobs/train_dp.pbs whole: the
    quotes are the files."""
    with open(os.path.join(ROOT, "docs", "guide", "clusters.md")) as f:
        quoted = re.findall(r"^```text\n(#!/bin/bash\n.*?)^```", f.read(), re.M | re.S)
    assert len(quoted) == 2
    for text, name in zip(quoted, ("train_dp.slurm", "train_dp.pbs")):
        with open(os.path.join(JOBS_DIR, name)) as f:
            assert text == f.read(), f"docs/guide/clusters.md quotes an older jobs/{name}"
