"""The planner against measured runs: the layouts a validation runs and the figures it draws.

experiments/plan_validation.py (its docstring describes the experiment) runs the layouts built
here through :mod:`hpcnn.validation_runs`; its analyses (analysis/plan_phases.py, plan_confirm.py),
experiments/collective_waits.py, plan_crossover.py and plan_portability.py use the same
layouts, log readings and summaries. Nothing here starts a run: the layouts are names, ``hpcnn
train`` arguments and predictors (machine -> price); a run's figures are read from its log.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics

import h5py
import numpy as np

from hpcnn.schedule.placement import Cut, write_plan
from hpcnn.plan import cost, hybrid, machine, search

HIDDEN = "1024,1024"         # the MLP's hidden widths unless --hidden says otherwise
DIGITS = (64, 10)            # features and classes of the digits data set the MLP trains on


# ---------------------------------------------------------------- the layouts

def gpt_vocab(dataset: str = "sonnet") -> int:
    """The character vocabulary of the GPT's data set (what ``hpcnn train`` builds the model on)."""
    from hpcnn.config import TrainConfig
    from hpcnn import datasets
    return datasets.for_config(TrainConfig(model="gpt", dataset=dataset).resolved()).vocab


def gpt_args(shape, lay) -> list:
    """``hpcnn train`` arguments of the GPT ``shape`` (layers, width, heads, context, batch)
    under the layout ``lay`` (:class:`hpcnn.plan.hybrid.Layout`)."""
    n_layers, dim, heads, seq, batch = shape
    return ["--model=gpt", "--dataset=sonnet", f"--n_layers={n_layers}", f"--dim={dim}",
            f"--n_heads={heads}", f"--block_size={seq}", f"--batch_size={batch}",
            f"--dp={lay.dp}", f"--tp={lay.tp}", f"--pp={lay.pp}",
            f"--schedule={lay.schedule}", f"--microbatches={lay.microbatches}",
            f"--remat={lay.remat}"]


def gpt_cases(shape, ranks: int, microbatches) -> list:
    """(name, train arguments, predictor: machine -> Priced) of every GPT layout a validation
    runs: every dp x tp x pp of :func:`hpcnn.plan.hybrid.layouts`, one micro-batch when pp = 1
    and the counts of ``microbatches`` (None: all) when pp > 1, remat none first."""
    n_layers, dim, heads, seq, batch = shape
    vocab = gpt_vocab()
    cases = []
    every = hybrid.layouts(hybrid.Transformer(n_layers, dim, heads, seq, vocab, batch, "float32"),
                           ranks, remat=hybrid.REMAT, schedules=hybrid.ONE_STAGE_PER_RANK,
                           allow={"sequence_parallel": {False}})
    for lay in sorted(every, key=lambda lay: hybrid.REMAT.index(lay.remat)):   # stable
        if (lay.pp == 1 and lay.microbatches != 1) or (
                lay.pp > 1 and microbatches is not None and lay.microbatches not in microbatches):
            continue
        # hpcnn train pads the vocabulary to a multiple of tp: price the model it runs
        model = hybrid.Transformer(n_layers, dim, heads, seq, -(-vocab // lay.tp) * lay.tp,
                                   batch, "float32")
        cases.append((str(lay), gpt_args(shape, lay),
                      lambda m, model=model, lay=lay: hybrid.price(model, lay, m)))
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


def machine_for(path: str, ranks: int):
    """The machine file at ``path`` cut to ``ranks`` devices."""
    mach = machine.load(path)
    return mach if mach.p == ranks else mach.with_devices(ranks)


def value(pred) -> float:
    """A prediction's step time: Priced.step_s (GPT) or StrategyCost.seconds (MLP)."""
    return float(pred.step_s if hasattr(pred, "step_s") else pred.seconds)


# ---------------------------------------------------------------- a run's figures

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


def memory_from_log(got: list) -> float:
    """The largest rank's activations, parameters, gradients and optimizer state as the runs
    logged them (:func:`read_log`), the largest over rounds; -1 where not logged."""
    return float(max(g["memory_bytes"] for g in got))


# ---------------------------------------------------------------- the figures of a validation

def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    return float(np.mean(np.abs(pred - meas) / meas))


def layout_row(model: str, name: str, got: list, preds: list, steps: int, ranks: int,
               choice: str) -> dict:
    """One row of the ``layouts`` table: the layout ``name`` of ``model`` with its runs' figures
    (``got``: :func:`read_log` dicts with ``load1``, one per round) and its predictions (one per
    round); ``choice``: the planner's choice among the model's layouts."""
    meas = [g["step_s"] for g in got]
    lay = preds[0].layout if model == "gpt" else None
    return {
        "model": model, "layout": name,
        "dp": lay.dp if lay else 1, "tp": lay.tp if lay else ranks,
        "pp": lay.pp if lay else 1, "schedule": lay.schedule if lay else "",
        "microbatches": lay.microbatches if lay else 1,
        "remat": lay.remat if lay else "none",
        "pred_s": statistics.median(value(p) for p in preds),
        "pred_min_s": min(value(p) for p in preds),
        "pred_max_s": max(value(p) for p in preds),
        "meas_s": statistics.median(meas), "meas_min_s": min(meas),
        "meas_max_s": max(meas), "rounds": len(meas), "steps": steps,
        "load1": statistics.mean(g["load1"] for g in got),
        "pred_memory_bytes": float(preds[0].memory_bytes),
        "meas_act_bytes": max(g["act_bytes"] for g in got),
        "meas_param_bytes": max(g["param_bytes"] for g in got),
        "meas_rss_bytes": max(g["rss_bytes"] for g in got),
        "meas_memory_bytes": memory_from_log(got),
        "planner_choice": int(name == choice)}


def least_priced(preds: dict):
    """The planner's choice among the layouts run: the one of least median prediction
    (``preds``: name -> predictions, one per round); None when there are none."""
    return min(preds, key=lambda n: statistics.median(value(p) for p in preds[n])) \
        if preds else None


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


def summary_lines(s: dict) -> list:
    """What a validation prints of one model's summary ``s`` (:func:`summarize`, with
    :func:`confirm_summary`'s figures)."""
    lines = [f"{s['model']}: {s['layouts']} layouts, Kendall tau {s['kendall_tau']:.3f} "
             f"(p {s['tau_pvalue']:.2g}), MAPE {s['mape']:.1%} (after scale "
             f"{s['scale']:.3g}: {s['mape_scaled']:.1%}); choice {s['choice']} "
             f"{s['choice_meas_s'] * 1e3:.1f} ms, best {s['best']} "
             f"{s['best_meas_s'] * 1e3:.1f} ms ({s['choice_over_best'] - 1:+.1%}); "
             f"memory within {s['memory_max_error']:.1%} on {s['memory_rows']} layouts"]
    if s.get("confirm_layouts"):
        lines.append(f"{s['model']} confirmed ({s['confirm_layouts']} layouts, "
                     f"{s['confirm_rounds']} rounds side by side): best {s['confirm_best']}, "
                     f"choice {s['confirm_choice_over_best'] - 1:+.1%} (median of per-round "
                     f"ratios)")
    return lines


# ---------------------------------------------------------------- the confirmation

def confirm_names(rows: list, choice: str, k: int) -> list:
    """The planner's choice first, then the ``k`` layouts of least measured step time other
    than it: the layouts a confirmation measures again side by side."""
    others = sorted((r for r in rows if r["layout"] != choice), key=lambda r: r["meas_s"])
    return [choice] + [r["layout"] for r in others[:k]]


def confirm_rows(model: str, times: dict, rows: list, choice: str) -> list:
    """The ``confirm`` table's rows of ``model``: each layout measured again (``times``: name ->
    step times, one per round) with its sweep's figures (``rows``: its ``layouts`` rows)."""
    sweep = {r["layout"]: r for r in rows}
    return [{"model": model, "layout": n, "meas_s": statistics.median(t),
             "meas_min_s": min(t), "meas_max_s": max(t), "rounds": len(t),
             "sweep_meas_s": sweep[n]["meas_s"], "pred_s": sweep[n]["pred_s"],
             "planner_choice": int(n == choice)}
            for n, t in times.items()]


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
