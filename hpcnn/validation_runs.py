"""The runs of a plan validation (experiments/plan_validation.py, whose docstring describes it):
calibrate this machine and measure layouts with ``hpcnn train`` under mpiexec, each run a job of
its own. The layouts, the log readings and the figures are :mod:`hpcnn.plan.validation`'s; this
module sits above ``hpcnn train`` (it runs it) and below the scripts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from hpcnn import scripts
from hpcnn.plan import machine, search
from hpcnn.plan import validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # where hpcnn is imported from
TRAIN = ["-m", "hpcnn", "train", "--progress=false", "--eval_interval=0", "--allreduce=mpi",
         "--dtype=float32"]


def mpi_command(ranks: int, args: list) -> list:
    return scripts.mpi_command(ranks, args)


def run_env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def calibrate(ranks: int, out: str, name: str = "machine.toml") -> str:
    """``hpcnn calibrate --write OUT/NAME`` on ``ranks`` ranks; returns the path."""
    path = os.path.join(out, name)
    subprocess.run(mpi_command(ranks, ["-m", "hpcnn", "calibrate", f"--write={path}"]),
                   cwd=ROOT, env=run_env(), check=True, stdout=subprocess.DEVNULL, timeout=900)
    return path


def measure(cases, ranks: int, steps: int, folder: str, tag: str) -> dict:
    """One run of every case in the given order; name -> read_log dict plus the load average."""
    out = {}
    for i, (name, args, _) in enumerate(cases):
        log = os.path.join(folder, f"{tag}-{i}.h5")
        load = os.getloadavg()[0]
        p = subprocess.run(mpi_command(ranks, TRAIN + args + [f"--steps={steps}", f"--log={log}"]),
                           cwd=ROOT, env=run_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, timeout=600)
        if p.returncode:
            raise RuntimeError(f"{name}: hpcnn train failed ({p.returncode}): {p.stderr[-2000:]}")
        out[name] = dict(validation.read_log(log), load1=load)
    return out


def confirm(cases: list, names: list, ranks: int, steps: int, rounds: int, folder: str,
            tag: str) -> dict:
    """Each layout of ``names`` measured ``rounds`` more times, the order reversed every other
    round; name -> step times, one per round (:func:`read_log`'s median)."""
    order = [next(c for c in cases if c[0] == name) for name in names]
    times = {name: [] for name in names}
    for r in range(rounds):
        got = measure(order if r % 2 == 0 else order[::-1], ranks, steps, folder, f"{tag}-r{r}")
        for name in names:
            times[name].append(got[name]["step_s"])
    return times


# ---------------------------------------------------------------- a whole validation

def layouts(a, out_dir: str, folder: str):
    """The GPT's and the MLP's cases of the options ``a`` (experiments/plan_validation.py's) and
    the first round's machine file (calibrated here unless ``--machine``): (models, path),
    models: name -> (cases, steps)."""
    gcases = validation.gpt_cases(scripts.ints(a.gpt), a.ranks, None if a.microbatches == "all" else
                          scripts.ints(a.microbatches))
    if a.gpt_layouts != "all":
        gcases = gcases[:int(a.gpt_layouts)]
    # the first round's machine, calibrated before the layouts are chosen: the MLP's least-price
    # layout on it (what --plan=auto runs) is always among those measured
    first = machine.resolve(a.machine) if a.machine else calibrate(a.ranks, out_dir,
                                                                   "machine-r0.toml")
    mcases = validation.mlp_cases(scripts.ints(a.hidden), a.mlp_batch, a.ranks, a.mlp_layouts, folder,
                          validation.machine_for(first, a.ranks))
    return {"gpt": (gcases, a.gpt_steps), "mlp": (mcases, a.mlp_steps)}, first


def rounds(a, models: dict, out_dir: str, folder: str, first: str, t0: float):
    """Each round: calibrate (unless ``--machine``), predict every layout on that round's
    machine, run every layout (the order reversed every other round). Returns (runs, preds,
    paths): model -> name -> one read_log dict / prediction per round; the machine files."""
    runs = {m: {name: [] for name, _, _ in cases} for m, (cases, _) in models.items()}
    preds = {m: {name: [] for name, _, _ in cases} for m, (cases, _) in models.items()}
    paths = []
    for r in range(a.rounds):
        path = first if r == 0 or a.machine else calibrate(a.ranks, out_dir,
                                                           f"machine-r{r}.toml")
        mach = validation.machine_for(path, a.ranks)
        paths.append(path)
        print(f"round {r + 1}: machine {mach.name} ({path}), {mach.p} devices, "
              f"float32 {mach.device.flops['float32'] / 1e9:.0f} GFLOP/s, efficiency "
              f"{mach.device.efficiency}", flush=True)
        for m, (cases, steps) in models.items():
            for name, _, predict in cases:
                preds[m][name].append(predict(mach))
            order = cases if r % 2 == 0 else cases[::-1]
            for name, got in measure(order, a.ranks, steps, folder, f"{m}-r{r}").items():
                runs[m][name].append(got)
        print(f"round {r + 1}/{a.rounds} done ({time.time() - t0:.0f} s)", flush=True)
    return runs, preds, paths


def figures(a, m: str, cases: list, steps: int, runs: dict, preds: dict, folder: str):
    """Model ``m``'s layout rows, its summary (None without layouts) and its confirmation's
    rows (``--confirm``: the choice and the fastest others measured again)."""
    choice = validation.least_priced(preds)
    rows = [validation.layout_row(m, name, runs[name], preds[name], steps, a.ranks, choice)
            for name, _, _ in cases]
    if not rows:
        return rows, None, []
    s = validation.summarize(m, rows, choice)
    times = {}
    if a.confirm and len(rows) > 1:
        times = confirm(cases, validation.confirm_names(rows, choice, a.confirm), a.ranks, steps,
                        a.confirm_rounds, folder, f"{m}-confirm")
    s.update(validation.confirm_summary(times, choice))
    for line in validation.summary_lines(s):
        print(line, flush=True)
    return rows, s, validation.confirm_rows(m, times, rows, choice)


def validate(a) -> int:
    """The validation of the options ``a`` (experiments/plan_validation.py's parser): runs,
    figures, OUT/results.h5."""
    out_dir = os.path.abspath(a.out)
    folder = os.path.join(out_dir, "runs")
    os.makedirs(folder, exist_ok=True)
    t0 = time.time()
    load_before = os.getloadavg()[0]
    models, first = layouts(a, out_dir, folder)
    print(f"{len(models['gpt'][0])} GPT and {len(models['mlp'][0])} MLP layouts, "
          f"{a.rounds} rounds", flush=True)
    runs, preds, paths = rounds(a, models, out_dir, folder, first, t0)
    graph = validation.mlp_graph(scripts.ints(a.hidden), a.mlp_batch)
    dra = "-".join(validation.cut_name(c, a.ranks) for c in search.dra(graph, a.ranks)[0])
    rows, summary, confirmed = [], [], []
    for m, (cases, steps) in models.items():
        mrows, s, crows = figures(a, m, cases, steps, runs[m], preds[m], folder)
        rows += mrows
        summary += [s] if s else []
        confirmed += crows
    load_after = os.getloadavg()[0]
    for s in summary:
        s.update(rounds=a.rounds, load_before=load_before, load_after=load_after,
                 dra=dra if s["model"] == "mlp" else "")
    attrs = {"machine": machine.load(paths[0]).name, "machine_file": ",".join(paths),
             "ranks": a.ranks, "command_line": " ".join(sys.argv), "wall_s": time.time() - t0}
    tables = {"layouts": rows, "summary": summary, **({"confirm": confirmed} if confirmed else {})}
    out = scripts.write_tables(os.path.join(a.out, "results.h5"), tables, attrs)
    print(f"load average {load_before:.2f} before, {load_after:.2f} after; "
          f"{time.time() - t0:.0f} s; wrote {out}")
    return 0

