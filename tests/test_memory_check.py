"""The memory check before any allocation (hpcnn/memory_check.py): the analytic parameter counts
against the built models, the GPT's need against the planner's price, the node's memory read from
/proc and the cgroup files (fake trees here), the ranks per node from the launcher, and the
refusal in one line: in this process, on the real 224 GiB GPT, and on 2 ranks under mpiexec."""
import contextlib
import io
import os
import subprocess
import sys
import time

import pytest

from hpcnn import datasets, memory_check
from hpcnn.cli import main
from hpcnn.config import ConfigError, parse_overrides
from hpcnn.memory_check import MemoryRefusal
from hpcnn.task import build_task
from mpi_util import ROOT, mpiexec

TINY_GPT = ["--model=gpt", "--dataset=sonnet", "--dim=8", "--n_heads=2", "--block_size=8",
            "--batch_size=4", "--eval_batches=1"]


def _cfg(*args):
    return parse_overrides(list(args)).resolved()


@pytest.mark.parametrize("args", [
    ["--model=mlp"], ["--model=mlp", "--hidden=7"], ["--model=mlp", "--hidden=32,16,8"],
    ["--model=cnn"], ["--model=cnn", "--channels=4"], ["--model=cnn", "--channels=2,4,6"],
    ["--model=gcn"], ["--model=gcn", "--hidden=5,3"], ["--model=gcn", "--spectral_features=2"],
    ["--model=gcn", "--dataset=lesmis", "--hidden=9"],
    TINY_GPT, [*TINY_GPT, "--n_layers=3", "--dim=12", "--n_heads=3", "--pad_vocab=16"],
    [*TINY_GPT, "--half_layers=true", "--block_size=5"],
    ["--model=gpt", "--max_plays=1", "--dim=16", "--n_layers=1", "--n_heads=4"],
])
def test_the_analytic_count_is_the_built_models(args):
    cfg = _cfg(*args)
    data = datasets.for_config(cfg)
    model = build_task(cfg, data=data, keep=()).model          # shapes only: no storage
    assert memory_check.param_count(cfg, data) == model.num_params(), args


def test_the_gpts_need_is_the_planners_price():
    """One stage, one micro-batch: what the planner charges a rank of the layout."""
    from hpcnn.config import padded_vocab
    from hpcnn.plan import hybrid, machine
    here = machine.load(os.path.join(ROOT, "machines", "local-2vcpu.toml"))
    for args, dp in (([], 1), (["--dim=64", "--n_layers=3", "--dp=2"], 2)):
        cfg = _cfg(*TINY_GPT, *args)
        data = datasets.for_config(cfg)
        model = hybrid.Transformer(cfg.n_layers, cfg.dim, cfg.n_heads, seq=cfg.block_size,
                                   vocab=padded_vocab(data.vocab, cfg), batch=cfg.batch_size,
                                   dtype=cfg.dtype)
        priced = hybrid.price(model, hybrid.Layout(dp, 1, 1, 1), here).memory_bytes
        assert memory_check.rank_need(cfg, data)[0] == pytest.approx(priced, rel=1e-12)
    # without momentum, SGD holds one word a parameter less
    cfg = _cfg(*TINY_GPT)
    data = datasets.for_config(cfg)
    adam = memory_check.rank_need(cfg, data)[0]
    plain = memory_check.rank_need(_cfg(*TINY_GPT, "--optimizer=sgd", "--momentum=0"), data)[0]
    params = memory_check.param_count(cfg, data) - 2 * cfg.dim      # (the planner's: no ln_f)
    assert adam - plain == pytest.approx(2 * 4 * params)


def test_a_split_model_needs_less_per_rank_and_the_defaults_are_tiny():
    for model in ("mlp", "cnn", "gcn", "gpt"):
        cfg = _cfg(f"--model={model}", "--max_plays=1")
        assert memory_check.rank_need(cfg, datasets.for_config(cfg))[0] < 256 * 2**20, model
    gpt = _cfg("--model=gpt", "--max_plays=1", "--n_layers=4")
    data = datasets.for_config(gpt)
    whole = memory_check.rank_need(gpt, data)[0]
    for split in (["--tp=2"], ["--pp=2"], ["--pp=4", "--microbatches=4"]):
        assert memory_check.rank_need(_cfg("--model=gpt", "--max_plays=1", "--n_layers=4",
                                           *split), data)[0] < whole, split
    mlp = _cfg("--model=mlp")
    mlp_data = datasets.for_config(mlp)
    full, remat = (memory_check.rank_need(_cfg("--model=mlp", f"--remat={r}"), mlp_data)[0]
                   for r in ("none", "full"))
    assert remat == 4 * 4 * memory_check.param_count(mlp, mlp_data) < full


# -- the node's memory ----------------------------------------------------------------------
def _tree(tmp_path, avail_kib=8 * 2**20, cgroup="0::/job\n", files=None):
    """A fake /proc (meminfo, self/cgroup) and /sys/fs/cgroup with ``files`` {path: text}."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {avail_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    root.mkdir()
    for path, text in (files or {}).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return dict(environ={}, proc=str(proc), cgroup_root=str(root))


def test_meminfo_alone(tmp_path):
    nbytes, source = memory_check.node_memory(**_tree(tmp_path))
    assert nbytes == 8 * 2**30 and source.startswith("MemAvailable in ")


def test_a_cgroup_v2_limit_lowers_it_page_cache_counted_free(tmp_path):
    files = {"job/memory.max": str(3 * 2**30), "job/memory.current": str(2 * 2**30),
             "job/memory.stat": f"anon 1\nactive_file {2**29}\ninactive_file {2**28}\n",
             "memory.max": "max", "memory.current": "5"}           # the root: no limit
    nbytes, source = memory_check.node_memory(**_tree(tmp_path, files=files))
    assert nbytes == 2**30 + 2**29 + 2**28 and "job/memory.max" in source
    loose = {"job/memory.max": str(64 * 2**30), "job/memory.current": "0"}
    assert memory_check.node_memory(**_tree(tmp_path / "b", files=loose))[0] == 8 * 2**30


def test_a_cgroup_v1_limit_lowers_it_and_a_parent_may_be_tighter(tmp_path):
    cgroup = "4:memory:/a/b\n3:cpu:/\n0::/\n"
    files = {"memory/a/b/memory.limit_in_bytes": str(4 * 2**30),
             "memory/a/b/memory.usage_in_bytes": str(2**30),
             "memory/a/memory.limit_in_bytes": str(2 * 2**30),
             "memory/a/memory.usage_in_bytes": str(2**30),
             "memory/memory.limit_in_bytes": "9223372036854771712",       # unlimited
             "memory/memory.usage_in_bytes": "7"}
    nbytes, source = memory_check.node_memory(**_tree(tmp_path, cgroup=cgroup, files=files))
    assert nbytes == 2**30 and os.path.join("memory", "a", "memory.limit_in_bytes,") in source


def test_the_environment_overrides_it(tmp_path):
    tree = _tree(tmp_path)
    tree["environ"] = {memory_check.ENV: "12345"}
    assert memory_check.node_memory(**tree) == (12345.0, f"{memory_check.ENV}=12345")
    tree["environ"] = {memory_check.ENV: "lots"}
    with pytest.raises(ConfigError, match=memory_check.ENV):
        memory_check.node_memory(**tree)
    assert memory_check.node_memory({}, proc=str(tmp_path / "nowhere")) is None


def test_ranks_on_the_node_from_the_launcher():
    r = memory_check.ranks_on_node
    assert r({"MPI_LOCALNRANKS": "3"}, 8) == (3, "MPI_LOCALNRANKS")
    assert r({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 8) == (2, "OMPI_COMM_WORLD_LOCAL_SIZE")
    slurm = {"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_STEP_NUM_TASKS": "11"}
    assert r(slurm, 11) == (3, "SLURM_STEP_TASKS_PER_NODE")
    assert r(slurm, 4)[0] == 1          # an allocation's step, not this job's ranks
    assert r({}, 8)[0] == 1 and r({}, 1) == (1, "one process")


# -- the refusal ----------------------------------------------------------------------------
def test_refused_in_one_line_naming_the_figures():
    cfg = _cfg(*TINY_GPT)
    data = datasets.for_config(cfg)
    need = memory_check.rank_need(cfg, data)[0]
    env = {memory_check.ENV: str(int(2 * need) + 1), "MPI_LOCALNRANKS": "2"}
    memory_check.check(cfg, data, 2, environ=env)              # 2 ranks fit
    env["MPI_LOCALNRANKS"] = "3"
    with pytest.raises(MemoryRefusal) as e:
        memory_check.check(cfg, data, 3, environ=env)
    line = str(e.value)
    assert "\n" not in line and isinstance(e.value, ConfigError)
    for part in ("GiB per rank", "for 3 ranks (MPI_LOCALNRANKS)", f"({memory_check.ENV}=",
                 "--dim, --n_layers or --batch_size", "--tp, --pp", "fewer ranks per node"):
        assert part in line, (part, line)
    memory_check.check(cfg.__class__(**{**cfg.to_dict(), "device": "gpu"}), data, 3,
                       environ=env)                          # not the host's memory: unchecked


def _train(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", "--progress=false", *args])
    return code, out.getvalue(), err.getvalue()


def test_the_224_gib_gpt_is_refused_before_anything_is_allocated(tmp_path):
    """Its first Linear alone would draw 224 GiB: one line and exit code 2, at once."""
    t0 = time.perf_counter()
    code, out, err = _train("--model=gpt", "--dim=100000", "--n_layers=1000", "--max_plays=1",
                            f"--log={tmp_path / 'run.h5'}")
    assert time.perf_counter() - t0 < 10
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("hpcnn train: invalid configuration: the gpt (n_layers=1000, "
                               "dim=100000") and "GiB per rank" in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "run.h5")


def test_refused_under_the_pretended_memory_and_run_with_enough(tmp_path, monkeypatch):
    monkeypatch.setenv(memory_check.ENV, "1000")
    code, _, err = _train(*TINY_GPT, "--steps=1", f"--log={tmp_path / 'a.h5'}")
    assert code == 2 and len(err.splitlines()) == 1 and "(HPCNN_MEMORY_BYTES=1000)" in err
    monkeypatch.setenv(memory_check.ENV, str(2**30))
    code, out, err = _train(*TINY_GPT, "--steps=1", f"--log={tmp_path / 'b.h5'}")
    assert code == 0 and "steps=1" in out, err


def test_every_rank_prints_the_line_and_exits_2_under_mpi(tmp_path):
    cmd = [mpiexec(), "-n", "2"]
    if "Open MPI" in subprocess.run([mpiexec(), "--version"], capture_output=True,
                                    text=True).stdout:
        cmd += ["--oversubscribe", "--allow-run-as-root"]
    cmd += [sys.executable, "-m", "mpi4py", "-m", "hpcnn", "train", *TINY_GPT, "--dp=2",
            "--progress=false", f"--log={tmp_path / 'run.h5'}"]
    # unbuffered streams, as some CI runners set: the ranks' lines still come whole
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HPCNN_MEMORY_BYTES="1000",
               PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and p.stdout == "" and len(lines) == 2, p.stderr
    assert sorted(ln.split(":")[1] for ln in lines) == [" rank 0 of 2", " rank 1 of 2"], lines
    assert all("needs" in ln and "for 2 ranks" in ln for ln in lines), lines
