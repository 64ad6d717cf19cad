"""``hpcnn simulate`` (a pipeline schedule's predicted timeline, no MPI) and ``hpcnn calibrate``
(the allreduce table ``--allreduce=auto`` would use on these ranks, saved for them; with
``--write=FILE`` the machine file of these ranks instead, :mod:`hpcnn.plan.calibrate`)."""
from __future__ import annotations

import difflib
import os
import sys

SIMULATE = {"schedule": ("1f1b", str, "gpipe | 1f1b | interleaved | zb_h1 | zb_v"),
            "ranks": (4, int, "pipeline ranks"),
            "microbatches": (8, int, "micro-batches per step"),
            "virtual": (1, int, "stages per rank (interleaved; gpipe; zb_v: 2)"),
            "t_f": (1.0, float, "forward time of a stage and micro-batch"),
            "t_b": (2.0, float, "backward time (input and weight gradients: t_b + t_w)"),
            "t_w": (0.0, float, "of which weight gradients, split off by zb_h1 and zb_v"),
            "t_comm": (0.0, float, "time a message takes between stages"),
            "width": (72, int, "columns of the chart"),
            "log": ("", str, "also write the predicted timeline as a run log (hpcnn report, --trace)"),
            "model": ("", str, "gpt | mlp: a planned step's timeline on --machine instead "
                               "(hpcnn/plan/timeline.py; t_f, t_b, t_w, ranks unused)"),
            "machine": ("local-2vcpu", str, "machine file (machines/*.toml) for --model"),
            "dp": (1, int, "gpt: data-parallel ranks"), "tp": (1, int, "gpt: tensor-parallel ranks"),
            "pp": (1, int, "gpt: pipeline stages (--schedule, --microbatches as above)"),
            "remat": ("none", str, "gpt: none | full"),
            "n_layers": (2, int, "gpt: blocks"), "dim": (64, int, "gpt: width"),
            "n_heads": (4, int, "gpt: heads"), "seq": (64, int, "gpt: context length"),
            "vocab": (65, int, "gpt: vocabulary"),
            "batch": (16, int, "gpt, mlp: global batch (sequences, rows)"),
            "dtype": ("float32", str, "gpt, mlp: bfloat16 | float16 | float32 | float64"),
            "plan": ("", str, "mlp: plan file ({\"devices\": p, \"layers\": [...]})"),
            "widths": ("64,256,256,10", str, "mlp: input, hidden..., output widths")}


def _options(args, spec, command):
    """``--key=value`` pairs checked against ``spec``: (values, None) or (None, error message).
    Read as ``hpcnn train`` reads its options (:func:`hpcnn.config.split_option`): a boolean
    option alone is true (``--json``), ``--no-json`` false."""
    from hpcnn.config import ConfigError, convert, needs_value, split_option
    out = {k: v[0] for k, v in spec.items()}
    types = {k: v[1] for k, v in spec.items()}
    for a in args:
        try:
            key, raw = split_option(a, types)
        except ConfigError:
            key, raw = "", None
        if key not in spec:
            near = difflib.get_close_matches(key, spec, n=1)
            hint = f" (did you mean --{near[0]}?)" if near else ""
            return None, f"hpcnn {command}: unknown option {a!r}{hint}"
        if raw is None:
            return None, f"hpcnn {command}: {needs_value(key)}"
        try:
            out[key] = convert(key, raw, bool) if types[key] is bool else types[key](raw)
        except (ValueError, ConfigError):
            return None, f"hpcnn {command}: --{key}={raw!r} is not a {types[key].__name__}"
    return out, None


def input_problem(path: str, what: str) -> str:
    """What is wrong with ``path`` as an input file (``what``: "machine file", "plan file"), in
    a few words naming it; '' when it is a file this process can read."""
    if not os.path.exists(path):
        return f"{path}: no such {what}"
    if os.path.isdir(path):
        return f"{path}: a directory, not a {what}"
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        return f"{path}: cannot read the {what}: {e.strerror or e}"
    return ""


def output_problem(path: str, what: str) -> str:
    """What keeps ``path`` from being written (``what``: "figure", "trace"), in a few words
    naming it; '' when its folder exists or can be made and takes a new file
    (:func:`hpcnn.log.paths.creation_problem`)."""
    from hpcnn.log.paths import creation_problem
    if os.path.isdir(path):
        return f"{path}: a directory, not a file to write the {what} into"
    why = creation_problem(path)
    return f"{path}: cannot write the {what}: {why}" if why else ""


def load_machine(name: str):
    """The machine file ``name`` (a path, or a name under machines/; '' this machine's, as
    ``hpcnn train`` finds it), loaded; a ValueError of one line naming the file otherwise."""
    from hpcnn.plan import machine as machines
    name = name or os.environ.get(machines.ENV, "")
    if not name:
        return machines.this_machine()
    path = machines.resolve(name)
    bad = input_problem(path, "machine file")
    if bad:
        raise ValueError(bad)
    try:
        return machines.load(path)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a TOML machine file (not text)") from None


def load_cut_plan(path: str):
    """(cuts, devices) of the JSON plan file ``path`` (:func:`hpcnn.schedule.placement.read_plan`);
    a ValueError of one line naming the file otherwise."""
    import json

    from hpcnn.schedule.placement import read_plan
    bad = input_problem(path, "plan file") if path else "--model=mlp needs --plan=FILE (the cuts)"
    if bad:
        raise ValueError(bad)
    try:
        cuts = read_plan(path)
        with open(path) as f:
            return cuts, json.load(f)["devices"]
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a JSON plan file (not text)") from None


def _help(command, spec):
    lines = [f"usage: hpcnn {command} [--key=value ...]", "", "options (default, meaning):"]
    lines += [f"  --{k}={str(v[0]).lower() if v[1] is bool else v[0]!s:<8} {v[2]}"
              for k, v in spec.items()]
    flags = [k for k, v in spec.items() if v[1] is bool]
    if flags:
        from hpcnn.config import flags_note
        lines += ["", flags_note(flags[0])]
    return "\n".join(lines)


def chart(sim, n_ranks: int, width: int) -> list[str]:
    """Two text lines per rank: the op running in each time column (F, B, W, '.' idle) and its
    micro-batch (0-9, then a-z)."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    scale = width / sim.makespan if sim.makespan > 0 else 0.0
    lines = []
    for r in range(n_ranks):
        ops, mbs = ["."] * width, [" "] * width
        for ins, t0, t1 in sim.timelines[r]:
            a, b = int(round(t0 * scale)), max(int(round(t0 * scale)) + 1, int(round(t1 * scale)))
            for c in range(a, min(b, width)):
                ops[c], mbs[c] = ins.kind, digits[ins.mb % len(digits)]
        lines += [f"rank {r:>2} |{''.join(ops)}|", f"     mb |{''.join(mbs)}|"]
    return lines


def cmd_simulate(args) -> int:
    if any(a in ("-h", "--help") for a in args):
        print(_help("simulate", SIMULATE))
        return 0
    o, err = _options(args, SIMULATE, "simulate")
    if err:
        print(err, file=sys.stderr)
        return 2
    bad = output_problem(o["log"], "run log") if o["log"] else ""
    if bad:
        print(f"hpcnn simulate: --log={bad}", file=sys.stderr)
        return 2
    if o["model"]:
        return simulate_planned(o, "hpcnn simulate " + " ".join(args))
    from hpcnn.schedule import pipeline
    if o["schedule"] not in pipeline.SCHEDULES:
        print(f"hpcnn simulate: --schedule={o['schedule']!r}: one of "
              f"{', '.join(pipeline.SCHEDULES)}", file=sys.stderr)
        return 2
    p, m, v = o["ranks"], o["microbatches"], o["virtual"]
    try:
        if min(p, m, v, o["width"]) < 1 or min(o["t_f"], o["t_b"], o["t_w"], o["t_comm"]) < 0:
            raise ValueError(f"ranks, microbatches, virtual, width must be >= 1 and times >= 0, "
                             f"got {p}, {m}, {v}, {o['width']}, {o['t_f']}, {o['t_b']}, "
                             f"{o['t_w']}, {o['t_comm']}")
        lists = pipeline.SCHEDULES[o["schedule"]](p * v, m, p)
        sim = pipeline.simulate(lists, o["t_f"], o["t_b"] - o["t_w"], o["t_w"], o["t_comm"])
    except ValueError as e:
        print(f"hpcnn simulate: {e}", file=sys.stderr)
        return 2
    s = p * v
    ideal = m * s / p * (o["t_f"] + o["t_b"])          # every rank busy all the time
    print(f"{o['schedule']}: {p} ranks, {s} stages, {m} micro-batches; per stage and "
          f"micro-batch F {o['t_f']:g}, B {o['t_b']:g} (W {o['t_w']:g}), message {o['t_comm']:g}")
    print(f"makespan {sim.makespan:g} (all busy: {ideal:g}); bubble {sim.bubble:.3f}, "
          f"(S-1)/(M+S-1) = {(p - 1) / (m + p - 1):.3f}")
    formula = pipeline.formula_makespan(o["schedule"], p, m, o["t_f"], o["t_b"] - o["t_w"],
                                         o["t_w"], v)
    if formula is not None and o["t_comm"] == 0:
        print(f"published formula: makespan {formula:g}, bubble {1 - ideal / formula:.3f}")
    print("micro-batches in flight per rank (peak): "
          + " ".join(str(k) for k in sim.peak_inflight))
    if sim.peak_held != sim.peak_inflight:
        print("micro-batches held until their W per rank (peak): "
              + " ".join(str(k) for k in sim.peak_held))
    print("\n".join(chart(sim, p, o["width"])))
    if o["log"]:
        predicted_log(o["log"], sim, o, "hpcnn simulate " + " ".join(args))
        print(f"wrote {o['log']} (the predicted timeline; hpcnn report {o['log']} --trace OUT.json)")
    return 0


def predicted_log(path, sim, options: dict, command_line: str) -> None:
    """A run log holding a simulated schedule: its options as the config, the predicted makespan
    and bubble as step 0's metrics, and every compute instruction of ``sim.timelines`` as a
    ``/timeline`` event in the format a measured run writes (times in the units given), so the
    tools that read measured logs (``hpcnn report``, ``--trace``, analysis/pipeline_gantt.py)
    read it too; the root attribute ``predicted`` says it was not measured."""
    write_predicted(path, [(r, ins.kind, ins.mb, t0, t1) for r, line in enumerate(sim.timelines)
                           for ins, t0, t1 in line], sim.makespan, options, command_line,
                    len(sim.timelines), {"pp": len(sim.timelines), "schedule": options["schedule"],
                                         "microbatches": options["microbatches"],
                                         "virtual": options["virtual"]},
                    {"bubble": sim.bubble})

def simulate_planned(o: dict, command_line: str) -> int:
    """``hpcnn simulate --model=gpt|mlp``: a planned step's predicted timeline on ``--machine``
    (:mod:`hpcnn.plan.timeline`): a GPT layout priced by :func:`hpcnn.plan.hybrid.price`, or an
    MLP cut plan priced by :func:`hpcnn.plan.cost.strategy_cost`; printed, and with ``--log``
    written as a predicted run log."""
    from hpcnn.plan import cost, hybrid, timeline
    try:
        mach = load_machine(o["machine"])
        if o["model"] == "gpt":
            model = hybrid.Transformer(o["n_layers"], o["dim"], o["n_heads"], o["seq"],
                                       o["vocab"], o["batch"], o["dtype"])
            lay = hybrid.Layout(o["dp"], o["tp"], o["pp"], o["microbatches"], o["schedule"],
                                o["remat"], virtual=o["virtual"])
            bad = [k for k, ok in (("schedule", lay.schedule in hybrid.SCHEDULES),
                                   ("remat", lay.remat in hybrid.REMAT),
                                   ("dp x tp x pp x microbatches", min(
                                       lay.dp, lay.tp, lay.pp, lay.microbatches) >= 1 and
                                    model.batch % (lay.dp * lay.microbatches) == 0 and
                                    model.n_layers % lay.pp == 0)) if not ok]
            if bad:
                raise ValueError(f"{lay}: bad {', '.join(bad)} (schedule one of "
                                 f"{', '.join(hybrid.SCHEDULES)}, remat one of "
                                 f"{', '.join(hybrid.REMAT)}, dp x microbatches dividing the "
                                 f"batch {model.batch}, pp dividing the {model.n_layers} layers)")
            mach = mach.with_devices(lay.dp * lay.tp * lay.pp)
            priced = hybrid.price(model, lay, mach)
            events, step, what = timeline.gpt_events(model, lay, mach), priced.step_s, priced.formula
            plan = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "schedule": lay.schedule,
                    "virtual": lay.virtual, "microbatches": lay.microbatches,
                    "remat": lay.remat}
        elif o["model"] == "mlp":
            widths = [int(w) for w in o["widths"].split(",")]
            cuts, devices = load_cut_plan(o["plan"])
            mach = mach.with_devices(devices)
            graph = cost.mlp_graph(widths, o["batch"])
            events = timeline.mlp_events(graph, cuts, mach, o["dtype"])
            priced = cost.strategy_cost(graph, cuts, mach, o["dtype"])
            step, what = priced.seconds, priced.formula()
            plan = {"operator_layout": {"cuts": [[c.batch, c.reduce, c.out] for c in cuts],
                                        "chosen_by": f"plan file {o['plan']}",
                                        "predicted_step_s": step}}
        else:
            raise ValueError(f"--model={o['model']!r}: gpt or mlp")
    except (ValueError, OSError, KeyError) as e:
        print(f"hpcnn simulate: {e}", file=sys.stderr)
        return 2
    ranks = 1 + max(e[0] for e in events)
    print(f"{o['model']} on {ranks} ranks of {mach.name}: predicted step {step:.4g} s = {what}")
    if o["log"]:
        write_predicted(o["log"], events, step, o, command_line, ranks, plan)
        print(f"wrote {o['log']} (hpcnn report MEASURED.h5 --predicted={o['log']} --gantt=OUT.png)")
    return 0


def write_predicted(path, events, step_s: float, options: dict, command_line: str,
                    world_size: int, plan: dict, metrics: dict | None = None) -> None:
    """A run log holding predicted ``events`` (``/timeline``, as a measured run writes them), the
    options as its config, ``plan`` as its ``/plan`` and the predicted step time (and
    ``metrics``) as step 0's metrics; the root attribute ``predicted`` says it was not measured."""
    from hpcnn.log import RunLog
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    log = RunLog(path, options, command_line=command_line, world_size=world_size,
                 extra_attrs={"predicted": True}, overwrite=True)
    log.set_plan(plan)
    log.log_events(events)
    log.log_metrics(0, step_time=step_s, **(metrics or {}))
    log.close(status="finished")


PLAN = {"model": ("gpt", str, "gpt (the transformer layout search)"),
        "n_layers": (24, int, "transformer blocks"), "dim": (2048, int, "width"),
        "n_heads": (16, int, "attention heads"), "seq": (1024, int, "context length"),
        "vocab": (50304, int, "vocabulary"), "batch": (512, int, "global batch (sequences)"),
        "dtype": ("bfloat16", str, "bfloat16 | float16 (mixed precision: 16-bit parameters, "
                                   "float32 gradients, master copy and optimizer state) | "
                                   "float32 | float64"),
        "dropout": (0.0, float, "the blocks' dropout probability, as hpcnn train's --dropout "
                                "(its masks held and moved)"),
        "grad_reduce_dtype": ("fp32", str, "the data-parallel gradient reduction's type, as "
                                           "hpcnn train's: fp32, or param (the 16-bit "
                                           "parameters' type, half the bytes; ZeRO 0 and 1)"),
        "machine": ("", str, "machine file (machines/*.toml); '' = this machine's, as hpcnn "
                             "train: $HPCNN_MACHINE, else machines/local.toml, else "
                             "machines/local-2vcpu.toml"),
        "devices": (0, int, "devices to plan for (0: all of the machine's)"),
        "memory_gb": (0.0, float, "memory per device in GB (0: the machine file's)"),
        "top": (10, int, "layouts to print"),
        "zero": ("0", str, "ZeRO stages to consider, e.g. 0,1,2,3 (1: optimizer state over "
                           "dp, 2: gradients too, 3: parameters too)"),
        "tp": ("", str, "tensor-parallel sizes allowed: 8 (fixed), 2-8 (bounds) or 2,4,8; "
                        "'' free"),
        "pp": ("", str, "pipeline stages allowed, as --tp"),
        "dp": ("", str, "data-parallel replicas allowed, as --tp"),
        "microbatches": ("", str, "micro-batches per step allowed, as --tp"),
        "micro_batch_size": ("", str, "sequences per micro-batch allowed, as --tp"),
        "schedule": ("", str, "pipeline schedules allowed, e.g. 1f1b,zb_h1 (of 1f1b, gpipe, "
                              "zb_h1, interleaved); '' all"),
        "virtual": ("", str, "model chunks per pipeline rank allowed (interleaved), as --tp"),
        "remat": ("", str, "rematerialization allowed: none, full or none,full; '' both"),
        "sequence_parallel": ("both", str, "sequence parallelism (tp > 1): true, false or "
                                           "both"),
        "explain": ("", str, "price one layout term by term, e.g. 'dp=8,tp=8,pp=16,"
                             "microbatches=64,schedule=interleaved,virtual=2,remat=none,"
                             "sequence_parallel=true,zero=1' (remat=selective: priced, "
                             "hpcnn train does not run it)"),
        "json": (False, bool, "print JSON for scripts: each layout's dimensions as fields, its "
                              "step, memory by kind and throughput")}


NOTHING_FITS = 3       # hpcnn plan's exit code when no layout fits the devices' memory


def cmd_plan(args) -> int:
    """Rank every layout of a GPT on a machine by predicted step time (:mod:`hpcnn.plan.hybrid`):
    no profiling, no MPI; prints the winner's formula and what separates it from the next, or
    exits with :data:`NOTHING_FITS` when no layout fits the devices' memory. A
    layout the planner cut into stages shows its transformer blocks per stage (``stages 3|5``;
    ``stages`` in the JSON rows, [] for the uniform cut). ``--tp`` ... ``--remat`` fix or bound
    dimensions; ``--explain`` prices one layout term by term instead (:func:`_explain`)."""
    if any(a in ("-h", "--help") for a in args):
        print(_help("plan", PLAN))
        return 0
    o, err = _options(args, PLAN, "plan")
    if err is None and o["model"] != "gpt":
        err = f"hpcnn plan: --model={o['model']!r}: only gpt is planned here"
    if err is None and o["top"] < 1:
        err = f"hpcnn plan: --top={o['top']}: the layouts to print must be >= 1"
    zero = sorted({z.strip() for z in o["zero"].split(",")}) if err is None else []
    if err is None and (not zero or set(zero) - {"0", "1", "2", "3"}):
        err = f"hpcnn plan: --zero={o['zero']}: ZeRO stages are 0, 1, 2 and 3, e.g. --zero=0,1,2,3"
    allow, err = (_allow(o) if err is None else (None, err))
    if err:
        print(err, file=sys.stderr)
        return 2
    import time

    from hpcnn.plan import hybrid
    t0 = time.perf_counter()
    try:
        mach = load_machine(o["machine"])
        model = hybrid.Transformer(o["n_layers"], o["dim"], o["n_heads"], o["seq"], o["vocab"],
                                   o["batch"], o["dtype"], o["dropout"],
                                   o["grad_reduce_dtype"])
        if o["explain"]:
            return _explain(model, mach, o)
        ranked = hybrid.plan(model, mach, o["devices"] or mach.p,
                             memory_bytes=o["memory_gb"] * 1e9 or None,
                             zero=tuple(int(z) for z in zero), allow=allow)
    except (ValueError, OSError) as e:
        print(f"hpcnn plan: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    devices = o["devices"] or mach.p
    rows = [_plan_row(model, q, devices) for q in ranked[:o["top"]]]
    fits = bool(ranked) and ranked[0].feasible      # ranked: the layouts that fit first
    if o["json"]:
        import json
        print(json.dumps({"machine": mach.name, "devices": devices, "params": model.params(),
                          "layouts": len(ranked), "search_s": seconds, "feasible": fits,
                          "ranked": rows}))
        return 0 if fits else NOTHING_FITS
    return _print_plan(model, mach, devices, ranked, rows, seconds)


def _allow(o: dict):
    """(``allow`` for :func:`hpcnn.plan.hybrid.plan` from ``--tp`` ... ``--remat``, None) or
    (None, the error line): a number, ``A-B`` (bounds) or a comma list; names for the
    schedule and remat."""
    from hpcnn.plan.hybrid import REMAT, SCHEDULES
    allow = {}
    sp = o["sequence_parallel"].strip().lower()
    if sp not in ("true", "false", "both"):
        return None, (f"hpcnn plan: --sequence_parallel={o['sequence_parallel']}: expected "
                      f"true, false or both")
    if sp != "both":
        allow["sequence_parallel"] = {sp == "true"}
    for key in ("tp", "pp", "dp", "microbatches", "micro_batch_size", "virtual", "schedule",
                "remat"):
        raw = o[key].strip()
        if not raw:
            continue
        if key in ("schedule", "remat"):
            names, known = {x.strip() for x in raw.split(",")}, SCHEDULES if key == "schedule" \
                else REMAT
            if names - set(known):
                return None, (f"hpcnn plan: --{key}={raw}: expected some of {', '.join(known)}, "
                              f"comma-separated")
            allow[key] = names
            continue
        try:
            if "-" in raw:
                lo, hi = (int(x) for x in raw.split("-"))
                allow[key] = range(lo, hi + 1)
            else:
                allow[key] = {int(x) for x in raw.split(",")}
        except ValueError:
            return None, (f"hpcnn plan: --{key}={raw}: expected a number, bounds A-B or a comma "
                          f"list, e.g. --{key}=8, --{key}=2-8, --{key}=2,4,8")
        if not allow[key] or min(allow[key]) < 1:
            return None, f"hpcnn plan: --{key}={raw}: sizes are numbers >= 1"
    return allow, None


def _plan_row(model, q, devices: int) -> dict:
    """One ranked layout as the JSON gives it: every dimension a field, the predicted step, the
    memory per device by kind, throughput per device as model FLOP/s (without recomputation,
    Narayanan et al.'s convention) and as hardware FLOP/s (with it), the step's parts."""
    from hpcnn.plan import hybrid
    lay = q.layout
    return {"layout": str(lay), "dp": lay.dp, "tp": lay.tp, "pp": lay.pp,
            "microbatches": lay.microbatches,
            "micro_batch_size": model.batch // (lay.dp * lay.microbatches),
            "schedule": lay.schedule if lay.pp > 1 else "none", "virtual": lay.virtual,
            "remat": lay.remat, "sequence_parallel": lay.sequence_parallel, "zero": lay.zero,
            "stages": list(lay.stages), "step_s": q.step_s,
            "memory_gb": q.memory_bytes / 1e9,
            "memory_by_kind_gb": {k: v / 1e9 for k, v in q.memory_parts.items()},
            "tflops_per_device": hybrid.flops_per_step(model) / q.step_s / devices / 1e12,
            "hardware_tflops_per_device":
                hybrid.hardware_flops_per_step(model, lay) / q.step_s / devices / 1e12,
            "feasible": q.feasible, "parts": q.parts}


def _explain(model, mach, o: dict) -> int:
    """``hpcnn plan --explain=LAYOUT``: the layout's step term by term (seconds and share),
    its memory per device by kind, and its throughput; exit 2 on a layout that cannot be read
    or does not fill the devices."""
    from hpcnn.plan import hybrid
    fields = {"dp": 1, "tp": 1, "pp": 1, "microbatches": 1, "schedule": "1f1b",
              "remat": "none", "zero": 0, "stages": (), "virtual": 1, "sequence_parallel": False}
    for item in (x.strip() for x in o["explain"].split(",") if x.strip()):
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise ValueError(f"--explain: {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(fields)} (stages as 6|6|4)")
        fields[key] = (value if key in ("schedule", "remat") else
                       tuple(int(v) for v in value.split("|")) if key == "stages" else
                       _truth(key, value) if key == "sequence_parallel" else int(value))
    lay = hybrid.Layout(**fields)
    devices = o["devices"] or lay.dp * lay.tp * lay.pp
    if lay.dp * lay.tp * lay.pp != devices or devices > mach.p:
        raise ValueError(f"--explain: dp x tp x pp = {lay.dp * lay.tp * lay.pp}, not the "
                         f"{devices} devices (of {mach.p} on {mach.name})")
    q = hybrid.price(model, lay, mach.with_devices(devices), o["memory_gb"] * 1e9 or None)
    row = _plan_row(model, q, devices)
    print(f"{lay} on {devices} devices of {mach.name}: {q.step_s:.4g} s a step, "
          f"{row['tflops_per_device']:.1f} model TFLOP/s a device "
          f"({row['hardware_tflops_per_device']:.1f} hardware, recomputation counted)")
    for part, sec in sorted(q.parts.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<12} {sec:10.4g} s  {sec / q.step_s:6.1%}  {EXPLAIN[part]}")
    print(f"memory a device: {q.memory_bytes / 1e9:.2f} GB"
          f"{'' if q.feasible else ' (does not fit)'}: " + ", ".join(
              f"{k} {v / 1e9:.2f}" for k, v in q.memory_parts.items()))
    print(f"as a sum: {q.formula}")
    return 0


def _truth(key: str, value: str) -> bool:
    """``true``/``false`` of ``--explain``'s ``key=value``; ValueError otherwise."""
    if value.lower() not in ("true", "false"):
        raise ValueError(f"--explain: {key}={value}: expected true or false")
    return value.lower() == "true"


EXPLAIN = {"compute": "the stage passes' GEMMs and other FLOPs (blocks and head)",
           "memory_bound": "their memory-bound operations (LayerNorm, softmax, GELU, dropout, "
                           "residuals, the loss, the gradients' accumulation)",
           "tp_comm": "tensor parallelism's allreduces, two per block each way",
           "bubble": "the pipeline's fill and drain (the schedule's span beyond its passes)",
           "pp_comm": "activation messages between stages on the critical path",
           "dp_comm": "the data-parallel gradient reduction",
           "optimizer": "the optimizer's update (and ZeRO's gathers)",
           "held": "fresh memory for the activations held beyond one micro-batch's"}


def _print_plan(model, mach, devices: int, ranked: list, rows: list, seconds: float) -> int:
    """``hpcnn plan``'s text: the ranked ``rows``, the winner's formula and what separates it
    from the next; :data:`NOTHING_FITS` with one line when no layout fits, else 0."""
    print(f"{model.params() / 1e9:.2f} B parameters on {devices} devices of {mach.name}: "
          f"{len(ranked)} layouts priced in {seconds:.3f} s")
    width = max(60, *(len(r["layout"]) for r in rows))
    for k, r in enumerate(rows, 1):
        print(f"{k:>3}. {r['layout']:<{width}} {r['step_s']:10.4g} s  {r['memory_gb']:7.2f} GB/dev  "
              f"{r['tflops_per_device']:7.2f} TFLOP/s/dev{'' if r['feasible'] else '  (does not fit)'}")
    best = ranked[0]
    if not best.feasible:
        print(f"hpcnn plan: no layout fits in memory (the least, {best.layout}, needs "
              f"{best.memory_bytes / 1e9:.3g} GB a device); more devices, --memory_gb or a "
              f"smaller model", file=sys.stderr)
        return NOTHING_FITS
    print(f"winner: {best.formula}")
    if len(ranked) > 1:
        nxt = ranked[1]
        diff = max(best.parts, key=lambda k: abs(nxt.parts[k] - best.parts[k]))
        print(f"against #2 ({nxt.layout}): {nxt.step_s - best.step_s:+.4g} s, most in {diff} "
              f"({best.parts[diff]:.4g} s vs {nxt.parts[diff]:.4g} s)")
    return 0


CALIBRATE = {"dtype": ("float32", str, "float32 | float64: the dtype of the runs to serve"),
             "write": ("", str, "machines/NAME.toml: measure these ranks and write a machine "
                                "file instead (one rank: the device alone)"),
             "rounds": (15, int, "with --write: timing rounds per block figure (efficiency, "
                                 "element-wise cost), the medians taken; cold messages and "
                                 "sustained windows in proportion (fewer and shorter windows "
                                 "below 15, more above)")}


def calibrate_machine(path: str, rounds: int = CALIBRATE["rounds"][0]) -> int:
    """``hpcnn calibrate --write=PATH``: ping-pong per size, matmul and copy rates (alone and all
    ranks at once) measured on these ranks (any number, one included), written by rank 0 as the
    machine file PATH, named after the file."""
    from hpcnn.parallel.collectives import world
    from hpcnn.plan import calibrate, machine
    comm = world().comm
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):                  # every rank sees it, before any collective
        print(f"hpcnn calibrate: --write={path!r}: no such directory {folder!r}", file=sys.stderr)
        return 2
    name = os.path.splitext(os.path.basename(path))[0]
    text = calibrate.machine_text(calibrate.measure(comm, rounds), name, comm.Get_size())
    failed = ""
    if comm.Get_rank() == 0:
        try:
            machine.loads(text, where=path)         # what is written must read back
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except (OSError, ValueError) as e:
            failed = str(e)
        print(f"hpcnn calibrate: {failed}" if failed else text + f"wrote {path}",
              file=sys.stderr if failed else sys.stdout)
    return 1 if comm.bcast(failed, root=0) else 0


def _calibrate_misplaced(args, opts) -> str:
    """The option given that the chosen mode does not read ('' when none)."""
    given = {a.split("=", 1)[0] for a in args}
    if "--rounds" in given and not opts["write"]:
        return "--rounds is read only with --write=FILE (the machine file's timing rounds)"
    if "--dtype" in given and opts["write"]:
        return "--dtype is for the allreduce table; --write times float32 and float64 itself"
    return ""


def cmd_calibrate(args) -> int:
    """Time every allreduce algorithm from 1 KiB to 64 MiB on these ranks, print the table and
    save it where ``--allreduce=auto`` runs of the same key load it
    (:mod:`hpcnn.parallel.collectives.autotune`)."""
    if any(a in ("-h", "--help") for a in args):
        print("usage: mpiexec -n N python -m mpi4py -m hpcnn calibrate [--dtype=float32]\n"
              "       [mpiexec -n N python -m mpi4py -m] hpcnn calibrate --write=machines/NAME.toml"
              "\n\n"
              "Times every allreduce algorithm at 1 KiB .. 64 MiB on these ranks, prints what "
              "--allreduce=auto would choose and saves it for the runs on the same ranks "
              "(delete the file it names to measure again).\n"
              "With --write: times ping-pong per size (all rank pairs at once), matmul and copy "
              "rates (rank 0 alone, then all ranks at once) and writes the machine file the "
              "planner reads (hpcnn/plan/calibrate/).\n\n"
              + _help("calibrate", CALIBRATE))
        return 0
    args = list(args)
    if "--write" in args[:-1]:                   # also as two words: --write machines/NAME.toml
        i = args.index("--write")
        args[i:i + 2] = [f"--write={args[i + 1]}"]
    opts, err = _options(args, CALIBRATE, "calibrate")
    if err or opts["dtype"] not in ("float32", "float64") or opts["rounds"] < 1:
        print(err or f"hpcnn calibrate: --dtype={opts['dtype']!r}, --rounds={opts['rounds']}: "
              f"expected float32 or float64, and rounds >= 1", file=sys.stderr)
        return 2
    misplaced = _calibrate_misplaced(args, opts)
    if misplaced:
        print(f"hpcnn calibrate: {misplaced}", file=sys.stderr)
        return 2
    if opts["write"]:
        return calibrate_machine(opts["write"], opts["rounds"])
    from hpcnn.parallel.collectives import algorithms, world
    from hpcnn.parallel.collectives import autotune
    comm = world()
    if comm.size == 1:
        print("hpcnn calibrate: one rank: nothing to reduce (run it under mpiexec -n N)",
              file=sys.stderr)
        return 2
    key = autotune.key(comm, opts["dtype"])
    table = algorithms.calibrate(comm, dtype=opts["dtype"])
    status = 0
    if comm.rank == 0:
        algos = list(table["times"])
        nodes = "one node" if algorithms.single_node(comm) else "several nodes"
        print(f"{comm.size} ranks, {nodes}, "
              f"{opts['dtype']}; median of the slowest rank, microseconds")
        print(f"{'bytes':>10} " + " ".join(f"{a:>9}" for a in algos) + "  auto")
        for i, (n, choice) in enumerate(zip(table["sizes"], table["choice"])):
            print(f"{n:>10} " + " ".join(f"{table['times'][a][i] * 1e6:9.1f}" for a in algos)
                  + f"  {choice}")
        path = autotune.path_for(key)
        failed = autotune.save(path, key, table, replace=True) if path else ""
        print(f"hpcnn calibrate: {failed}" if failed else f"saved to {path}" if path else
              f"not saved ({autotune.ENV}=off)", file=sys.stderr if failed else sys.stdout)
        status = 1 if failed else 0
    algorithms.free(comm)
    return status
