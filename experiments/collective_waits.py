"""Each collective of an MLP layout, timed call by call as training runs it, against its price.

    mpiexec -n 4 python -m mpi4py experiments/collective_waits.py \
        --plans=col-row-rep,col-col-row,row-col-row --machine=runs/plan_validation_p4_idle/machine-r0.toml

For each plan (Linear cuts named as experiments/plan_validation.py names them, one per Linear),
in ``--rounds`` rounds alternating the plans, the script trains the digits MLP of
``--hidden`` and ``--batch`` through hpcnn's step engine (``hpcnn train``'s set-up, float32,
``--steps`` steps) and times every call of every layout group's allreduce (a Linear's
``reduce`` group: the output's partial sums; ``out``: the input gradient's; ``batch``: the
weight gradients), each rank on its own clock. A call's seconds are those of the rank that
made it: on ranks that share cores they are mostly the wait for the other ranks to arrive,
which the bytes do not set. Per plan, Linear, group and rank it writes the median seconds of
a call over the steps after the first fifth and the rounds, the calls per step and their
bytes, and where ``--machine`` is given the price of that collective in
:func:`hpcnn.plan.cost.strategy_cost` (its term "opN reduce y", "opN reduce dx" or "opN grad
allreduce", the same bytes and group); table "calls" of ``--out``.
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcnn import scripts
from hpcnn.config import TrainConfig
from hpcnn.engine.step import train_step
from hpcnn.schedule.placement import write_plan
from hpcnn.plan import cost
from hpcnn.plan import validation as plan_validation
from hpcnn.train import setup

# a layout group's label -> the word of its term in cost.strategy_cost
TERMS = {"reduce": "reduce y", "out": "reduce dx", "batch": "grad allreduce"}


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--plans", default="col-row-rep,col-col-row,row-col-row")
    ap.add_argument("--hidden", default="1024,1024")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--machine", default="")
    ap.add_argument("--out", default="runs/collective_waits/results.h5")
    return ap


def parse(argv, ranks: int):
    """The options of ``argv``, the plans' cuts checked on ``ranks`` ranks; a refusal (alike on
    every rank, before any call) exits by :func:`hpcnn.scripts.refuse`."""
    ap = parser()
    a = ap.parse_args(argv)
    a.hidden = [int(v) for v in a.hidden.split(",")]
    options = plan_validation.cut_options(ranks)
    a.cuts = {}
    for name in a.plans.split(","):
        parts = name.split("-")
        bad = [p for p in parts if p not in options]
        if bad or len(parts) != len(a.hidden) + 1:
            ap.error(f"--plans: {name!r}: expected {len(a.hidden) + 1} cuts of "
                     f"{sorted(options)} joined by '-' on {ranks} ranks (unknown: {bad})")
        a.cuts[name] = [options[p] for p in parts]
    if a.steps < 5 or a.rounds < 1 or a.batch < ranks:
        ap.error(f"--steps={a.steps} (>= 5), --rounds={a.rounds} (>= 1), --batch={a.batch} "
                 f"(>= {ranks} ranks) expected")
    if a.machine and not os.path.isfile(a.machine):
        ap.error(f"--machine={a.machine!r}: no such file")
    return a


def timed_calls(comm, cuts, a) -> dict:
    """{(op, label): [(seconds, bytes), ...]} of this rank's layout-group allreduces, steps
    after the first fifth, one training run of ``cuts``."""
    path = os.path.join(os.path.dirname(os.path.abspath(a.out)), f".plan-{comm.rank}.json")
    write_plan(path, cuts, comm.size)
    cfg = TrainConfig(model="mlp", dataset="digits", hidden=tuple(a.hidden), batch_size=a.batch,
                      tp=comm.size, plan=path, dtype="float32", allreduce="mpi",
                      progress=False, eval_interval=0, steps=a.steps, log="").resolved()
    cfg, ctx, task, opt, _ = setup(cfg, comm, None)
    got, live = {}, [False]
    linears = [b for b in ctx.local.blocks if hasattr(b, "groups")]
    for op, block in enumerate(linears):
        for label in TERMS:
            group = getattr(block.groups, label)
            if group.size > 1:
                group.allreduce = _timer(group.allreduce, got.setdefault((op, label), []), live)
    try:
        t0 = time.perf_counter()
        for step in range(a.steps):
            live[0] = step >= a.steps // 5
            train_step(ctx, task, opt, step, t0)
    finally:
        ctx.free()
        os.unlink(path)
    return got


def _timer(call, out: list, live: list):
    def timed(buf, *args, **kw):
        t = time.perf_counter()
        r = call(buf, *args, **kw)
        if live[0]:
            out.append((time.perf_counter() - t, buf.nbytes))
        return r
    return timed


def priced(graph, cuts, machine) -> dict:
    """{(op, label): (seconds, bytes, devices)} of the plan's allreduce terms."""
    out = {}
    for term in cost.strategy_cost(graph, cuts, machine, "float32").terms:
        for label, word in TERMS.items():
            if term.what.endswith(" " + word):
                out[(int(term.what.split()[0][2:]), label)] = (term.seconds, term.nbytes,
                                                                 term.devices)
    return out


def main(argv=None) -> int:
    comm = MPI.COMM_WORLD
    a = parse(argv, comm.size)               # every rank refuses alike, before any call
    timed = {name: {} for name in a.cuts}
    for _ in range(a.rounds):
        for name, cuts in a.cuts.items():
            for key, calls in timed_calls(comm, cuts, a).items():
                timed[name].setdefault(key, []).extend(calls)
    everyone = comm.gather(timed, root=0)
    if comm.rank:
        return 0
    graph = plan_validation.mlp_graph(a.hidden, a.batch)
    machine = plan_validation.machine_for(a.machine, comm.size) if a.machine else None
    steady = (a.steps - a.steps // 5) * a.rounds
    rows = []
    for name, cuts in a.cuts.items():
        price = priced(graph, cuts, machine) if machine else {}
        for rank, mine in enumerate(everyone):
            for (op, label), calls in sorted(mine[name].items()):
                s, b, n = price.get((op, label), (np.nan, np.nan, np.nan))
                rows.append({"plan": name, "rank": rank, "op": op, "group": label,
                             "bytes": int(calls[0][1]), "calls_per_step": len(calls) / steady,
                             "median_s": float(np.median([t for t, _ in calls])),
                             "priced_s": float(s), "priced_bytes": float(b),
                             "priced_devices": float(n)})
    by_call = {}                                 # (plan, op, group) -> its rows, rank order
    for r in rows:
        by_call.setdefault((r["plan"], r["op"], r["group"]), []).append(r)
    for (name, op, label), mine in by_call.items():
        print(f"{name:24s} op{op} {TERMS[label]:15s} {mine[0]['bytes']:9d} B "
              f"{mine[0]['calls_per_step']:.0f}/step: "
              + " ".join(f"{r['median_s'] * 1e3:.2f}" for r in mine)
              + f" ms per rank, priced {mine[0]['priced_s'] * 1e3:.2f}")
    scripts.write_tables(a.out, {"calls": rows}, {"ranks": comm.size, "steps": a.steps,
                                                  "rounds": a.rounds, "machine_file": a.machine,
                                                  "command_line": scripts.command_line()})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
