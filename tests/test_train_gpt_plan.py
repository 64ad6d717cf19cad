"""hpcnn train --model=gpt --plan=auto: the hybrid layout chosen by the planner
(:mod:`hpcnn.plan.auto`), its record in the run log, the same losses as that layout given
explicitly at 2 and 4 ranks, and its refusals."""
from dataclasses import replace

import pytest

from hpcnn import preflight
from hpcnn.config import ConfigError, parse_overrides
from hpcnn.datasets import for_config
from hpcnn.plan import hybrid, machine
from hpcnn.plan.auto import choose_gpt_layout
from mpi_util import run_mpi
from test_refusals import assert_refused, run_cli

GPT = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=4", "--n_layers=2",
       "--block_size=8", "--batch_size=8", "--plan=auto"]


def machine_text(pair_latency_s: float, pair_bytes_per_s: float, memory_bytes: float = 1e9,
                 pairs: int = 2) -> str:
    """A machine of ``pairs`` x 2 devices: pairs talking at the given cost, a slow network
    between the pairs, 1 GFLOP/s devices."""
    return f"""name = "pairs"
[device]
name = "test device"
memory_bandwidth = 1e10
memory_bytes = {memory_bytes}
[device.flops]
float32 = 1e9
float64 = 1e9
[[levels]]
name = "pair"
fanout = 2
latency_s = {pair_latency_s}
bandwidth = [[inf, {pair_bytes_per_s}]]
[[levels]]
name = "network"
fanout = {pairs}
latency_s = 1e-3
bandwidth = [[inf, 1e6]]
"""


def write_machine(tmp_path, name, *args, **kw):
    path = tmp_path / f"{name}.toml"
    path.write_text(machine_text(*args, **kw))
    return str(path)


CHEAP, DEAR = (1e-9, 1e15), (1e-1, 1e3)     # the pair's latency and bandwidth


@pytest.mark.parametrize("cost,tp_used", [(CHEAP, True), (DEAR, False)])
def test_the_choice_follows_the_cost_of_tensor_parallel_traffic(tmp_path, cost, tp_used):
    path = write_machine(tmp_path, "m", *cost)
    cfg = parse_overrides(GPT + ["--pad_vocab=4", f"--machine={path}"]).resolved()
    vocab = for_config(cfg).vocab
    run, rec = choose_gpt_layout(cfg, 4, vocab)
    assert (run.tp > 1) == tp_used, rec
    # the planner's own ranking, restricted to what hpcnn train --plan=auto runs (remat none
    # or full, one stage a rank, no sequence parallelism, one micro-batch without a
    # pipeline); the vocabulary padded to 4 is the same for every tp
    model = hybrid.Transformer(2, 16, 4, 8, -(-vocab // 4) * 4, 8, "float32")
    ranked = [q for q in hybrid.plan(model, machine.load(path), 4,
                                     allow={"sequence_parallel": {False}})
              if (q.layout.pp > 1 or q.layout.microbatches == 1)
              and q.layout.schedule in hybrid.ONE_STAGE_PER_RANK]
    assert {q.layout.remat for q in ranked} == {"none", "full"}
    first = next(q for q in ranked if q.feasible)
    assert rec["layout"] == str(first.layout) and rec["predicted_step_s"] == first.step_s
    assert (run.dp, run.tp, run.pp) == (first.layout.dp, first.layout.tp, first.layout.pp)
    if run.pp > 1:
        assert (run.schedule, run.microbatches) == (first.layout.schedule,
                                                     first.layout.microbatches)
    assert rec["layouts_considered"] == len(ranked)
    assert rec["predicted_memory_bytes_per_rank"] == first.memory_bytes
    assert rec["chosen_by"] == "least predicted step on pairs"


def test_options_given_constrain_the_search(tmp_path):
    path = write_machine(tmp_path, "m", *CHEAP)
    free = parse_overrides(GPT + [f"--machine={path}"]).resolved()
    vocab = for_config(free).vocab
    best, rec = choose_gpt_layout(free, 4, vocab)
    assert best.tp == 2 and best.pp == 2, rec
    run, fixed = choose_gpt_layout(parse_overrides(GPT + [f"--machine={path}", "--dp=4"]).resolved(), 4, vocab)
    assert (run.dp, run.tp, run.pp) == (4, 1, 1) and fixed["layouts_considered"] < rec["layouts_considered"]
    run, _ = choose_gpt_layout(parse_overrides(GPT + [f"--machine={path}", "--schedule=gpipe"]).resolved(), 4, vocab)
    assert run.pp == 1 or run.schedule == "gpipe"


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long)])
def test_planned_run_equals_the_layout_given_explicitly(tmp_path, n):
    path = write_machine(tmp_path, "m", *CHEAP, pairs=n // 2)
    out = run_mpi("train_gpt_plan", n, str(tmp_path), path, timeout=120)
    assert f"train_gpt_plan OK on {n} ranks" in out


def test_a_planned_stage_cut_runs_as_the_same_layout_given(tmp_path):
    """Three layers on two pipeline stages: only a planned cut fits; the run takes it as
    --layout (embedding on the first stage, final LayerNorm and LM head on the last)."""
    path = write_machine(tmp_path, "m", *CHEAP, pairs=1)
    out = run_mpi("train_gpt_plan", 2, str(tmp_path), path, "--n_layers=3", "--pp=2",
                  timeout=120)
    assert "train_gpt_plan OK on 2 ranks" in out and "stages " in out, out


def test_a_given_layout_constrains_the_cut(tmp_path):
    path = write_machine(tmp_path, "m", *CHEAP, pairs=1)
    cfg = parse_overrides(GPT + [f"--machine={path}", "--n_layers=3", "--layout=2|4"]).resolved()
    run, rec = choose_gpt_layout(cfg, 2, for_config(cfg).vocab)
    assert (run.pp, run.layout, rec["stage_layout"]) == (2, "2|4", "2|4"), rec
    assert "stages 1|2" in rec["layout"]
    # the planner's own cut of the same run (pp = 2 given), recorded and mapped to the chain
    free, rec = choose_gpt_layout(replace(cfg, layout="", pp=2), 2, for_config(cfg).vocab)
    sizes = [int(n) for n in free.layout.split("|")]
    assert rec["stage_layout"] == free.layout and sum(sizes) == 3 + 3 and len(sizes) == 2
    assert f"stages {sizes[0] - 1}|{sizes[1] - 2}" in rec["layout"], rec
    for bad in ("1|5", "2|5", "2|2|2"):      # no transformer block first; 4 of them; 3 stages
        cfg = parse_overrides(GPT + [f"--machine={path}", "--n_layers=3",
                                     f"--layout={bad}"]).resolved()
        with pytest.raises(ConfigError, match=f"no layout.*layout='{bad}'"):
            choose_gpt_layout(cfg, 2, for_config(cfg).vocab)


def test_refusals(tmp_path):
    tight = write_machine(tmp_path, "tight", *CHEAP, memory_bytes=1000)
    code, _, err = run_cli(GPT + [f"--machine={tight}"], tmp_path)
    assert_refused(code, err, "plan='auto'", "fits the", "'pairs'")
    code, _, err = run_cli(GPT + [f"--machine={tmp_path / 'nope.toml'}"], tmp_path)
    assert_refused(code, err, "nope.toml", "cannot read the machine file")
    code, _, err = run_cli(GPT + ["--remat=sqrt"], tmp_path)
    assert_refused(code, err, "remat='sqrt'", "remat none or full")
    code, _, err = run_cli(GPT + ["--dp=2"], tmp_path)          # one rank here
    assert_refused(code, err, "no layout", "on 1 rank(s)", "dp=2")
    code, _, err = run_cli(["--model=mlp", "--machine=x.toml"], tmp_path)
    assert_refused(code, err, "machine='x.toml'")
    assert not (tmp_path / "run.h5").exists()


def test_a_machine_smaller_than_the_world_is_refused(tmp_path):
    path = write_machine(tmp_path, "m", *CHEAP)            # 4 devices
    cfg = parse_overrides(GPT + [f"--machine={path}", f"--log={tmp_path / 'x.h5'}"]).resolved()
    with pytest.raises(ConfigError, match="holds 4 device.*--machine=FILE.*at least 8"):
        preflight.check(cfg, world_size=8)


def test_a_serial_planned_run_says_so_and_logs_the_choice(tmp_path):
    path = write_machine(tmp_path, "m", *CHEAP)
    code, out, err = run_cli(GPT + [f"--machine={path}", "--steps=1", "--progress=true",
                                    "--eval_batches=1"], tmp_path)
    assert code == 0, err
    assert "dp=1 x tp=1 x pp=1 on 1 rank(s) (planned: least predicted step on pairs)" in out
    from hpcnn.log import read_run
    rec = read_run(str(tmp_path / "run.h5")).plan["hybrid_layout"]
    assert rec["layouts_considered"] == 2 and rec["machine"] == path, rec   # remat none, full
    assert rec["remat"] == "none" and read_run(str(tmp_path / "run.h5")).plan["remat"] == "none"


def test_remat_full_is_chosen_where_only_it_fits_and_runs_as_priced(tmp_path):
    """A device memory between what remat full and remat none need: the planner's choice keeps
    each block's input (--remat=full), the run recomputes as the planner priced it, and
    --remat=full given keeps only such layouts."""
    from hpcnn.log import read_run
    big = parse_overrides(GPT + ["--batch_size=64", "--block_size=32", "--n_layers=4"])
    vocab = for_config(big.resolved()).vocab
    model = hybrid.Transformer(4, 16, 4, 32, vocab, 64, "float32")
    need = {r: hybrid.price(model, hybrid.Layout(1, 1, 1, 1, remat=r), machine.load(
        write_machine(tmp_path, "probe", *CHEAP, pairs=1))).memory_bytes for r in ("none", "full")}
    assert need["full"] < need["none"], need
    path = write_machine(tmp_path, "m", *CHEAP, memory_bytes=(need["full"] + need["none"]) / 2,
                         pairs=1)
    run, rec = choose_gpt_layout(replace(big.resolved(), machine=path), 1, vocab)
    assert (run.remat, rec["remat"]) == ("full", "full") and rec["layouts_feasible"] == 1, rec
    code, _, err = run_cli(GPT + ["--batch_size=64", "--block_size=32", "--n_layers=4",
                                  f"--machine={path}", "--steps=1", "--eval_batches=1"],
                           tmp_path)
    assert code == 0, err
    plan = read_run(str(tmp_path / "run.h5")).plan
    assert plan["remat"] == "full" and plan["hybrid_layout"]["remat"] == "full"
    (seq,) = {r["sequence"] for r in plan["remat_plans"]}
    assert plan["remat_plans"][0]["recomputed_forwards"] == 4 + 2, seq   # all but the head
    roomy = write_machine(tmp_path, "roomy", *CHEAP, pairs=1)
    run, rec = choose_gpt_layout(replace(big.resolved(), machine=roomy, remat="full"), 1, vocab)
    assert run.remat == "full" and rec["layouts_considered"] == 1, rec
