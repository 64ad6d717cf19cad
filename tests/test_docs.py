"""Every command in the documentation's command blocks runs as written (shortened, never edited).

The documentation is README.md and the pages of the MkDocs site under docs/ (built by
``make docs``; :func:`test_the_site_builds` builds it here with ``--strict``). A command block is
a fenced code block with no language or a shell one (``sh``, ``bash``, ``console``, ``shell``);
``text`` (a synopsis or a printed result) and ``python`` blocks are not commands. Each line is one
command (a trailing backslash continues it; ``#`` starts a comment, as in a shell). They run in
one scratch directory in a fixed order, README.md first, then the pages by path
(:func:`doc_pages`), each page's in its own order, so a command may use a file an earlier one
wrote (``--resume`` reads the checkpoint the command before it saved; keep such pairs on one
page). The blocks are found anew at every run: a command added to a page is tested without
touching this file (in ``make test``, unless :data:`LONG` leaves it to ``make test-long``,
where the long ones run in the same order: a command moves with the one whose file it reads).

What the test changes, and why:

- ``hpcnn`` is ``python -m hpcnn``, ``python`` this interpreter, ``mpiexec`` the one next to it
  (``--oversubscribe`` added for Open MPI); this checkout is on PYTHONPATH.
- An ``hpcnn train`` command gets :data:`SHORTEN` appended (a later ``--key=value`` overrides an
  earlier one): one step (two for a resumed run, so that it has a step left after the saved
  one), one evaluation at the end over one batch, the first play only of the Shakespeare corpus,
  no progress lines, and the library's allreduce unless the command chooses one (``auto``
  calibrates every algorithm at start-up: tested in tests/test_allreduce.py). The model,
  layout, schedule and memory options stay as written, so the checks and plans they trigger run.
- An experiment or benchmark gets its :data:`SCRIPT_SHORTEN` options: the same sweep on smaller
  sizes, wherever its command is (README or any page).
- Skipped, because they cannot run inside a test: ``make`` (the whole test suite and demo),
  ``pip install`` and ``module load`` (they change the environment; there is no network),
  anything naming CuPy (no GPU here), and the emulated cluster's scripts
  (``benchmarks/netns_cluster.py``, ``benchmarks/throttled_link.py``) where this machine cannot
  build one (not root, no network namespaces or tbf: tests/test_netns_cluster.py says why).

The scratch directory and the commands' results belong to one :class:`DocsRun` per test
session (the ``docs_run`` fixture in conftest.py), so that a test of an experiment
(tests/test_plan_validation.py, ...) asserts on the documentation's own run of it instead of
running it a second time: :meth:`DocsRun.command_running` names the command,
:meth:`DocsRun.result` runs it (once) and returns its result and outputs (such a test is long
when the command is).
"""
import os
import re
import shlex
import subprocess
import sys

import pytest

from hpcnn import scripts
from mpi_util import ROOT, mpiexec

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
# pages whose fenced blocks are not commands, and why
NOT_COMMANDS: dict = {}     # page -> why its blocks are not commands (none: label them ``text``)
SHORTEN = ["--eval_interval=0", "--eval_batches=1", "--max_plays=1", "--progress=false"]
# experiments and benchmarks, shortened the same way (their sweeps' shape stays, sizes shrink)
SCRIPT_SHORTEN = {
    "experiments/pipeline_bubble.py": ["--width=128", "--pairs=4", "--micro=8",
                                       "--micro-batches=1,2,8", "--steps=2", "--warmup=1"],
    "experiments/remat_tradeoff.py": ["--quick"],
    "experiments/plan_validation.py": ["--machine=local-2vcpu", "--rounds=1", "--gpt_steps=3",
                                       "--mlp_steps=3", "--gpt_layouts=2", "--mlp_layouts=2",
                                       "--hidden=16,16", "--gpt=2,16,2,8,4", "--mlp_batch=32",
                                       "--confirm=1", "--confirm_rounds=1"],
    "experiments/plan_crossover.py": ["--batches=8,32", "--widths=8", "--rounds=1", "--steps=2"],
    "experiments/plan_scale.py": ["--models=1.7B,145B"],
    "experiments/plan_portability.py": ["--changes=5,6", "--reps=1", "--replans=1"],
    "benchmarks/graph_eigs.py": ["--nodes=3000", "--rounds=1"],
    "experiments/graph_partition.py": ["--nodes=2000", "--train_graphs=karate", "--train_parts=2",
                                       "--kinds=contiguous,spectral", "--rounds=1", "--steps=3"],
    "benchmarks/graph_unite.py": ["--nodes=3000", "--rounds=1"],
    "benchmarks/plan_search.py": ["--tiny"],
    "benchmarks/plan_time.py": ["--rounds=1", "--only=gpt3"],
    "benchmarks/throttled_link.py": ["--rate=2gbit", "--sizes=1", "--rounds=1"],
    "experiments/plan_published.py": ["--only=korthikanti2023-22b-full,bloom2022-176b"],
    "benchmarks/oversubscribed.py": ["--rounds=1", "--stream_mib=1"],
    "experiments/graph_features.py": ["--nodes=300", "--snrs=0,1", "--seeds=1", "--steps=20"],
    "experiments/graph_reduction.py": ["--nodes=300", "--ratios=1,0.3", "--seeds=1",
                                       "--steps=20"],
}
SKIP = {"make": "runs the whole test suite or demo", "pip": "changes the environment",
        "module": "changes the environment (cluster modules)"}
SHELL_BLOCKS = ("", "sh", "bash", "console", "shell")
# Documented commands left to `make test-long` (the `long` marker) for the 5 minutes of
# `make test`: the start of a command as written (the longest that begins it decides) -> why
# it may go, with what in make test runs the same code. Every guide page keeps a command in
# make test but checkpoints.md; of the results pages, graphs.md and planning.md do. A command
# reading a file (runs/...) is long when the command writing it is
# (test_the_long_commands_keep_their_inputs), and so is a test reading its run (DocsRun).
MPI_HPCNN = "mpiexec -n {} python -m mpi4py -m hpcnn "
LONG = {
    MPI_HPCNN.format(4) + "train --model=gpt --dp=2 --pp=2 --steps=2000":
        "the checkpoint the 8-rank resume below reads; tests/test_checkpoint.py moves "
        "checkpoints between layouts under MPI",
    MPI_HPCNN.format(8) + "train --model=gpt --dp=2 --tp=2 --pp=2":
        "8 ranks: tests/test_checkpoint.py (between layouts), tests/test_train_pp.py (dp x pp)",
    MPI_HPCNN.format(2) + "train --dp=2 --grad_accum=4":
        "tests/test_data_parallel.py: accumulation and buckets on 2 ranks against serial",
    MPI_HPCNN.format(2) + "train --dp=2 --balance=proportional":
        "tests/test_hetero.py: proportional shares and emulated slowdowns in training",
    "HPCNN_NODES=2 " + MPI_HPCNN.format(4) + "info":
        "4 ranks (tests/test_topology.py checks what it prints, in make test-long too); "
        "make test runs hpcnn info (gpus.md) and names the nodes in a run's header and log",
    MPI_HPCNN.format(4) + "train --model=mlp --dp=4 --nodes=2 --allreduce=hier":
        "tests/test_topology.py: the two-level allreduce on 2 emulated nodes against serial",
    "python benchmarks/netns_cluster.py":
        "the namespaced cluster: tests/test_netns_cluster.py runs the two-level allreduce over "
        "it, tests/test_topology.py trains with it across emulated nodes",
    MPI_HPCNN.format(2) + "train --device=strict --share_gpus=true":
        "tests/test_gpu.py: each --gpu_comm path under strict on 2 ranks",
    MPI_HPCNN.format(2) + "train --model=gcn":
        "tests/test_gcn.py (2 ranks against serial, spectral partitions), "
        "tests/test_graph_preprocessing.py (features and coarsening on 2 ranks)",
    "hpcnn train --model=gcn --dataset=sbm":
        "tests/test_graph_preprocessing.py: spectral features and coarsening, serially",
    "hpcnn train --model=gcn --dataset=digits_knn":
        "tests/test_graph_preprocessing.py: spectral features and coarsening, serially",
    "hpcnn train --model=gpt --n_layers=8 --remat=optimal --memory_budget=52 --offload_gbps":
        "tests/test_train_remat.py and tests/test_offload.py: offloading against plain training",
    "hpcnn train --model=gpt --n_layers=8 --remat=sqrt":
        "tests/test_train_remat.py: every --remat mode against plain training",
    "hpcnn train --model=gpt --n_layers=8 --remat=full":
        "tests/test_train_remat.py: every --remat mode against plain training",
    MPI_HPCNN.format(2) + "train --model=gpt --n_layers=8 --pp=2":
        "tests/test_train_remat.py: remat under pp = 2 against serial",
    MPI_HPCNN.format(4) + "train --model=gpt --dp=2 --pp=2 --microbatches=2 --remat=sqrt":
        "4 ranks: tests/test_train_remat.py (pp = 2, --show_schedule)",
    MPI_HPCNN.format(2) + "train --model=gpt --dataset=sonnet --dp=2 --precision=fp16":
        "tests/test_precision.py: 16-bit data parallelism on 2 ranks against serial",
    "hpcnn report runs/fp16.h5":
        "reads the fp16 run above; tests/test_runlog.py (a run's report), "
        "tests/test_plan_timeline.py (hpcnn report)",
    "hpcnn train --model=gpt --dataset=sonnet --precision=fp16 --loss_scale_init":
        "tests/test_precision.py: the loss scale's back-off",
    "hpcnn train --model=gpt --dataset=sonnet --precision=bf16 --steps=4":
        "the checkpoint the fp32 resume below reads; tests/test_precision.py moves "
        "checkpoints between precisions",
    "hpcnn train --model=gpt --dataset=sonnet --precision=fp32 --steps=4 --resume":
        "tests/test_precision.py moves checkpoints between precisions",
    MPI_HPCNN.format(2) + "train --model=gpt --pp=2 --schedule=1f1b --microbatches=8":
        "tests/test_train_pp.py: every schedule in the training loop against serial; the "
        "page's simulations stay",
    MPI_HPCNN.format(4) + "train --model=gpt --dp=2 --pp=2 --schedule=zb_h1":
        "4 ranks: tests/test_train_pp.py (dp x pp), tests/test_pipeline.py (zb_h1 at 3)",
    MPI_HPCNN.format(2) + "train --model=mlp --hidden=64,64,64 --pp=2 --schedule=interleaved":
        "tests/test_train_pp.py: every schedule, interleaved and uneven layouts, against serial",
    MPI_HPCNN.format(2) + "train --model=gpt --pp=2 --schedule=zb_v":
        "tests/test_train_pp.py: every schedule, zb_v among them, against serial",
    MPI_HPCNN.format(4) + "train --model=mlp --tp=4 --plan=auto":
        "4 ranks: tests/test_train_plan.py (planned per-layer layouts against serial)",
    MPI_HPCNN.format(2) + "train --model=gpt --dataset=sonnet --dim=32":
        "tests/test_train_gpt_plan.py: --plan=auto for the GPT against the layout given",
    MPI_HPCNN.format(2) + "train --model=gpt --dataset=sonnet --pp=2 --schedule=1f1b":
        "the measured log the Gantt chart below reads; tests/test_plan_timeline.py draws one",
    "hpcnn simulate --model=gpt --pp=2":
        "the predicted log the two reports below read; tests/test_plan_timeline.py simulates",
    "hpcnn report runs/gantt_": "tests/test_plan_timeline.py: predicted logs, the Gantt chart of "
                                "the measured and predicted ones, their trace",
    MPI_HPCNN.format(4) + "train --model=gpt --dp=2 --tp=2 --sequence_parallel":
        "4 ranks: tests/test_train_tp.py (sequence parallelism against serial on 2 ranks)",
    MPI_HPCNN.format(2) + "train --model=cnn --tp=2":
        "tests/test_train_tp.py: the CNN's training loop at tp = 2 against serial",
    MPI_HPCNN.format(2) + "train --model=gpt --dataset=sonnet --dp=2 --zero=1":
        "the log the report below reads; the zero=3 run stays, and tests/test_zero.py (every "
        "ZeRO stage against zero 0 on 2 ranks)",
    "hpcnn report runs/zero1.h5":
        "reads the zero=1 run above; tests/test_runlog.py (a run's report), "
        "tests/test_plan_timeline.py (hpcnn report)",
    "python benchmarks/throttled_link.py":
        "tests/test_netns_cluster.py: the hierarchical allreduce over a throttled link",
    "OMP_NUM_THREADS=1 python benchmarks/graph_eigs.py --nodes=1000000 --rounds":
        "shortened to the same size as the serial benchmark before it",
    "OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/graph_":
        "tests/test_graph.py: the distributed Lanczos and unite and conquer against ARPACK",
    "OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/graph_unite.py":
        "4 ranks: tests/test_graph.py (unite and conquer against ARPACK on 2)",
    "OMP_NUM_THREADS=1 python experiments/graph_partition.py":
        "an experiment's sweep; tests/test_gcn.py and tests/test_graph_coarsen.py run the "
        "partitions",
    "python analysis/graph_unite.py": "reads the graph_unite benchmark above",
    "python analysis/graph_partition.py": "reads the graph_partition experiment above",
    "OMP_NUM_THREADS=1 python experiments/graph_reduction.py":
        "an experiment's sweep; graph_features' stays, and tests/test_graph_coarsen.py",
    "python analysis/graph_reduction.py": "reads the graph_reduction experiment above",
    "OMP_NUM_THREADS=1 python experiments/graph_features.py":
        "an experiment's sweep; the page's serial benchmark stays, and "
        "tests/test_graph_preprocessing.py (spectral features)",
    "python analysis/graph_features.py": "reads the graph_features experiment above",
    "mpiexec -n 2 python -m mpi4py experiments/pipeline_bubble.py":
        "an experiment's sweep (tests/test_pipeline_experiment.py reads it): "
        "tests/test_pipeline.py runs every schedule against serial",
    "mpiexec -n 4 python -m mpi4py experiments/pipeline_bubble.py":
        "4 ranks: the sweep above (tests/test_pipeline_experiment.py reads both)",
    "python analysis/pipeline_": "reads a pipeline_bubble sweep above",
    "python experiments/plan_published.py":
        "the planner on two published runs of 22 B and 176 B parameters; hpcnn plan at 1024 "
        "devices stays (planning.md), tests/test_published_runs.py checks the runs' file",
    "python experiments/plan_scale.py":
        "the planner at 1.7 B and 145 B parameters; hpcnn plan at 1024 devices stays "
        "(planning.md), tests/test_plan_hybrid.py",
    "python analysis/plan_scale.py": "reads the plan_scale experiment above",
    "python experiments/plan_validation.py":
        "~12 s of measured runs; plan_portability's stay (the same hpcnn.validation_runs and "
        "hpcnn.plan.validation), with tests/test_plan_validation.py's own",
    "python analysis/plan_validation.py": "reads the plan_validation experiment above",
    "OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/oversubscribed.py":
        "a timing of this machine's cores under MPI waits (no hpcnn code path): 4 ranks on 2",
    "python experiments/plan_crossover.py":
        "measured runs; tests/test_plan_claims.py checks the boundary it measures",
    "python analysis/plan_crossover.py": "reads the plan_crossover experiment above",
    "PYTHONPATH=$PWD python benchmarks/plan_search.py":
        "tests/test_plan_search.py: the searches against exhaustive search",
    "python analysis/plan_search.py": "reads the plan_search benchmark above",
}
TIMEOUT = 300             # seconds per command: 8 ranks on 2 busy cores are slow, never stuck


def command_blocks(text: str) -> list[list[str]]:
    """The commands of each shell code block of a Markdown text (continuations joined)."""
    blocks = []
    for lang, body in re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        if lang.lower() not in SHELL_BLOCKS:
            continue
        joined = re.sub(r"\s*\\\n\s*", " ", body)
        blocks.append([ln.strip() for ln in joined.splitlines()
                       if ln.strip() and not ln.strip().startswith("#")])
    return blocks


def doc_pages() -> list[str]:
    """README.md, then every Markdown page under docs/ by path (those of :data:`NOT_COMMANDS`
    left out): the order in which their commands run."""
    pages = []
    for folder, dirs, files in os.walk(DOCS):
        dirs.sort()
        pages += [os.path.join(folder, f) for f in files if f.endswith(".md")]
    pages = sorted(pages, key=lambda p: os.path.relpath(p, DOCS).split(os.sep))
    return [README] + [p for p in pages if os.path.relpath(p, DOCS) not in NOT_COMMANDS]


def page_commands(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [c for block in command_blocks(f.read()) for c in block]


def doc_commands() -> list[tuple[str, str]]:
    """(page relative to the repository, command) of every command, in the order they run."""
    return [(os.path.relpath(page, ROOT), c) for page in doc_pages() for c in page_commands(page)]


def skip_reason(words: list[str]) -> str:
    if words[0] in SKIP:
        return f"{words[0]}: {SKIP[words[0]]}"
    if any("cupy" in w.lower() or w == "--device=gpu" for w in words):
        return "needs CuPy and a GPU"
    if any(w.endswith(("netns_cluster.py", "throttled_link.py")) for w in words):
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import netns_cluster
        why = netns_cluster.usable()
        return f"emulated cluster: {why}" if why else ""
    return ""


def split_env(words: list[str]) -> tuple[dict, list[str]]:
    """Leading ``NAME=value`` words (as in ``HPCNN_SHM=0 mpiexec ...``) and the command."""
    env = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, value = words[0].split("=", 1)
        env[name], words = value, words[1:]
    return env, words


def long_reason(command: str) -> str:
    """Why ``command`` (as written) is left to ``make test-long``: the entry of :data:`LONG`
    with the longest start that begins it, or ""."""
    starts = [start for start in LONG if command.startswith(start)]
    return LONG[max(starts, key=len)] if starts else ""


WRITES = ("--log=", "--checkpoint=", "--out=")


def files_of(command: str) -> tuple[set, set]:
    """(written, read): the files under runs/ that ``command`` writes and reads, each by its
    first part below runs/ (or runs/bench/), extension dropped. :data:`WRITES` options write,
    and an experiment or benchmark (its own name); any other word naming runs/ reads."""
    written, read = set(), set()
    for word in split_env(shlex.split(command, comments=True))[1]:
        script = re.fullmatch(r"(?:experiments|benchmarks)/(\w+)\.py", word)
        if script:
            written.add(script[1])
        elif "runs/" in word:
            part = word.split("runs/", 1)[1].removeprefix("bench/").split("/")[0]
            (written if word.startswith(WRITES) else read).add(os.path.splitext(part)[0])
    return written, read


def runnable(words: list[str]) -> list[str]:
    """``words`` as this test runs them: programs mapped, the repository's scripts by their
    full path (the commands run in a scratch directory), ``hpcnn train`` shortened."""
    out = []
    for w in words:
        if w.endswith(".py") and os.path.exists(os.path.join(ROOT, w)):
            w = os.path.join(ROOT, w)
        if w == "hpcnn" and (not out or out[-1] != "-m"):
            out += [sys.executable, "-m", "hpcnn"]
        elif w == "python":
            out.append(sys.executable)
        elif w == "mpiexec":
            out += [mpiexec(), *scripts.mpiexec_flags()]    # Open MPI: --oversubscribe
        else:
            out.append(w)
    for script, extra in SCRIPT_SHORTEN.items():
        if script in words:
            out += extra
    at = out.index("hpcnn") + 1 if "hpcnn" in out else len(out)
    if at < len(out) and out[at] == "train":
        resumed = any(w.startswith("--resume=") for w in words)
        out += SHORTEN + [f"--steps={2 if resumed else 1}"]
        if not any(w.startswith("--allreduce=") for w in words):
            out.append("--allreduce=mpi")
    return out


def test_the_blocks_are_found():
    """The parser sees the README's blocks: continuations joined, comments dropped, synopsis
    and Python blocks left out."""
    text = "x\n```\nhpcnn train --a=1 \\\n    --b=2   # note\n# alone\n\nhpcnn info\n```\n" \
           "```text\nhpcnn train [--key=value ...]\n```\n```python\ny = f(x)\n```\n"
    assert command_blocks(text) == [["hpcnn train --a=1 --b=2   # note", "hpcnn info"]]
    assert shlex.split(command_blocks(text)[0][0], comments=True)[-1] == "--b=2"
    assert split_env(["HPCNN_SHM=0", "mpiexec", "-n", "2"]) == ({"HPCNN_SHM": "0"},
                                                                ["mpiexec", "-n", "2"])
    shortened = runnable(["hpcnn", "train", "--steps=1000", "--resume=a.h5"])
    assert shortened[:3] == [sys.executable, "-m", "hpcnn"] and shortened[-2:] == [
        "--steps=2", "--allreduce=mpi"]                 # the last --steps wins
    readme = page_commands(README)
    assert 3 <= len(readme) and any(c.startswith("make test") for c in readme)
    commands = [c for _, c in doc_commands()]
    assert len(commands) >= 60 and any(c.startswith("mpiexec -n 8") for c in commands)


def test_the_pages_and_their_order():
    """README first, then docs/ by path (a page's folder before its name);
    a checkpoint is written before it is resumed."""
    pages = [os.path.relpath(p, ROOT) for p in doc_pages()]
    assert pages[0] == "README.md" and "docs/architecture.md" in pages
    assert pages[1:] == sorted(pages[1:], key=lambda p: p.split("/"))
    commands = [c for _, c in doc_commands()]
    saved = [i for i, c in enumerate(commands) if "--checkpoint=runs/gpt.ckpt.h5" in c]
    resumed = [i for i, c in enumerate(commands) if "--resume=runs/gpt.ckpt.h5" in c]
    assert saved and resumed and max(saved) < min(resumed)


def test_every_long_entry_names_a_command():
    """Each start in :data:`LONG` begins a documented command (an entry that no longer does
    would leave its command, edited on its page, to make test unnoticed)."""
    commands = [c for _, c in doc_commands()]
    stale = [start for start in LONG if not any(c.startswith(start) for c in commands)]
    assert not stale, f"LONG: no documented command starts with {stale}"


def test_the_long_commands_keep_their_inputs():
    """A command reading a file under runs/ comes after one writing it in the same run,
    make test's or make test-long's (:func:`files_of`): each run makes what its commands read."""
    wrote = {False: set(), True: set()}          # by the earlier commands of each run
    reads = 0
    for page, command in doc_commands():
        written, read = files_of(command)
        long = bool(long_reason(command))
        missing = sorted(read - wrote[long])
        assert not missing, (f"{page}: {command!r} reads runs/{missing}, which no earlier command "
                             f"of make test{'-long' if long else ''} writes: LONG must leave "
                             f"both to make test-long, or neither")
        reads += len(read)
        wrote[long] |= written
    assert reads >= 10                           # the reports, resumes and analyses are seen


class DocsRun:
    """The documentation's commands run in one scratch directory, each at most once per session.

    :meth:`result` runs a command the first time it is asked for and returns the same
    ``CompletedProcess`` afterwards. The docs test asks in documentation order; a test of an
    experiment may ask for that experiment's command (and its analysis) earlier, which is
    sound because an experiment reads nothing an earlier command wrote (its output folder is
    its own; the analysis reads only that folder). Such a test asks for every command whose
    files it reads, in documentation order (a result, failed or not, is kept).
    """

    def __init__(self, scratch):
        self.scratch = scratch
        listed = doc_commands()
        self.pages = [page for page, _ in listed]        # where each command is written
        self.commands = [command for _, command in listed]
        self.long = [long_reason(command) for command in self.commands]
        self.asker_is_long = False      # whether the asking test is long (the fixture sets it)
        self._results = {}

    def command_running(self, *words: str) -> int:
        """The index of the first documented command holding all of ``words`` (e.g. a script
        and ``-n``, ``2``); fails the calling test, naming the words, if there is none."""
        for index, command in enumerate(self.commands):
            split = shlex.split(command, comments=True)
            if all(w in split for w in words):
                return index
        pytest.fail(f"neither README.md nor docs/ has a command with {list(words)} any more: "
                    f"give this test its own run of the experiment (see tests/test_docs.py, "
                    f"DocsRun)")

    def result(self, index: int) -> subprocess.CompletedProcess:
        """The finished run of the documented command ``index`` (run now if not yet); fails the
        calling test on a timeout, and a test of make test asking for a command of :data:`LONG`."""
        if self.long[index] and not self.asker_is_long:
            pytest.fail(f"{self.commands[index]!r} is left to make test-long (LONG in "
                        f"tests/test_docs.py: {self.long[index]}), yet this test of make test "
                        f"reads its run: mark the test long too, or take the command out of LONG")
        if index not in self._results:
            assigned, words = split_env(shlex.split(self.commands[index], comments=True))
            # a shared window kept at free() is a leak, as in tests/mpi_util.run_mpi
            env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                       PYTHONWARNINGS="error:shm:ResourceWarning",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            env.update(assigned)
            cmd = runnable(words)
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                                   env=env, cwd=self.scratch)
            except subprocess.TimeoutExpired as e:
                p = subprocess.CompletedProcess(cmd, None, e.stdout or "", e.stderr or "")
            self._results[index] = p
        p = self._results[index]
        if p.returncode is None:
            pytest.fail(f"timed out after {TIMEOUT}s: {shlex.join(p.args)}\n{p.stdout}{p.stderr}")
        return p

    def succeeded(self, index: int) -> subprocess.CompletedProcess:
        """:meth:`result`, asserted to have exited 0 without a traceback."""
        p = self.result(index)
        assert p.returncode == 0, (f"{self.pages[index]}: {self.commands[index]}\n"
                                   f"ran as: {shlex.join(p.args)}\n--- stdout\n"
                                   f"{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}")
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
        return p


COMMANDS = doc_commands()


def command_params() -> list:
    """One pytest param a documented command, in their order; those of :data:`LONG` long."""
    return [pytest.param(index, id=f"{page}: {command}",
                         marks=[pytest.mark.long] if long_reason(command) else [])
            for index, (page, command) in enumerate(COMMANDS)]


@pytest.mark.parametrize("index", command_params())
def test_documented_command_runs(index, docs_run):
    assigned, words = split_env(shlex.split(docs_run.commands[index], comments=True))
    reason = skip_reason(words)
    if reason:
        pytest.skip(reason)
    docs_run.succeeded(index)


def test_the_options_page_lists_every_option():
    """The generated reference page (docs/hooks.py) has every TrainConfig option with its
    default, its range and its help comment, grouped as ``hpcnn train --help`` groups them."""
    import dataclasses
    import importlib.util
    from hpcnn.config import TrainConfig, describe
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(DOCS, "hooks.py"))
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.options_page()
    for field in dataclasses.fields(TrainConfig):
        assert f"`--{field.name}`" in page, field.name
    headings = [ln for ln in describe().splitlines() if not ln.startswith(" ")]
    assert [ln[3:] for ln in page.splitlines() if ln.startswith("## ")] == [
        h.rstrip(":").capitalize() for h in headings]
    assert "`mlp`, `cnn`, `gpt`, `gcn`" in page and "in [0, 1)" in page


def test_the_site_builds(tmp_path):
    """``mkdocs build --strict`` (as ``make docs`` runs it) succeeds: every page in the nav,
    every link and image found, the options page generated."""
    import importlib.util
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (the docs extra: "
                    f"pip install -e '.[docs]'; make test installs it)")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                        "-f", os.path.join(ROOT, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                       capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "options" / "index.html").exists()
