"""``hpcnn train --remat``: the same parameters as without it, serial and under MPI, and the plan
(sequences, predicted and measured peaks) in the run log."""
import numpy as np
import pytest

from hpcnn.config import ConfigError, parse_overrides
from hpcnn.log import read_run
from hpcnn.log.report import headline
from hpcnn.memory import profile, rotor
from hpcnn.nn import models
from hpcnn.train import train

from mpi_util import CaseRuns

GPT = ("--model=gpt", "--dataset=sonnet", "--steps=4", "--batch_size=6", "--block_size=16",
       "--dim=16", "--n_heads=2", "--n_layers=4", "--dropout=0.1", "--dtype=float64",
       "--eval_interval=4", "--log_interval=2")


def _run(tmp_path, name, *args):
    return train(parse_overrides([f"--log={tmp_path / name}", "--progress=false", *args]))


def _budget_mib(frac):
    """A budget between the least feasible and store-all for the GPT above (vocab of the sonnet)."""
    from hpcnn import datasets as data
    vocab = data.shakespeare(fallback=True).vocab
    chain = models.gpt(vocab, 16, 4, 16, 2, dropout=0.1, dtype=np.float64)
    s = rotor.Solver(profile.of_chain(chain, (6, 16), need_dx=False), 500)
    return (s.least + frac * (s.top - s.least)) / 2**20


@pytest.mark.parametrize("mode", ["sqrt", "full", "optimal", "offload"])
def test_remat_training_equals_plain_training(tmp_path, mode):
    ref = _run(tmp_path, "none.h5", *GPT)
    extra = {"sqrt": ["--remat=sqrt"], "full": ["--remat=full"],
             "optimal": ["--remat=optimal", f"--memory_budget={_budget_mib(0.1)}"],
             "offload": ["--remat=optimal", f"--memory_budget={_budget_mib(0.1)}",
                         "--offload_gbps=50"]}[mode]
    out = _run(tmp_path, f"{mode}.h5", *GPT, *extra)
    for a, b in zip(ref["model"].params, out["model"].params):
        np.testing.assert_allclose(b.data, a.data, rtol=0, atol=1e-10, err_msg=a.name)
    r0, r1 = read_run(tmp_path / "none.h5"), read_run(tmp_path / f"{mode}.h5")
    np.testing.assert_allclose(r1.metrics["loss"], r0.metrics["loss"], rtol=0, atol=1e-10)
    plan = r1.plan
    assert plan["remat"] == (mode if mode in ("sqrt", "full") else "optimal")
    (rec,) = plan["remat_plans"]
    assert rec["recomputed_forwards"] > 0 and rec["sequence"].startswith("F_")
    (measured,) = plan["remat_measured_peak_bytes_per_rank"]
    assert 0 < measured and rec["predicted_peak_bytes"] < rec["store_all_bytes"]
    # one micro-batch: the rank's peak is the executor's, recomputed caches included
    assert plan["peak_activation_bytes_per_rank"] == [measured]
    if mode != "offload":            # no channel: the account follows the model exactly
        assert measured <= rec["predicted_peak_bytes"]
    else:                            # a copy slower than modelled holds its value longer, but an
        assert measured <= plan["memory_budget_bytes"]    # op waits for it rather than overflow
    if mode not in ("sqrt", "full"):
        assert rec["predicted_peak_bytes"] <= plan["memory_budget_bytes"]
    if mode == "full":      # a segment per block: every forward but the last block's runs again
        assert rec["recomputed_forwards"] == len(ref["model"].blocks) - 1, rec["sequence"]
    if mode == "offload":
        assert "OFF(" in rec["sequence"] and "PRE(" in rec["sequence"]
    # the executor timed the recomputed forwards (4 passes, each recomputing some), and the
    # report's one line shows budget, peaks and both overheads; store-all times nothing again
    (again,) = plan["remat_recompute_s_per_rank"]
    compute = float(np.sum(r1.ranks["compute_s"]))
    assert 0 < again < compute, (again, compute)
    line = headline(tmp_path / f"{mode}.h5")
    assert f"measured peak {measured / 2**20:.1f} MiB" in line, line
    assert f"measured overhead {compute / (compute - again):.2f}x" in line, line
    assert "val_loss" in line and "unigram entropy" in line, line
    assert "remat_recompute_s_per_rank" not in r0.plan


def test_show_schedule_prints_the_sequence_each_step_runs(tmp_path, capsys):
    """A serial step of two micro-batches (--grad_accum=2) is the one-stage list F B F B; each
    F and B runs its part of the stage's remat sequence, and the two parts make the whole."""
    out = _run(tmp_path, "show.h5", *GPT, "--remat=sqrt", "--grad_accum=2", "--steps=2",
               "--show_schedule=true", "--progress=true")
    lines = read_run(tmp_path / "show.h5").plan["step_schedule"][0]
    assert lines[0] == "rank 0 (dp 0, tp 0, pp 0)" and len(lines) == 5, lines
    heads = [ln.strip().split(":")[0] for ln in lines[1:]]
    assert heads == ["F(mb=0, stage=0)", "B(mb=0, stage=0)", "F(mb=1, stage=0)",
                     "B(mb=1, stage=0)"]
    seq = out["remat_plans"][0]["sequence"]
    for f, b in ((1, 2), (3, 4)):
        ops = lines[f].split(": ")[1] + " " + lines[b].split(": ")[1]
        assert ops == seq, (ops, seq)
    assert "the first step as each rank ran it" in capsys.readouterr().out


def test_remat_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="needs --memory_budget"):
        _run(tmp_path, "a.h5", *GPT, "--remat=optimal")
    with pytest.raises(ConfigError, match="offload_gbps=1.0 needs remat='optimal'"):
        _run(tmp_path, "a.h5", *GPT, "--remat=sqrt", "--offload_gbps=1")
    with pytest.raises(ConfigError, match="zb_h1"):
        _run(tmp_path, "a.h5", *GPT, "--remat=sqrt", "--pp=2", "--schedule=zb_h1")
    with pytest.raises(ConfigError, match="below the least feasible"):
        _run(tmp_path, "a.h5", *GPT, "--remat=optimal", "--memory_budget=0.001")


REMAT_LAYOUTS = [(2, 2, 1), (2, 1, 2), (4, 2, 2)]


@pytest.fixture(scope="module")
def remat_runs(tmp_path_factory):
    """The two 2-rank layouts share one job (one start-up per rank)."""
    return CaseRuns([(n, "train_remat", (CaseRuns.FOLDER, dp, pp)) for n, dp, pp in REMAT_LAYOUTS],
                    folder=tmp_path_factory.mktemp("train_remat"), timeout=400)


@pytest.mark.parametrize("n,dp,pp", [pytest.param(*layout, marks=pytest.mark.long)
                                     if layout[0] == 4 else layout for layout in REMAT_LAYOUTS])
def test_remat_under_mpi_equals_serial(remat_runs, n, dp, pp):
    out = remat_runs.stdout(n, "train_remat", CaseRuns.FOLDER, dp, pp)
    assert f"train_remat OK on {n} ranks (dp={dp}, pp={pp})" in out


@pytest.mark.parametrize("remat", ["none", "full"])
def test_priced_memory_is_what_the_run_holds(tmp_path, remat):
    """The planner's memory per rank (hybrid.price) against what a serial run logs: the engine's
    peak activations, and the parameter, gradient and optimizer bytes of the real arrays (AdamW:
    two moments and one scratch array the size of the largest parameter)."""
    from hpcnn import datasets as data
    from hpcnn.plan import hybrid, machine
    out = _run(tmp_path, f"{remat}.h5", *GPT, f"--remat={remat}", "--dropout=0")
    plan = read_run(tmp_path / f"{remat}.h5").plan
    params = [q.data.nbytes for q in out["model"].params]
    assert plan["param_bytes_per_rank"] == [sum(params)]
    assert plan["grad_bytes_per_rank"] == [sum(params)]
    assert plan["optimizer_bytes_per_rank"] == [2 * sum(params) + max(params)]
    (act,) = plan["peak_activation_bytes_per_rank"]
    if remat == "none":          # store-all: every cache of the one micro-batch, by spec
        x = np.zeros((6, 16), dtype=np.int64)
        assert act == sum(s.bytes_cache for s in out["model"].spec(x.shape))
    vocab = data.shakespeare(fallback=True).vocab
    priced = hybrid.price(hybrid.Transformer(4, 16, 2, 16, vocab, 6, "float64"),
                          hybrid.Layout(1, 1, 1, 1, remat=remat),
                          machine.load(machine.resolve("local-2vcpu"))).memory_bytes
    held = act + 2 * sum(params) + plan["optimizer_bytes_per_rank"][0]
    assert abs(priced / held - 1) < 0.10, (priced, held)
