"""The planner held against published large-scale GPT training runs (issue 40).

For each run of ``experiments/published_runs.toml`` (:mod:`hpcnn.plan.published`: Narayanan
et al. SC 2021, Korthikanti et al. MLSys 2023, BLOOM 176B, NVIDIA NeMo on H100), on the machine
file of its device (``machines/dgx-a100-cluster.toml``, ``machines/dgx-h100-cluster.toml``), or of
its own system where the run names one (BLOOM: ``machines/jean-zay-a100.toml``), public figures
only, nothing fitted to these runs, cut to its device count:

- the **published layout** as the planner prices it: tp, pp, dp, ZeRO stage, sequence
  parallelism and recomputation as published (selective recomputation priced by
  :func:`hpcnn.plan.hybrid.price`, though ``hpcnn train`` does not run it); the micro-batch
  count from the published micro-batch size, or, where the source does not state it, the
  planner's best count for that tp x pp x dp; interleaved 1F1B with the published chunks per
  rank, priced as 1F1B where the source does not state them (said in the row);
- its predicted throughput per device in the published convention (hardware FLOP/s: the
  recomputed forward counted, Narayanan et al.'s eq. 3; model FLOP/s: not; MFU and HFU: those
  over the device's peak; iteration seconds) against the published figure;
- its predicted memory per device against the device's;
- its rank among the layouts the planner prices for the same model, devices and batch that
  its setting could run (:data:`SETTINGS`: the schedules, sequence parallelism, recomputation
  and ZeRO stages of its software; :data:`MEGATRON`: Megatron-LM's conditions on pipelines),
  priced as that software ran them (:func:`of_setting`; the first row of the same tp, pp and
  dp), the best of those, and the best of every layout priced.

It prints one row per run and a summary (median and largest |error|, runs in the top 3, runs
that fit), and saves the table ``plan_published`` to ``--out``, each row with the published
layout's step seconds by part (``compute_s``, ``pp_comm_s``, ...: ``hpcnn plan --explain``'s
terms). The runs at FP8 (NeMo's) are
priced at bfloat16, hpcnn's narrowest precision, and kept out of the summary.

    python experiments/plan_published.py [--out=runs/plan_published.h5] [--only=NAME,...]
"""
import argparse
import dataclasses
import math
import os
import sys
import time

from hpcnn.plan import hybrid, published
from hpcnn.plan.machine import load

# What each source's software could run (hpcnn.plan.hybrid's dimensions), for the rank of its
# layouts among those its setting offered: zero-bubble ZB-H1 (Qi et al., ICLR 2024) came after
# every run here; sequence parallelism and selective recomputation with Korthikanti et al.
# (2022); interleaving with Narayanan et al. (Megatron-LM, 2021); BLOOM's Megatron-DeepSpeed ran
# DeepSpeed's pipeline engine (1F1B, no interleaving) and its bf16 optimizer (ZeRO-1, README);
# the Megatron-LM runs of 2021-22 sharded no optimizer state (Narayanan et al.'s ZeRO-3 rows
# are DeepSpeed's, ranked within ZeRO-3); NeMo 24.07: Megatron-core's distributed optimizer.
SETTINGS = {
    "narayanan2021": {"schedule": {"1f1b", "gpipe", "interleaved"}, "sequence_parallel": {False},
                      "remat": {"none", "full"}},
    "korthikanti2023": {"schedule": {"1f1b", "gpipe", "interleaved"},
                        "remat": {"none", "full", "selective"}},
    "bloom2022": {"schedule": {"1f1b", "gpipe"}, "sequence_parallel": {False},
                  "remat": {"none", "full"}},
    "nemo2407": {"schedule": {"1f1b", "gpipe", "interleaved"},
                 "remat": {"none", "full", "selective"}},
}
ZERO = {"narayanan2021": (0,), "korthikanti2023": (0,), "bloom2022": (0, 1), "nemo2407": (0, 1)}
# What Megatron-LM, the software of every source but BLOOM's, could not run: the fewest
# pipeline stages interleaving takes (pp > 2 asserted from commit 182841f, 2021-03-20, to
# 3ee489d, 2024-05-31: megatron/arguments.py at de7dc40, the sc21 scripts' commit, and at
# 2755bcb, 2022-06-24), and in every version read a micro-batch count pp divides when
# interleaving (megatron/schedules.py at de7dc40 and 2755bcb, megatron/core/pipeline_parallel/
# schedules.py at 79c0f05, 2024-07-15, for NeMo 24.07) and stages of num_layers / pp layers
# each (megatron/model/transformer.py at de7dc40, megatron/mpu/initialize.py at 2755bcb,
# megatron/core/transformer/transformer_block.py at 79c0f05): no uneven cut. BLOOM's
# Megatron-DeepSpeed cut its 70 layers unevenly (DeepSpeed's pipeline engine).
MEGATRON = {"narayanan2021": 3, "korthikanti2023": 3, "nemo2407": 2}   # the fewest to interleave


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("runs", "plan_published.h5"))
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    return ap


def machine_for(run):
    """The run's machine file (its own system's or its device's), cut to its devices, with
    its data-parallel overlap where its source (or its software's default) says it
    (``dp_overlap``)."""
    machine = load(published.machine_name(run)).with_devices(run.devices)
    if run.dp_overlap is None:
        return machine
    return dataclasses.replace(machine, dp_overlap=run.dp_overlap)


def published_layout(run, model, machine) -> tuple:
    """(the published layout as priced, what the pricing left out)."""
    notes = []
    remat = {"full": "full", "selective": "selective", "none": "none", None: "full"}[
        run.recompute]
    interleaved = run.pp > 1 and ((run.virtual or 1) > 1 or (run.schedule or "").startswith(
        "interleaved"))
    schedule, virtual = "1f1b", 1
    if interleaved and (run.virtual or 1) > 1:
        schedule, virtual = "interleaved", run.virtual
    elif interleaved:
        notes.append("chunks per rank not published: interleaving priced as 1f1b")
    allow = {"tp": {run.tp}, "pp": {run.pp}, "dp": {run.dp}, "remat": {remat},
             "schedule": {schedule}, "virtual": {virtual},
             "sequence_parallel": {bool(run.sequence_parallel) and run.tp > 1}}
    if run.micro_batch:
        allow["micro_batch_size"] = {run.micro_batch}
    else:
        notes.append("micro-batch size not published: the planner's best")
    zero = (run.zero or 0,)
    if run.layers % run.pp == 0:
        best = hybrid.plan(model, machine, run.devices, zero=zero, allow=allow,
                           remat=hybrid.PRICED_REMAT)
        uniform = [q for q in best if not q.layout.stages] or best
        return uniform[0], notes
    # layers not a multiple of the stages: as even a cut as there is, the larger stages first
    # (BLOOM's 70 layers on 12 stages: 6 or 5 each)
    big, small = run.layers % run.pp, run.pp - run.layers % run.pp
    stages = (run.layers // run.pp + 1,) * big + (run.layers // run.pp,) * small
    notes.append(f"stages {'|'.join(map(str, stages))}")
    counts = [run.global_batch // (run.dp * run.micro_batch)] if run.micro_batch else [
        m for m in range(run.pp, run.global_batch // run.dp + 1)
        if (run.global_batch // run.dp) % m == 0]
    priced = [hybrid.price(model, hybrid.Layout(run.dp, run.tp, run.pp, m, "1f1b", remat,
                                                stages=stages, zero=run.zero or 0), machine)
              for m in counts]
    return min(priced, key=lambda q: q.step_s), notes


def predicted_throughput(run, model, q) -> tuple:
    """(predicted, published, what) in the published convention."""
    lay, step = q.layout, q.step_s
    hw = hybrid.hardware_flops_per_step(model, lay) / step / run.devices / 1e12
    mf = hybrid.flops_per_step(model) / step / run.devices / 1e12
    if run.tflops_per_device is not None:
        return (hw if run.flops_convention == "hardware" else mf), run.tflops_per_device, \
            f"{run.flops_convention} TFLOP/s"
    if run.iteration_seconds is not None:
        return step, run.iteration_seconds, "iteration s"
    raise ValueError(f"{run.name}: no throughput the experiment can compare")


def _local_ddp_pipelines(run, rows: list) -> list:
    """``rows`` (a setting's layouts) with the pipelined ones priced as Megatron-LM ran them
    in 2021: it refused its PyTorch-DDP wrapper (``--DDP-impl torch``) with more than one
    pipeline stage (megatron/training.py at de7dc40: "We only support local DDP with multiple
    micro-batches"), so a pipeline reduced its fp16 gradients after the backward (the
    published run's own reduction, not overlapped: :func:`model_for`'s change undone)."""
    model, local = published.model_of(run), dataclasses.replace(machine_for(run),
                                                                 dp_overlap=False)
    return sorted([r if r.layout.pp == 1 else hybrid.price(model, r.layout, local)
                   for r in rows], key=hybrid.plan_order)


def could_run(source: str, lay) -> bool:
    """Whether ``source``'s software could run ``lay``'s pipeline (:data:`MEGATRON`: uniform
    stages; interleaving on at least its fewest stages, with a micro-batch count pp divides)."""
    if source not in MEGATRON:
        return True
    if lay.stages and len(set(lay.stages)) > 1:
        return False
    if lay.schedule != "interleaved" or lay.virtual == 1:
        return True
    return lay.pp >= MEGATRON[source] and lay.microbatches % lay.pp == 0


def of_setting(run, every: list) -> list:
    """Those of ``every`` (priced layouts, in :func:`hybrid.plan`'s order) that ``run``'s
    software could run (:data:`SETTINGS`, :data:`ZERO`, :func:`could_run`; a ZeRO-3 run's
    among ZeRO-3 layouts), priced as it ran them (:func:`_local_ddp_pipelines`)."""
    setting, zero = SETTINGS[run.source], (3,) if run.zero == 3 else ZERO[run.source]
    ok = [r for r in every if r.layout.zero in zero and could_run(run.source, r.layout)
          and all(getattr(r.layout, dim) in allowed for dim, allowed in setting.items())]
    if run.source == "narayanan2021" and run.dp_overlap:
        ok = _local_ddp_pipelines(run, ok)
    return ok


def rank_of(run, model, machine, q) -> tuple:
    """(1-based rank of the published tp x pp x dp among the layouts its setting could run
    (:data:`SETTINGS`, :data:`ZERO`; a ZeRO-3 run among ZeRO-3 layouts), the best of those,
    the best of every layout the planner prices at ZeRO stages 0-3 (0 and 1 where the run
    reduces its gradients in 16 bits, which hpcnn's ZeRO-2 and 3 do not))."""
    stages = (0, 1) if model.grad_reduce == "param" else (0, 1, 2, 3)
    every = hybrid.plan(model, machine, run.devices, zero=stages, remat=hybrid.PRICED_REMAT)
    ok = of_setting(run, every)
    feasible = [r for r in ok if r.feasible] or ok
    overall = [r for r in every if r.feasible] or every
    lay = q.layout
    for k, r in enumerate(feasible, 1):
        if (r.layout.tp, r.layout.pp, r.layout.dp) == (lay.tp, lay.pp, lay.dp):
            return k, feasible[0], overall[0]
    return len(feasible) + 1, feasible[0], overall[0]


def model_for(run) -> tuple:
    """(the run's model as priced, what the pricing changed): a run that reduced its 16-bit
    gradients overlapped with the backward (Narayanan et al.'s PyTorch-DDP rows) is priced
    with hpcnn's overlapped float32 reduction, the engine's 16-bit ring being blocking."""
    model = published.model_of(run)
    if model.grad_reduce == "param" and run.dp_overlap:
        return dataclasses.replace(model, grad_reduce="fp32"), [
            "fp16 reduction overlapped: priced as hpcnn's overlapped fp32 one"]
    return model, []


def row_of(run) -> dict:
    machine, (model, changed) = machine_for(run), model_for(run)
    t0 = time.perf_counter()
    q, notes = published_layout(run, model, machine)
    notes = changed + notes
    pred, pub, what = predicted_throughput(run, model, q)
    k, best, overall = rank_of(run, model, machine, q)
    seconds = time.perf_counter() - t0
    return {"run": run.name, "devices": run.devices, "layout": str(q.layout),
            "predicted": pred, "published": pub, "what": what, "error": pred / pub - 1,
            "memory_gb": q.memory_bytes / 1e9, "device_gb": machine.device.memory_bytes / 1e9,
            "fits": int(q.feasible), "rank": k, "best": str(best.layout),
            "best_step_s": best.step_s, "step_s": q.step_s, "plan_s": seconds,
            "overall_best": str(overall.layout), "overall_best_step_s": overall.step_s,
            "notes": "; ".join(notes), "fp8": int(run.precision == "fp8"),
            **{f"{part}_s": part_s for part, part_s in q.parts.items()}}


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    only = {x for x in a.only.split(",") if x}
    runs = [r for r in published.load() if not only or r.name in only]
    if only - {r.name for r in runs}:
        print(f"plan_published: unknown run(s) {sorted(only - {r.name for r in runs})}",
              file=sys.stderr)
        return 2
    rows = []
    print(f"{'run':36} {'pred':>7} {'pub':>7} {'error':>7} {'mem GB':>7} {'rank':>5}  what; notes")
    for run in runs:
        r = row_of(run)
        rows.append(r)
        print(f"{r['run']:36} {r['predicted']:7.4g} {r['published']:7.4g} {r['error']:+7.1%} "
              f"{r['memory_gb']:7.1f}{'' if r['fits'] else '!'} {r['rank']:5d}  {r['what']}"
              f"{'; ' + r['notes'] if r['notes'] else ''}", flush=True)
    scored = [r for r in rows if not r["fp8"]]
    if scored:
        errs = sorted(abs(r["error"]) for r in scored)
        print(f"{len(scored)} runs (FP8 runs apart): median |error| {errs[len(errs) // 2]:.1%}, "
              f"largest {errs[-1]:.1%}; within 15 %: {sum(e <= 0.15 for e in errs)}; "
              f"published tp x pp x dp in the top 3 of its setting: "
              f"{sum(r['rank'] <= 3 for r in scored)}; "
              f"fits: {sum(r['fits'] for r in scored)}; slowest plan "
              f"{max(r['plan_s'] for r in scored):.2f} s")
    from hpcnn.log.results import save_table
    machines = dict.fromkeys(published.machine_name(r) for r in runs)    # the files priced on
    save_table(a.out, "plan_published", rows, {"machines": ",".join(machines)})
    print(f"table plan_published -> {a.out}")
    return 0 if math.isfinite(sum(r["error"] for r in rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
