"""Where does data parallelism stop winning over operator parallelism? Predicted against measured.

H. Wang's thesis claims the BSP cost model places the crossover between data-parallel and
operator-parallel layouts where it is measured. Here, on ``--ranks`` (2) ranks of this machine,
for a 3-Linear MLP on digits (64 -> w -> w -> 10) over a grid of global batch sizes
(``--batches``) and widths w (``--widths``), two layouts per grid point:

- **dp**: every Linear data parallel, Cut(p, 1, 1) (the weights whole on every rank, one gradient
  allreduce per Linear);
- **op**: the operator-parallel layout of least BSP price among those that cut no batch (each
  Linear row Cut(1, p, 1), column Cut(1, 1, p) or replicated: Megatron's column-row pairs are
  among them), chosen by :func:`hpcnn.plan.cost.strategy_cost` on the machine file.

Each is **predicted** by :func:`hpcnn.plan.cost.strategy_cost` on the machine file
(``--machine``, default ``local-2vcpu`` via :func:`hpcnn.plan.machine.resolve`) and **measured**
by ``hpcnn train --model=mlp --tp=p --plan=FILE`` (the runs, logs, rounds in alternating order
and medians of experiments/plan_validation.py, whose functions this script imports).

Per grid point: predicted and measured winner, the ratio dp / op of each; per width, the
crossover boundary: the least batch from which dp wins at every larger batch of the grid
(predicted and measured; -1 where dp wins nowhere at the grid's largest batch); the fraction of
grid points where the predicted winner is the measured one.

    python experiments/plan_crossover.py [--machine=local-2vcpu] [--out=runs/plan_crossover]
        [--batches=16,64,256,512,1024] [--widths=64,256,512,1024,2048] [--rounds=3] [--steps=15]
    python analysis/plan_crossover.py runs/plan_crossover/results.h5 docs/figures/plan_crossover.png

Output: OUT/results.h5, tables ``points`` (one row per grid point), ``boundary`` (one per width)
and ``summary`` (one row); the plan files and run logs under OUT/runs.
"""
import itertools
import math
import os
import statistics
import sys
import time

from hpcnn import scripts
from hpcnn import validation_runs as validation
from hpcnn.log.results import save_table
from hpcnn.plan import cost, machine
from hpcnn.plan import validation as pv

LINEARS = 3                         # 64 -> w -> w -> 10


def op_layout(width: int, batch: int, ranks: int, mach) -> tuple:
    """The choice names (one per Linear) of least BSP price among those cutting no batch."""
    graph = pv.mlp_graph([width] * (LINEARS - 1), batch)
    best = None
    for names in itertools.product(("col", "row", "rep"), repeat=LINEARS):
        seconds = cost.strategy_cost(graph, [pv.CHOICES[c](ranks) for c in names],
                                     mach, "float32").seconds
        if best is None or seconds < best[1]:
            best = (names, seconds)
    return best[0]


def boundary(batches, dp_wins) -> int:
    """The least batch from which dp wins at every larger batch of the grid; -1 if none."""
    edge = -1
    for b, win in sorted(zip(batches, dp_wins), reverse=True):
        if not win:
            break
        edge = b
    return edge


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--machine", default="local-2vcpu", help="machine file or name")
    ap.add_argument("--out", default="runs/plan_crossover")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batches", default="16,64,256,512,1024")
    ap.add_argument("--widths", default="64,256,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args(argv)
    batches = sorted(int(v) for v in a.batches.split(","))
    widths = sorted(int(v) for v in a.widths.split(","))
    bad = [v for v in batches + widths if v < a.ranks or v % a.ranks]
    if bad or a.rounds < 1 or a.steps < 2:
        scripts.refuse(f"batches {batches} and widths {widths} must be multiples of --ranks "
                         f"({a.ranks}) (bad: {bad}); rounds ({a.rounds}) >= 1, steps ({a.steps}) >= 2")
    folder = os.path.join(os.path.abspath(a.out), "runs")
    os.makedirs(folder, exist_ok=True)
    t0 = time.time()
    load_before = os.getloadavg()[0]
    path = machine.resolve(a.machine)
    mach = machine.load(path)
    if mach.p != a.ranks:
        mach = mach.with_devices(a.ranks)
    print(f"machine {mach.name} ({path}); {len(batches)} batches x {len(widths)} widths, "
          f"2 layouts each, {a.rounds} rounds", flush=True)

    cases, grid = [], []                       # cases in run order; grid: (batch, width, dp, op)
    for w in widths:
        for b in batches:
            tag = f"b{b}-w{w}-"
            dp = pv.mlp_case([w] * (LINEARS - 1), b, a.ranks, ("dp",) * LINEARS, folder, tag)
            op = pv.mlp_case([w] * (LINEARS - 1), b, a.ranks, op_layout(w, b, a.ranks, mach),
                             folder, tag)
            dp, op = (tag + dp[0],) + dp[1:], (tag + op[0],) + op[1:]
            cases += [dp, op]
            grid.append((b, w, dp, op))
    runs = {name: [] for name, _, _ in cases}
    for r in range(a.rounds):
        order = cases if r % 2 == 0 else cases[::-1]
        for name, got in validation.measure(order, a.ranks, a.steps, folder, f"r{r}").items():
            runs[name].append(got)
        print(f"round {r + 1}/{a.rounds} done ({time.time() - t0:.0f} s)", flush=True)

    rows = []
    for b, w, dp, op in grid:
        pred = {k: c[2](mach).seconds for k, c in (("dp", dp), ("op", op))}
        meas = {k: statistics.median(g["step_s"] for g in runs[c[0]])
                for k, c in (("dp", dp), ("op", op))}
        pred_winner = min(pred, key=pred.get)
        meas_winner = min(meas, key=meas.get)
        rows.append({"batch": b, "width": w, "op_layout": op[0].split("-", 2)[2],
                     "pred_dp_s": pred["dp"], "pred_op_s": pred["op"],
                     "meas_dp_s": meas["dp"], "meas_op_s": meas["op"],
                     "pred_ratio": pred["dp"] / pred["op"], "meas_ratio": meas["dp"] / meas["op"],
                     "pred_winner": pred_winner, "meas_winner": meas_winner,
                     "agree": int(pred_winner == meas_winner), "rounds": a.rounds,
                     "steps": a.steps,
                     "load1": statistics.mean(g["load1"] for c in (dp, op) for g in runs[c[0]])})
        print(f"batch {b:5d} width {w:5d}: dp/op predicted {rows[-1]['pred_ratio']:.3g} "
              f"({pred_winner}), measured {rows[-1]['meas_ratio']:.3g} ({meas_winner}); "
              f"op = {rows[-1]['op_layout']}", flush=True)
    edges = []
    for w in widths:
        mine = [r for r in rows if r["width"] == w]
        edges.append({"width": w,
                      "pred_boundary_batch": boundary(batches, [r["pred_winner"] == "dp"
                                                                for r in mine]),
                      "meas_boundary_batch": boundary(batches, [r["meas_winner"] == "dp"
                                                                for r in mine])})
    log_err = [abs(math.log(r["pred_ratio"] / r["meas_ratio"])) for r in rows]
    load_after = os.getloadavg()[0]
    summary = [{"points": len(rows), "agree": sum(r["agree"] for r in rows),
                "agreement": sum(r["agree"] for r in rows) / len(rows),
                "boundaries_equal": sum(e["pred_boundary_batch"] == e["meas_boundary_batch"]
                                        for e in edges),
                "median_abs_log_ratio_error": statistics.median(log_err),
                "rounds": a.rounds, "steps": a.steps, "load_before": load_before,
                "load_after": load_after, "wall_s": time.time() - t0}]
    attrs = {"machine": mach.name, "machine_file": path, "ranks": a.ranks,
             "command_line": scripts.command_line()}
    out = os.path.join(a.out, "results.h5")
    save_table(out, "points", rows, attrs=attrs)
    save_table(out, "boundary", edges, attrs=attrs)
    save_table(out, "summary", summary, attrs=attrs)
    for e in edges:
        print(f"width {e['width']:5d}: dp wins from batch {e['pred_boundary_batch']} predicted, "
              f"{e['meas_boundary_batch']} measured (-1: not at the grid's largest)")
    s = summary[0]
    print(f"winner agrees on {s['agree']}/{s['points']} points ({s['agreement']:.0%}); "
          f"boundary equal on {s['boundaries_equal']}/{len(edges)} widths; load average "
          f"{load_before:.2f} before, {load_after:.2f} after; {s['wall_s']:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
