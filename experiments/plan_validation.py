"""Does the planner's cost model rank the layouts this machine runs? Predicted against measured.

What: on ``--ranks`` ranks of this machine (issue 13, "Done when", second bullet),

1. **calibrate**: ``hpcnn calibrate --write OUT/machine-rR.toml`` on those ranks at the start of
   every round R (or ``--machine=FILE`` for all): the only figures the predictions use. A round's
   layouts are predicted on that round's machine and a layout's prediction is the median over
   rounds, as its measurement is: on a shared machine the rates drift between rounds, and a
   calibration taken once would price every round with one moment's load;
2. **enumerate** the layouts ``hpcnn train`` runs:

   - a GPT (``--gpt=L,D,H,T,B``: layers, width, heads, context, global batch; sonnet, float32):
     every dp x tp x pp of :func:`hpcnn.plan.hybrid.layouts` with one micro-batch when pp = 1 and
     every micro-batch count it has (``--microbatches``: all, 1 to 32 at batch 32; or a list)
     with each schedule (1f1b, gpipe, zb_h1) when pp > 1, each with
     remat none and full (``hpcnn train --remat=full``: every block's input kept and its
     forward run again, the planner's ``remat="full"``; not with zb_h1, which ``hpcnn train``
     does not rematerialize), the remat none layouts first;
   - an MLP on digits (``--hidden``, float32, ``--mlp_batch``): per Linear one of the cuts
     whose parts are powers of two dividing p (:func:`cut_options`: on 2 ranks data parallel
     Cut(2,1,1), row Cut(1,2,1), column Cut(1,1,2) or replicated Cut(1,1,1); on 4 ranks ten,
     the mixed ones such as Cut(2,1,2) included), written as plan files for ``hpcnn train
     --model=mlp --tp=p --plan=FILE``: every combination (``--mlp_layouts=all``: 64 on 2 ranks,
     1000 on 4) or N of them (always the uniform ones, the DRA's choice and the least BSP
     price on the first round's machine, the rest a seeded sample);

3. **measure** each with ``mpiexec -n p python -m mpi4py -m hpcnn train ... --log=``, the
   layouts' order reversed every other round (``--rounds``), the run's figure the median
   ``step_time`` after its first 20 % of steps (as benchmarks/loop_ab.py), the layout's figure
   the median over rounds; **predict** with :func:`hpcnn.plan.hybrid.price` (GPT) and
   :func:`hpcnn.plan.cost.strategy_cost` (MLP) on each round's calibrated machine;
4. per model: Kendall tau (scipy.stats.kendalltau) and MAPE of predicted against measured, the
   MAPE again after one constant scale per model (the geometric mean of measured / predicted:
   what is left is ranking error, not a uniform offset), and the planner's choice against the
   best measured: for the GPT the least priced layout (what ``hybrid.plan`` ranks first among
   these), for the MLP the layout of least BSP price (what ``--plan=auto`` runs where the
   machine file holds the ranks: ``search.least_price``); the DRA's cuts (SAPP's volumes, the
   choice on larger machines) are recorded apart, in the summary's ``dra`` column.

Memory: every row holds the planner's memory per rank (``hybrid.price().memory_bytes`` for the
GPT, ``cost.strategy_cost().memory_bytes`` for the MLP) and what the run logged
(``meas_memory_bytes``, :func:`read_log`): per rank the engine's peak activation bytes (the
caches its micro-batches hold between passes, a rematerialized pass's inside peak) plus the
bytes of its parameter, gradient and optimizer arrays, the largest rank's; transients inside a
pass (a product's output, message buffers) are in neither. Also the largest resident set size
(``/ranks`` peak_mem_bytes, which includes the interpreter and the data).

    python experiments/plan_validation.py [--machine=FILE] [--out=runs/plan_validation]
        [--rounds=3] [--gpt_steps=12] [--mlp_steps=40] [--mlp_layouts=16] [--confirm=0]
    python analysis/plan_validation.py runs/plan_validation/results.h5 docs/figures/plan_validation.png

5. **confirm** (``--confirm=N``, ``--confirm_rounds=R``): the best of a sweep is the least of
   many noisy medians, measured minutes away from the choice (under load, launch to launch
   noise is 7-13 % here), so it is biased low. The planner's choice and the N fastest other
   layouts are measured again, R rounds alternated, and the choice is compared with the best
   of these round by round (``confirm_choice_over_best``: the median of per-round ratios).
   The sweep's ``choice_over_best`` is kept as measured.

Output: OUT/results.h5, tables ``layouts`` (one row per layout: ``pred_s`` the median prediction,
``pred_min_s``/``pred_max_s`` its range over rounds), ``summary`` (one per model) and, with
``--confirm``, ``confirm`` (one row per layout measured again), the machine
files OUT/machine-rR.toml when calibrated here, the plan files and run logs under OUT/runs.
"""
import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import h5py  # noqa: E402
import numpy as np  # noqa: E402

from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.schedule.placement import Cut, write_plan  # noqa: E402
from hpcnn.plan import cost, hybrid, machine, search  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec") if os.path.exists(os.path.join(BIN, "mpiexec")) \
    else "mpiexec"
TRAIN = ["-m", "hpcnn", "train", "--progress=false", "--eval_interval=0", "--allreduce=mpi",
         "--dtype=float32"]
HIDDEN = "1024,1024"         # the MLP's hidden widths unless --hidden says otherwise
DIGITS = (64, 10)            # features and classes of the digits data set the MLP trains on


def mpi_command(ranks: int, args: list) -> list:
    return [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py"] + args


def run_env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def calibrate(ranks: int, out: str, name: str = "machine.toml") -> str:
    """``hpcnn calibrate --write OUT/NAME`` on ``ranks`` ranks; returns the path."""
    path = os.path.join(out, name)
    subprocess.run(mpi_command(ranks, ["-m", "hpcnn", "calibrate", f"--write={path}"]),
                   cwd=ROOT, env=run_env(), check=True, stdout=subprocess.DEVNULL, timeout=900)
    return path


# ---------------------------------------------------------------- the layouts

def gpt_vocab(dataset: str = "sonnet") -> int:
    """The character vocabulary of the GPT's data set (what ``hpcnn train`` builds the model on)."""
    from hpcnn.config import TrainConfig
    from hpcnn import datasets as data
    return data.for_config(TrainConfig(model="gpt", dataset=dataset).resolved()).vocab


def gpt_cases(shape, ranks: int, microbatches) -> list:
    """(name, train arguments, predictor: machine -> Priced) of every GPT layout run here (see the
    module docstring)."""
    n_layers, dim, heads, seq, batch = shape
    vocab = gpt_vocab()
    cases = []
    every = hybrid.layouts(hybrid.Transformer(n_layers, dim, heads, seq, vocab, batch, "float32"),
                           ranks, remat=hybrid.REMAT)
    for lay in sorted(every, key=lambda lay: hybrid.REMAT.index(lay.remat)):   # stable
        if (lay.pp == 1 and lay.microbatches != 1) or (
                lay.pp > 1 and microbatches is not None and lay.microbatches not in microbatches):
            continue
        # hpcnn train pads the vocabulary to a multiple of tp: price the model it runs
        model = hybrid.Transformer(n_layers, dim, heads, seq, -(-vocab // lay.tp) * lay.tp,
                                   batch, "float32")
        args = ["--model=gpt", "--dataset=sonnet", f"--n_layers={n_layers}", f"--dim={dim}",
                f"--n_heads={heads}", f"--block_size={seq}", f"--batch_size={batch}",
                f"--dp={lay.dp}", f"--tp={lay.tp}", f"--pp={lay.pp}",
                f"--schedule={lay.schedule}", f"--microbatches={lay.microbatches}",
                f"--remat={lay.remat}"]
        cases.append((str(lay), args, lambda m, model=model, lay=lay: hybrid.price(model, lay, m)))
    return cases


CHOICES = {"dp": lambda p: Cut(p, 1, 1), "row": lambda p: Cut(1, p, 1),
           "col": lambda p: Cut(1, 1, p), "rep": lambda p: Cut(1, 1, 1)}


def mlp_graph(hidden, batch: int) -> cost.Graph:
    """The MLP's chain of Linear layers (ReLU between them) as the planner sees it."""
    return cost.mlp_graph([DIGITS[0], *hidden, DIGITS[1]], batch)


def cut_options(p: int) -> dict:
    """name -> Cut of every cut of one Linear over p ranks (:func:`hpcnn.plan.search.cut_options`):
    dp, row, col and rep for the four that use all p ranks one way or none, ``bBkKjJ`` (batch,
    reduce and output parts) for the mixed ones (p >= 4)."""
    named = {make(p): name for name, make in CHOICES.items()}
    return {named.get(c, f"b{c.batch}k{c.reduce}j{c.out}"): c for c in search.cut_options(p)}


def cut_name(cut: Cut, p: int) -> str:
    for name, c in cut_options(p).items():
        if c == cut:
            return name
    return str(cut)


def mlp_layouts(graph: cost.Graph, ranks: int, count, seed: int = 0, extra=()) -> list:
    """Tuples of cut names (:func:`cut_options`), one per Linear: all of them, or ``count`` of
    them including the uniform dp, row, col and rep ones, the DRA's choice and the tuples in
    ``extra`` (the least BSP price), the rest a seeded sample."""
    n = len(graph.ops)
    every = list(itertools.product(cut_options(ranks), repeat=n))
    if count == "all" or int(count) >= len(every):
        return every
    dra = tuple(cut_name(c, ranks) for c in search.dra(graph, ranks)[0])
    chosen = [tuple([c] * n) for c in CHOICES]
    for lay in (dra, *extra):
        if lay in every and lay not in chosen:
            chosen.append(lay)
    rest = [lay for lay in every if lay not in chosen]
    random.Random(seed).shuffle(rest)
    return (chosen + rest)[:max(int(count), 1)]


def mlp_cases(hidden, batch: int, ranks: int, count, folder: str, mach=None) -> list:
    """(name, train arguments, predictor: machine -> StrategyCost) per MLP layout; writes each
    plan file. With a machine, the layout of least BSP price on it is among them."""
    graph = mlp_graph(hidden, batch)
    best = search.least_price(graph, ranks, mach, "float32") if mach is not None else None
    extra = [tuple(cut_name(c, ranks) for c in best[0])] if best else []
    return [mlp_case(hidden, batch, ranks, names, folder)
            for names in mlp_layouts(graph, ranks, count, extra=extra)]


def mlp_case(hidden, batch: int, ranks: int, names, folder: str, tag: str = "") -> tuple:
    """(name, train arguments, predictor: machine -> StrategyCost) of one MLP layout (choice
    names, one per Linear); writes its plan file ``folder/plan-{tag}{name}.json``."""
    options = cut_options(ranks)
    cuts = [options[c] for c in names]
    name = "-".join(names)
    path = os.path.join(folder, f"plan-{tag}{name}.json")
    write_plan(path, cuts, ranks)
    args = ["--model=mlp", "--dataset=digits", f"--hidden={','.join(map(str, hidden))}",
            f"--batch_size={batch}", f"--tp={ranks}", f"--plan={path}"]
    graph = mlp_graph(hidden, batch)
    return name, args, lambda m: cost.strategy_cost(graph, cuts, m, "float32")


# ---------------------------------------------------------------- measuring

def steady_median(per_step) -> float:
    """The median of a run's per-step figures after its first 20 % of steps (the warm-up)."""
    return float(np.median(np.asarray(per_step)[len(per_step) // 5:]))


def read_log(path: str) -> dict:
    """The run's median step time after its first 20 % of steps and its logged peaks: per rank
    the engine's peak activation bytes plus its parameter, gradient and optimizer bytes
    (``/plan``, :func:`hpcnn.engine.record.record_memory`), the largest rank's sum; the
    largest resident set size (``/ranks``)."""
    with h5py.File(path, "r") as f:
        t = f["metrics/step_time"][...]
        rss = f["ranks"]["peak_mem_bytes"] if "ranks" in f else np.array([-1])
        plan = dict(f["plan"].attrs) if "plan" in f else {}
    parts = [json.loads(plan[k]) if k in plan else None for k in
             ("peak_activation_bytes_per_rank", "param_bytes_per_rank", "grad_bytes_per_rank",
              "optimizer_bytes_per_rank")]
    held = [sum(r) for r in zip(*parts)] if all(parts) else []
    return {"step_s": steady_median(t),
            "rss_bytes": int(np.max(rss)) if len(rss) else -1,
            "act_bytes": int(max(parts[0])) if parts[0] else -1,
            "param_bytes": int(max(parts[1])) if parts[1] else -1,
            "memory_bytes": int(max(held)) if held else -1}


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
        out[name] = dict(read_log(log), load1=load)
    return out


def memory_from_log(got: list) -> float:
    """The largest rank's activations, parameters, gradients and optimizer state as the runs
    logged them (:func:`read_log`), the largest over rounds; -1 where not logged."""
    return float(max(g["memory_bytes"] for g in got))


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    return float(np.mean(np.abs(pred - meas) / meas))


def summarize(model: str, rows: list, choice: str) -> dict:
    """Kendall tau, MAPE (raw and after one scale), the planner's choice against the best."""
    from scipy.stats import kendalltau
    pred = np.array([r["pred_s"] for r in rows])
    meas = np.array([r["meas_s"] for r in rows])
    if len(rows) >= 2:
        tau, pvalue = kendalltau(pred, meas)
    else:
        tau, pvalue = math.nan, math.nan
    scale = float(np.exp(np.mean(np.log(meas / pred))))
    best = rows[int(np.argmin(meas))]
    chosen = next(r for r in rows if r["layout"] == choice)
    priced = rows[int(np.argmin(pred))]
    mem = [(r["pred_memory_bytes"], r["meas_memory_bytes"]) for r in rows
           if r["pred_memory_bytes"] > 0 and r["meas_memory_bytes"] > 0]
    return {"model": model, "layouts": len(rows), "kendall_tau": float(tau),
            "tau_pvalue": float(pvalue), "mape": mape(pred, meas),
            "scale": scale, "mape_scaled": mape(scale * pred, meas),
            "choice": choice, "choice_meas_s": chosen["meas_s"], "best": best["layout"],
            "best_meas_s": best["meas_s"], "choice_over_best": chosen["meas_s"] / best["meas_s"],
            "priced_best": priced["layout"],
            "priced_best_over_best": priced["meas_s"] / best["meas_s"],
            "memory_rows": len(mem),
            "memory_max_error": max((abs(p / m - 1) for p, m in mem), default=math.nan)}


def confirm_names(rows: list, choice: str, k: int) -> list:
    """The planner's choice first, then the ``k`` layouts of least measured step time other
    than it: the layouts :func:`confirm` measures again side by side."""
    others = sorted((r for r in rows if r["layout"] != choice), key=lambda r: r["meas_s"])
    return [choice] + [r["layout"] for r in others[:k]]


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


def confirm_summary(times: dict, choice: str) -> dict:
    """The confirmation's best (least median step time) and the choice against it: the median
    over rounds of the choice's step time over the best's in the same round (1.0 when the
    choice is the best). Empty figures (nan) without a confirmation."""
    if not times:
        return {"confirm_layouts": 0, "confirm_rounds": 0, "confirm_best": "",
                "confirm_choice_over_best": math.nan}
    best = min(times, key=lambda n: statistics.median(times[n]))
    ratio = statistics.median(c / b for c, b in zip(times[choice], times[best]))
    return {"confirm_layouts": len(times), "confirm_rounds": len(times[choice]),
            "confirm_best": best, "confirm_choice_over_best": float(ratio)}


def machine_for(path: str, ranks: int):
    """The machine file at ``path`` cut to ``ranks`` devices."""
    mach = machine.load(path)
    return mach if mach.p == ranks else mach.with_devices(ranks)


def value(pred) -> float:
    """A prediction's step time: Priced.step_s (GPT) or StrategyCost.seconds (MLP)."""
    return float(pred.step_s if hasattr(pred, "step_s") else pred.seconds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="", help="machine file; default: calibrate here, "
                    "once per round")
    ap.add_argument("--out", default="runs/plan_validation")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpt", default="4,128,4,64,32", help="layers,dim,heads,context,batch")
    ap.add_argument("--microbatches", default="all", help="micro-batch counts when pp > 1: "
                    "all (every count hpcnn.plan.hybrid.layouts has), or a list")
    ap.add_argument("--gpt_steps", type=int, default=12)
    ap.add_argument("--gpt_layouts", default="all", help="all, or the first N")
    ap.add_argument("--hidden", default=HIDDEN)
    ap.add_argument("--mlp_batch", type=int, default=256)
    ap.add_argument("--mlp_steps", type=int, default=40)
    ap.add_argument("--mlp_layouts", default="16", help="all (4**layers), or N")
    ap.add_argument("--confirm", type=int, default=0, help="after the sweep, measure the "
                    "planner's choice and the N fastest other layouts again, side by side")
    ap.add_argument("--confirm_rounds", type=int, default=5)
    a = ap.parse_args(argv)
    out_dir = os.path.abspath(a.out)
    folder = os.path.join(out_dir, "runs")
    os.makedirs(folder, exist_ok=True)
    t0 = time.time()
    load_before = os.getloadavg()[0]

    gpt = [int(v) for v in a.gpt.split(",")]
    gcases = gpt_cases(gpt, a.ranks, None if a.microbatches == "all" else
                       [int(m) for m in a.microbatches.split(",")])
    if a.gpt_layouts != "all":
        gcases = gcases[:int(a.gpt_layouts)]
    hidden = [int(v) for v in a.hidden.split(",")]
    # the first round's machine, calibrated before the layouts are chosen: the MLP's least-price
    # layout on it (what --plan=auto runs) is always among those measured
    first = machine.resolve(a.machine) if a.machine else calibrate(a.ranks, out_dir,
                                                                   "machine-r0.toml")
    mcases = mlp_cases(hidden, a.mlp_batch, a.ranks, a.mlp_layouts, folder,
                       machine_for(first, a.ranks))
    models = {"gpt": (gcases, a.gpt_steps), "mlp": (mcases, a.mlp_steps)}
    print(f"{len(gcases)} GPT and {len(mcases)} MLP layouts, {a.rounds} rounds", flush=True)

    # each round: calibrate (unless --machine), predict every layout on that round's machine,
    # run every layout; a layout's prediction is the median over rounds, as its measurement is
    runs = {m: {name: [] for name, _, _ in cases} for m, (cases, _) in models.items()}
    preds = {m: {name: [] for name, _, _ in cases} for m, (cases, _) in models.items()}
    paths = []
    for r in range(a.rounds):
        path = first if r == 0 or a.machine else calibrate(a.ranks, out_dir,
                                                           f"machine-r{r}.toml")
        mach = machine_for(path, a.ranks)
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

    def pred_s(m, name):
        return statistics.median(value(p) for p in preds[m][name])

    # the planner's choice among the layouts run: the least priced one (median prediction)
    choices = {m: min((name for name, _, _ in cases), key=lambda n, m=m: pred_s(m, n))
               if cases else None for m, (cases, _) in models.items()}
    graph = mlp_graph(hidden, a.mlp_batch)
    dra = "-".join(cut_name(c, a.ranks) for c in search.dra(graph, a.ranks)[0])

    rows, summary, confirmed = [], [], []
    for m, (cases, steps) in models.items():
        mrows = []
        for name, args, _ in cases:
            got = runs[m][name]
            meas = [g["step_s"] for g in got]
            first = preds[m][name][0]
            lay = first.layout if m == "gpt" else None
            mrows.append({
                "model": m, "layout": name,
                "dp": lay.dp if lay else 1, "tp": lay.tp if lay else a.ranks,
                "pp": lay.pp if lay else 1, "schedule": lay.schedule if lay else "",
                "microbatches": lay.microbatches if lay else 1,
                "remat": lay.remat if lay else "none",
                "pred_s": pred_s(m, name),
                "pred_min_s": min(value(p) for p in preds[m][name]),
                "pred_max_s": max(value(p) for p in preds[m][name]),
                "meas_s": statistics.median(meas), "meas_min_s": min(meas),
                "meas_max_s": max(meas), "rounds": len(meas), "steps": steps,
                "load1": statistics.mean(g["load1"] for g in got),
                "pred_memory_bytes": float(first.memory_bytes),
                "meas_act_bytes": max(g["act_bytes"] for g in got),
                "meas_param_bytes": max(g["param_bytes"] for g in got),
                "meas_rss_bytes": max(g["rss_bytes"] for g in got),
                "meas_memory_bytes": memory_from_log(got),
                "planner_choice": int(name == choices[m])})
        if mrows:
            s = summarize(m, mrows, choices[m])
            times = {}
            if a.confirm and len(mrows) > 1:
                names = confirm_names(mrows, choices[m], a.confirm)
                times = confirm(cases, names, a.ranks, steps, a.confirm_rounds, folder,
                                f"{m}-confirm")
                sweep = {r["layout"]: r["meas_s"] for r in mrows}
                confirmed += [{"model": m, "layout": n, "meas_s": statistics.median(t),
                               "meas_min_s": min(t), "meas_max_s": max(t), "rounds": len(t),
                               "sweep_meas_s": sweep[n], "pred_s": pred_s(m, n),
                               "planner_choice": int(n == choices[m])}
                              for n, t in times.items()]
            s.update(confirm_summary(times, choices[m]))
            summary.append(s)
            print(f"{m}: {s['layouts']} layouts, Kendall tau {s['kendall_tau']:.3f} "
                  f"(p {s['tau_pvalue']:.2g}), MAPE {s['mape']:.1%} (after scale "
                  f"{s['scale']:.3g}: {s['mape_scaled']:.1%}); choice {s['choice']} "
                  f"{s['choice_meas_s'] * 1e3:.1f} ms, best {s['best']} "
                  f"{s['best_meas_s'] * 1e3:.1f} ms ({s['choice_over_best'] - 1:+.1%}); "
                  f"memory within {s['memory_max_error']:.1%} on {s['memory_rows']} layouts",
                  flush=True)
            if times:
                print(f"{m} confirmed ({s['confirm_layouts']} layouts, {s['confirm_rounds']} "
                      f"rounds side by side): best {s['confirm_best']}, choice "
                      f"{s['confirm_choice_over_best'] - 1:+.1%} (median of per-round ratios)",
                      flush=True)
        rows += mrows
    load_after = os.getloadavg()[0]
    for s in summary:
        s.update(rounds=a.rounds, load_before=load_before, load_after=load_after,
                 dra=dra if s["model"] == "mlp" else "")
    attrs = {"machine": machine.load(paths[0]).name, "machine_file": ",".join(paths),
             "ranks": a.ranks, "command_line": " ".join(sys.argv), "wall_s": time.time() - t0}
    out = os.path.join(a.out, "results.h5")
    save_table(out, "layouts", rows, attrs=attrs)
    save_table(out, "summary", summary, attrs=attrs)
    if confirmed:
        save_table(out, "confirm", confirmed, attrs=attrs)
    print(f"load average {load_before:.2f} before, {load_after:.2f} after; "
          f"{time.time() - t0:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
