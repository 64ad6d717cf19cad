"""``hpcnn simulate`` and ``hpcnn calibrate``: what they print, and their errors."""
import json
import os
import subprocess
import sys

import pytest

from hpcnn.cli_tools import cmd_simulate
from mpi_util import ROOT, mpiexec


def test_simulate_prints_the_bubble_and_a_chart(capsys):
    assert cmd_simulate(["--schedule=1f1b", "--ranks=4", "--microbatches=6", "--width=54"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "makespan 27 (all busy: 18); bubble 0.333, (S-1)/(M+S-1) = 0.333" in out
    assert "micro-batches in flight per rank (peak): 4 3 2 1" in out
    rows = [line for line in out if line.startswith("rank")]
    mbs = [line for line in out if line.startswith("     mb")]
    assert len(rows) == len(mbs) == 4 and all(len(r) == len("rank  0 |") + 54 + 1 for r in rows)
    for r in rows:                       # 2 columns a time unit: F 1, B 2, six of each per rank
        body = r.split("|")[1]
        assert body.count("F") == 6 * 2 and body.count("B") == 6 * 4, r
    assert cmd_simulate(["--schedule=zb_h1", "--ranks=4", "--microbatches=6", "--t_w=1"]) == 0
    out = capsys.readouterr().out                        # zero bubble: 3M + p - 1 at unit costs
    assert "makespan 21 (all busy: 18); bubble 0.143" in out and "W" in out
    assert "published formula: makespan 21, bubble 0.143" in out
    assert cmd_simulate(["--schedule=zb_v", "--virtual=2", "--ranks=4", "--microbatches=8",
                         "--t_w=1"]) == 0                # ZB-V: 6M + p - 1 chunk passes
    assert "makespan 51 (all busy: 48); bubble 0.059" in capsys.readouterr().out


def test_simulate_writes_the_predicted_timeline_as_a_run_log(tmp_path, capsys):
    from hpcnn.log import read_run
    from hpcnn.log.chrome import write_trace
    from hpcnn.schedule import pipeline as schedules
    path = tmp_path / "pred.h5"
    assert cmd_simulate(["--schedule=zb_h1", "--ranks=2", "--microbatches=4", "--t_w=1",
                         f"--log={path}"]) == 0
    run = read_run(path)
    sim = schedules.simulate(schedules.zb_h1(2, 4, 2), 1.0, 1.0, 1.0)
    want = sorted((r, i.kind, i.mb, t0, t1) for r, tl in enumerate(sim.timelines)
                  for i, t0, t1 in tl)
    t = run.timeline
    got = sorted(zip(t["rank"].tolist(), t["kind"].tolist(), t["microbatch"].tolist(),
                     t["t_start"].tolist(), t["t_end"].tolist()))
    assert got == want and run.attrs["predicted"]
    assert run.metrics["step_time"][0] == sim.makespan
    assert write_trace(path, tmp_path / "pred.json") == len(want) + 2 + sum(   # + 2 track names
        1 for e in json.loads((tmp_path / "pred.json").read_text())["traceEvents"]
        if e.get("cat") == "idle")


def test_simulate_errors(capsys):
    assert cmd_simulate(["--schedul=1f1b"]) == 2
    assert "unknown option '--schedul=1f1b' (did you mean --schedule?)" in capsys.readouterr().err
    assert cmd_simulate(["--schedule=fast"]) == 2
    assert "--schedule='fast': one of gpipe, 1f1b, interleaved, zb_h1, zb_v" in capsys.readouterr().err
    assert cmd_simulate(["--ranks=x"]) == 2
    assert "--ranks='x' is not a int" in capsys.readouterr().err
    assert cmd_simulate(["--ranks=0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert cmd_simulate(["--schedule=interleaved", "--ranks=4", "--microbatches=6",
                         "--virtual=2"]) == 2                # interleaving needs M % p == 0
    assert "hpcnn simulate:" in capsys.readouterr().err
    assert cmd_simulate(["--schedule=zb_v", "--ranks=4"]) == 2            # the V needs 2 per rank
    assert "4 stages given, 8 needed (virtual=2)" in capsys.readouterr().err
    assert cmd_simulate(["--help"]) == 0 and "--t_comm" in capsys.readouterr().out


@pytest.mark.long     # ~4 s; make test calibrates on 2 ranks (tests/test_allreduce.py: auto's
# calibration and its keyed file) and runs hpcnn calibrate's refusals (tests/test_machine.py)
def test_calibrate_under_mpi_and_alone(tmp_path):
    saved = tmp_path / "calibration.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HPCNN_CALIBRATION=str(saved))
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnn",
                        "calibrate"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("2 ranks") and lines[1].split()[0] == "bytes"
    assert lines[-1] == f"saved to {saved}"
    rows = [line.split() for line in lines[2:-1]]
    assert [int(r[0]) for r in rows] == [1 << k for k in range(10, 27, 2)]
    algos = lines[1].split()[1:-1]
    assert "mpi" in algos and all(r[-1] in algos for r in rows)
    assert all(float(v) > 0 for r in rows for v in r[1:-1])
    doc = json.loads(saved.read_text())            # what the runs on these 2 ranks will load
    assert doc["key"]["ranks"] == 2 and doc["key"]["dtype"] == "float32"
    assert doc["sizes"] == [int(r[0]) for r in rows] and list(doc["times"]) == algos
    assert [round(t * 1e6, 1) for t in doc["times"]["mpi"]] == [float(r[1]) for r in rows]
    bad = subprocess.run([sys.executable, "-m", "hpcnn", "calibrate", "--dtype=int8"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "--dtype='int8'" in bad.stderr
    for args, message in ((["--rounds=3"], "--rounds is read only with --write=FILE"),
                          ([f"--write={tmp_path / 'm.toml'}", "--dtype=float64"],
                           "--dtype is for the allreduce table")):
        odd = subprocess.run([sys.executable, "-m", "hpcnn", "calibrate", *args],
                             capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        assert odd.returncode == 2 and message in odd.stderr, odd.stderr
        assert not (tmp_path / "m.toml").exists()
    alone = subprocess.run([sys.executable, "-m", "hpcnn", "calibrate"], capture_output=True,
                           text=True, timeout=60, env=env, cwd=ROOT)
    assert alone.returncode == 2 and "one rank" in alone.stderr


def test_simulate_and_plan_refuse_bad_files_in_one_line(tmp_path, capsys):
    """A machine file or plan file that is missing, a directory, not text or not TOML/JSON, and
    a --log that cannot be written: one line naming the path, exit 2, nothing computed."""
    from hpcnn.cli_tools import cmd_plan
    (tmp_path / "folder").mkdir()
    (tmp_path / "bad.toml").write_text("x = = 1\n")
    (tmp_path / "bad.json").write_text('{"devices": 2\n')
    (tmp_path / "binary").write_bytes(b"\x89HDF\r\n\x1a\n\xff\xfe")
    t = str(tmp_path)
    cases = [
        ([f"--machine={t}/nope.toml"], f"{t}/nope.toml: no such machine file"),
        ([f"--machine={t}/folder"], f"{t}/folder: a directory, not a machine file"),
        ([f"--machine={t}/binary"], f"{t}/binary: not a TOML machine file (not text)"),
        ([f"--machine={t}/bad.toml"], f"{t}/bad.toml: not valid TOML")]
    for args, message in cases:
        for command, run in (("plan", cmd_plan), ("simulate", cmd_simulate)):
            extra = ["--model=gpt"] if command == "simulate" else []
            assert run(extra + args) == 2, (command, args)
            out = capsys.readouterr()
            assert out.out == "" and out.err.startswith(f"hpcnn {command}: {message}"), out.err
    for name, message in (("nope.json", "no such plan file"), ("folder", "a directory, not a "
                          "plan file"), ("binary", "not a JSON plan file (not text)"),
                          ("bad.json", "not JSON")):
        assert cmd_simulate(["--model=mlp", f"--plan={t}/{name}"]) == 2
        assert capsys.readouterr().err.startswith(f"hpcnn simulate: {t}/{name}: {message}")
    for log, message in (("folder", "a directory, not a file to write the run log into"),
                         ("bad.json/x.h5", f"cannot write the run log: {t}/bad.json is not a "
                                           f"directory")):
        assert cmd_simulate([f"--log={t}/{log}"]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err == f"hpcnn simulate: --log={t}/{log}: {message}\n"


def test_plan_exits_3_when_nothing_fits_and_refuses_top_0(capsys):
    from hpcnn.cli_tools import NOTHING_FITS, cmd_plan
    small = ["--n_layers=2", "--dim=64", "--n_heads=4", "--seq=32", "--vocab=65", "--batch=8",
             "--machine=local-2vcpu"]
    assert cmd_plan(small + ["--top=0"]) == 2
    assert capsys.readouterr().err == ("hpcnn plan: --top=0: the layouts to print must be "
                                       ">= 1\n")
    assert cmd_plan(small + ["--memory_gb=1e-6", "--top=2"]) == NOTHING_FITS == 3
    out = capsys.readouterr()
    assert "winner" not in out.out and out.out.count("(does not fit)") == 2
    assert out.err.startswith("hpcnn plan: no layout fits in memory (the least, ")
    assert out.err.count("\n") == 1
    assert cmd_plan(small + ["--memory_gb=1e-6", "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] is False and not doc["ranked"][0]["feasible"]
    assert cmd_plan(small + ["--json", "--top=1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] is True and len(doc["ranked"]) == 1


def test_plan_prices_zero_stages_when_asked(capsys):
    """``--zero=0,1`` adds each dp > 1 layout at ZeRO stage 1 (its JSON row says which);
    another stage is refused in one line."""
    import json
    from hpcnn.cli_tools import cmd_plan
    small = ["--n_layers=2", "--dim=64", "--n_heads=4", "--seq=32", "--vocab=65", "--batch=8",
             "--machine=local-2vcpu", "--json", "--top=1000"]
    assert cmd_plan(small) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cmd_plan(small + ["--zero=0,1"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert {r["zero"] for r in plain["ranked"]} == {0} and {r["zero"] for r in both["ranked"]} == {0, 1}
    assert both["layouts"] > plain["layouts"]
    assert all(r["layout"].endswith("zero 1") == (r["zero"] == 1) for r in both["ranked"])
    assert cmd_plan(small + ["--zero=3"]) == 0          # stage 3: only where pp = 1
    three = json.loads(capsys.readouterr().out)["ranked"]
    assert three and all(r["zero"] == 3 or r["layout"].startswith("dp=1 ") for r in three)
    assert all(" x pp=1," in r["layout"] for r in three if r["zero"] == 3), three
    assert cmd_plan(small + ["--zero=4"]) == 2
    assert capsys.readouterr().err == ("hpcnn plan: --zero=4: ZeRO stages are 0, 1, 2 and 3, "
                                       "e.g. --zero=0,1,2,3\n")


def test_plan_fixes_and_bounds_dimensions_and_gives_them_as_fields(capsys):
    """``--tp=2 --pp=1-2 --schedule=1f1b --remat=none`` keeps only such layouts; every JSON row
    has each dimension as a field, the memory by kind summing to the whole, and its two
    throughputs (hardware >= model, equal without recomputation); a bad bound is one line."""
    import json
    from hpcnn.cli_tools import cmd_plan
    small = ["--n_layers=4", "--dim=64", "--n_heads=4", "--seq=32", "--vocab=65", "--batch=24",
             "--machine=dgx-a100-cluster", "--devices=8", "--json", "--top=1000"]
    assert cmd_plan(small) == 0
    every = json.loads(capsys.readouterr().out)["ranked"]
    assert {r["microbatches"] for r in every} >= {3, 6, 12}      # not only powers of two
    assert cmd_plan(small + ["--tp=2", "--pp=1-2", "--schedule=1f1b", "--remat=none",
                             "--micro_batch_size=1,2"]) == 0
    some = json.loads(capsys.readouterr().out)["ranked"]
    assert some and len(some) < len(every)
    for r in some:
        assert r["tp"] == 2 and r["pp"] in (1, 2) and r["remat"] == "none"
        assert r["schedule"] in ("1f1b", "none") and r["micro_batch_size"] in (1, 2)
        assert r["dp"] * r["tp"] * r["pp"] == 8 and 24 == r["dp"] * r["microbatches"] * \
            r["micro_batch_size"]
        assert sum(r["memory_by_kind_gb"].values()) == pytest.approx(r["memory_gb"], rel=1e-12)
        assert r["hardware_tflops_per_device"] == pytest.approx(r["tflops_per_device"])
    full = [r for r in every if r["remat"] == "full"]
    assert full and all(r["hardware_tflops_per_device"] > r["tflops_per_device"] for r in full)
    assert cmd_plan(small + ["--tp=2-x"]) == 2
    assert capsys.readouterr().err.startswith("hpcnn plan: --tp=2-x: expected a number, bounds")
    assert cmd_plan(small + ["--schedule=zb_v"]) == 2
    assert "expected some of 1f1b, gpipe, zb_h1" in capsys.readouterr().err


def test_plan_explains_one_layout_term_by_term(capsys):
    """``--explain`` prints the step's parts (their seconds summing to the step), the memory
    by kind and the formula; a layout that does not fill the devices is one line, exit 2."""
    from hpcnn.cli_tools import cmd_plan
    small = ["--n_layers=4", "--dim=64", "--n_heads=4", "--seq=32", "--vocab=65", "--batch=24",
             "--machine=dgx-a100-cluster"]
    assert cmd_plan(small + ["--explain=dp=2,tp=2,pp=2,microbatches=4,remat=full"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("dp=2 x tp=2 x pp=2, 1f1b, 4 micro-batches, remat=full on 8 "
                             "devices of dgx-a100-cluster: ")
    step = float(out[0].split(": ")[1].split(" s a step")[0])
    parts = [float(line.split()[1]) for line in out[1:9]]
    assert {line.split()[0] for line in out[1:9]} == {
        "compute", "memory_bound", "tp_comm", "bubble", "pp_comm", "dp_comm", "optimizer", "held"}
    assert sum(parts) == pytest.approx(step, rel=1e-3)
    assert out[9].startswith("memory a device: ") and "activations" in out[9]
    assert cmd_plan(small + ["--devices=16", "--explain=dp=2,tp=2,pp=2"]) == 2
    assert "dp x tp x pp = 8, not the 16 devices" in capsys.readouterr().err
    assert cmd_plan(small + ["--explain=dp=2,tq=2"]) == 2
    assert "'tq=2': expected KEY=VALUE" in capsys.readouterr().err


def test_plan_prices_the_gradient_reduction_at_16_bits_when_asked(capsys):
    """``--grad_reduce_dtype=param``: the data-parallel reduction moves 2-byte gradients, so
    its seconds fall on a machine that does not overlap it; at ZeRO-2 or with float32, or an
    unknown type, one line and exit 2."""
    from hpcnn.cli_tools import cmd_plan
    small = ["--n_layers=4", "--dim=256", "--n_heads=4", "--seq=64", "--vocab=65", "--batch=32",
             "--machine=local-2vcpu", "--explain=dp=2,microbatches=2"]
    seconds = {}
    for g in ("fp32", "param"):
        assert cmd_plan(small + [f"--grad_reduce_dtype={g}"]) == 0
        line = [x for x in capsys.readouterr().out.splitlines() if x.split()[0] == "dp_comm"]
        seconds[g] = float(line[0].split()[1])
    assert 0 < seconds["param"] < seconds["fp32"]
    for bad, says in (("--grad_reduce_dtype=fp16", "grad_reduce fp32 or param"),
                      ("--zero=0,2", "grad_reduce='param' with ZeRO stage 2"),
                      ("--dtype=float32", "param with a 16-bit dtype")):
        extra = ["--grad_reduce_dtype=param"] if bad != "--grad_reduce_dtype=fp16" else []
        args = (small[:-1] if bad.startswith("--zero") else small) + extra + [bad]
        assert cmd_plan(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("hpcnn plan: ") and says in err and err.count("\n") == 1


def test_plan_offers_interleaving_and_sequence_parallelism_as_bounded_dimensions(capsys):
    """``--schedule=interleaved --virtual=2`` keeps interleaved layouts of two chunks a rank;
    ``--sequence_parallel=true`` keeps sequence-parallel ones (tp > 1), ``false`` none;
    ``--explain`` reads both; a bad value is one line, exit 2."""
    import json
    from hpcnn.cli_tools import cmd_plan
    small = ["--n_layers=8", "--dim=64", "--n_heads=4", "--seq=32", "--vocab=65", "--batch=24",
             "--machine=dgx-a100-cluster", "--devices=8", "--json", "--top=1000"]
    assert cmd_plan(small + ["--schedule=interleaved", "--virtual=2"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranked"]
    assert rows and all(r["schedule"] == "interleaved" and r["virtual"] == 2
                        and r["microbatches"] % r["pp"] == 0 for r in rows)
    assert "x2 chunks" in rows[0]["layout"]
    for flag, want in (("true", {True}), ("false", {False})):
        assert cmd_plan(small + [f"--sequence_parallel={flag}"]) == 0
        rows = json.loads(capsys.readouterr().out)["ranked"]
        assert {r["sequence_parallel"] for r in rows} == want
        assert all(r["tp"] > 1 for r in rows if r["sequence_parallel"])
    assert cmd_plan(small + ["--sequence_parallel=maybe"]) == 2
    assert "expected true, false or both" in capsys.readouterr().err
    assert cmd_plan(small[:-2] + ["--explain=dp=1,tp=2,pp=4,microbatches=4,schedule=interleaved,"
                                  "virtual=2,sequence_parallel=true,remat=selective"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dp=1 x tp=2 x pp=4, interleaved x2 chunks, 4 micro-batches, "
                          "remat=selective, sequence parallel on 8 devices")
