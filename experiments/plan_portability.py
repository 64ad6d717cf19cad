"""Re-planning after a model change: the cost model's milliseconds against a profiling planner.

H. Wang's thesis claims that a planner priced by a cost model is portable: when the batch, a
width or the depth changes, it plans again in milliseconds with no profiling, where a planner
driven by profiles must time the operators again. For a sequence of changes (``CHANGES``: batch,
width and depth of an MLP on digits, over ``--ranks`` = 2 ranks, and of a GPT), this measures

1. **re-planning with the cost model** in this process: for the MLP
   :func:`hpcnn.plan.search.least_price` (what ``--plan=auto`` runs on 2 ranks) and
   :func:`hpcnn.plan.search.dra` on the machine file (``--machine``, default ``local-2vcpu``); for
   the GPT :func:`hpcnn.plan.hybrid.plan` (every dp x tp x pp layout), the median of
   ``--replans`` calls;
2. **a profiling baseline** (MLP only), on the ranks under ``mpiexec`` (this script in
   ``--worker`` mode): for every Linear and every candidate cut (the ones ``least_price``
   combines), it runs the local matmuls that cut leaves a rank (forward, input gradient, weight
   gradient, on random float32 data) and the collectives it needs (the gradient or partial-sum
   allreduces of the BSP terms, with their byte counts, on the real ranks); for every pair of
   neighbours' cuts, the exchanges the BSP price counts (the consumer's input forward where it
   crosses devices, the producer's output gradient backward where that does, the batch size),
   and the last Linear's gather of the logits for the loss. One
   warm-up and ``--reps`` timed runs each, the median, the slowest rank's figure; identical
   shapes are timed once (a profiler caches them). It then picks the combination of least
   profiled time. Its time is the profiling and picking on the ranks, without ``mpiexec``'s
   start-up (in its favour).

Reported per change: both times, their ratio, the two chosen plans and whether they are equal,
and each choice's profiled step time (how much the cost model's choice loses by the profiles).
GPT rows have the re-planning time only (no profiling baseline here: -1).

    python experiments/plan_portability.py [--machine=local-2vcpu] [--out=runs/plan_portability]
        [--reps=3] [--replans=5] [--changes=all]
    python analysis/plan_portability.py runs/plan_portability/results.h5 docs/figures/plan_portability.png

Output: OUT/results.h5, table ``changes`` (one row per model change).
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from hpcnn import scripts
from hpcnn import validation_runs as validation
from hpcnn.log.results import save_table
from hpcnn.plan import cost, hybrid, machine, search
from hpcnn.plan import validation as pv

# (name, kind, shape): MLP shape = (hidden widths, batch); GPT = (layers, dim, heads, context, batch)
CHANGES = [
    ("mlp 64-1024-1024-10, batch 256", "mlp", ((1024, 1024), 256)),
    ("batch 256 -> 1024", "mlp", ((1024, 1024), 1024)),
    ("width 1024 -> 2048", "mlp", ((2048, 2048), 1024)),
    ("depth 3 -> 5 Linears", "mlp", ((2048,) * 4, 1024)),
    ("batch 1024 -> 64", "mlp", ((2048,) * 4, 64)),
    ("width 2048 -> 256", "mlp", ((256,) * 4, 64)),
    ("gpt 4x128, batch 32", "gpt", (4, 128, 4, 64, 32)),
    ("gpt batch 32 -> 128", "gpt", (4, 128, 4, 64, 128)),
    ("gpt width 128 -> 512", "gpt", (4, 512, 8, 64, 128)),
    ("gpt depth 4 -> 16", "gpt", (16, 512, 8, 64, 128)),
]


def names(cuts, p: int) -> str:
    return "-".join(pv.cut_name(c, p) for c in cuts)


def timed(fn, reps: int) -> tuple:
    """(median seconds over reps calls, the last result)."""
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


# ---------------------------------------------------------------- the profiling baseline (ranks)

class Profiler:
    """Times local matmuls and collectives on the ranks of ``comm``; caches identical shapes."""

    def __init__(self, comm, reps: int):
        self.comm, self.reps, self.cache = comm, reps, {}
        self.rng = np.random.default_rng(comm.rank)

    def _time(self, key, run) -> float:
        """One warm-up and ``reps`` timed runs, all ranks together; the slowest rank's median."""
        if key not in self.cache:
            from mpi4py import MPI
            run()
            times = []
            for _ in range(self.reps):
                self.comm.Barrier()
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            self.cache[key] = self.comm.allreduce(statistics.median(times), op=MPI.MAX)
        return self.cache[key]

    def matmuls(self, i: int, k: int, j: int) -> float:
        """Forward x @ W, input gradient dy @ W.T, weight gradient x.T @ dy of a local part."""
        x = self.rng.standard_normal((i, k), dtype=np.float32)
        w = self.rng.standard_normal((k, j), dtype=np.float32)
        dy = self.rng.standard_normal((i, j), dtype=np.float32)
        return self._time(("mm", i, k, j), lambda: (x @ w, dy @ w.T, x.T @ dy))

    def allreduce(self, nbytes: float) -> float:
        buf = np.ones(max(int(nbytes) // 4, 1), np.float32)
        out = np.empty_like(buf)
        return self._time(("ar", len(buf)), lambda: self.comm.Allreduce(buf, out))

    def exchange(self, nbytes: float) -> float:
        """Each rank sends its peer nbytes and receives as many (two ranks)."""
        buf = np.ones(max(int(nbytes) // 4, 1), np.float32)
        out = np.empty_like(buf)
        peer = 1 - self.comm.rank
        return self._time(("x", len(buf)), lambda: self.comm.Sendrecv(buf, peer, 0, out, peer, 0))

    def update(self, nbytes: float) -> float:
        """hpcnn's AdamW step on one float32 parameter of nbytes."""
        from hpcnn.nn.core import Parameter
        from hpcnn.nn.optim import AdamW
        p = Parameter(np.ones(max(int(nbytes) // 4, 1), np.float32), "w")
        p.grad = np.ones_like(p.data)
        opt = AdamW([p])
        return self._time(("up", p.data.size), lambda: opt.step(1e-3))

    def term(self, t: cost.Term, op: cost.Matmul, cut) -> float:
        """The profiled seconds of one BSP term of a strategy (the same superstep, run)."""
        if t.what.endswith("compute"):
            return self.matmuls(op.i // cut.batch, op.k // cut.reduce, op.j // cut.out)
        if t.what.endswith("update"):
            return self.update(t.nbytes)
        if t.devices != self.comm.size:
            raise ValueError(f"{t.what}: a group of {t.devices} devices; the profiler runs "
                             f"collectives over all {self.comm.size} ranks only")
        if t.what.startswith("redistribute"):
            return self.exchange(t.nbytes)       # one message: forward, gradient or batch size
        return self.allreduce(t.nbytes)


def divides(op: cost.Matmul, cut) -> bool:
    """True when the cut's parts divide the operator's extents (the runs need whole parts)."""
    return op.i % cut.batch == 0 and op.k % cut.reduce == 0 and op.j % cut.out == 0


def profile_plan(graph: cost.Graph, prof: Profiler, mach) -> tuple:
    """(cuts of least profiled time, its profiled seconds) over every combination of
    :func:`search.cut_options`; each operator and each neighbours' pair of cuts profiled once."""
    p = prof.comm.size
    options = search.cut_options(p)
    op_s = []
    for n, op in enumerate(graph.ops):
        single = cost.Graph((op,), ())
        last = n == len(graph.ops) - 1          # its output gathered for the loss
        op_s.append({c: sum(prof.term(t, op, c)
                            for t in cost.strategy_cost(single, [c], mach, loss=last).terms)
                     for c in options if divides(op, c)})
    edge_s = {}
    for a, b in graph.edges:
        pair = cost.Graph((graph.ops[a], graph.ops[b]), ((0, 1),))
        for ca, cb in itertools.product(op_s[a], op_s[b]):
            edge_s[a, b, ca, cb] = sum(
                prof.term(t, None, None)
                for t in cost.strategy_cost(pair, [ca, cb], mach, loss=False).terms
                if t.what.startswith("redistribute"))
    best = None
    for combo in itertools.product(*op_s):
        s = sum(op_s[n][c] for n, c in enumerate(combo)) + sum(
            edge_s[a, b, combo[a], combo[b]] for a, b in graph.edges)
        if best is None or s < best[1]:
            best = (list(combo), s)
    return best


def worker(a) -> int:
    """Under mpiexec: profile every MLP change in turn; rank 0 writes the results as JSON."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    mach = machine.load(machine.resolve(a.machine)).with_devices(comm.size)
    out = []
    for name, kind, shape in selected(a.changes):
        if kind != "mlp":
            continue
        graph = pv.mlp_graph(*shape)
        comm.Barrier()
        t = time.perf_counter()
        prof = Profiler(comm, a.reps)                    # a new model: nothing cached from before
        cuts, seconds = profile_plan(graph, prof, mach)
        elapsed = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
        least = search.least_price(graph, comm.size, mach)
        if least is None:
            raise SystemExit(f"{name}: too many combinations for search.least_price")
        least = least[0]
        # the cost model's choice as the profiles price it (from the same cache)
        model_s, _ = profile_plan_of(graph, least, prof, mach)
        out.append({"change": name, "profile_s": elapsed, "profile_plan": names(cuts, comm.size),
                    "profiled_step_s": seconds, "model_choice_profiled_s": model_s,
                    "timings": len(prof.cache)})
    if comm.rank == 0:
        with open(a.worker, "w") as f:
            json.dump(out, f)
    return 0


def profile_plan_of(graph: cost.Graph, cuts, prof: Profiler, mach) -> tuple:
    """(profiled seconds of the given cuts, their term count)."""
    terms = cost.strategy_cost(graph, cuts, mach).terms
    by_op = {f"op{n} ": (op, c) for n, (op, c) in enumerate(zip(graph.ops, cuts))}
    total = 0.0
    for t in terms:
        op, c = next((v for k, v in by_op.items() if t.what.startswith(k)), (None, None))
        total += prof.term(t, op, c)
    return total, len(terms)


def selected(which: str) -> list:
    if which == "all":
        return CHANGES
    picks = [int(v) for v in which.split(",")]
    bad = [v for v in picks if not 0 <= v < len(CHANGES)]
    if bad:
        scripts.refuse(f"--changes: indices {bad} outside 0..{len(CHANGES) - 1}")
    return [CHANGES[v] for v in picks]


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--machine", default="local-2vcpu", help="machine file or name")
    ap.add_argument("--out", default="runs/plan_portability")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per profiled shape")
    ap.add_argument("--replans", type=int, default=5, help="timed calls per re-planning")
    ap.add_argument("--changes", default="all", help="all, or indices into CHANGES (0,1,...)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.ranks != 2 or a.reps < 1 or a.replans < 1:
        scripts.refuse(f"--ranks ({a.ranks}) must be 2 (the profiler's collectives join all "
                       f"ranks), --reps ({a.reps}) and --replans ({a.replans}) >= 1")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    load_before = os.getloadavg()[0]
    path = machine.resolve(a.machine)
    mach = machine.load(path).with_devices(a.ranks)
    changes = selected(a.changes)

    result = os.path.join(os.path.abspath(a.out), "profiles.json")
    p = subprocess.run(scripts.mpi_command(a.ranks, [os.path.abspath(__file__),
                                                     f"--machine={path}", f"--reps={a.reps}",
                                                     f"--changes={a.changes}",
                                                     f"--worker={result}"]),
                       cwd=validation.ROOT, env=validation.run_env(), stderr=subprocess.PIPE,
                       text=True, timeout=3000)
    if p.returncode:
        raise RuntimeError(f"profiling workers failed ({p.returncode}): {p.stderr[-2000:]}")
    with open(result) as f:
        profiles = {r["change"]: r for r in json.load(f)}

    rows = []
    for name, kind, shape in changes:
        if kind == "mlp":
            graph = pv.mlp_graph(*shape)
            replan_s, (cuts, price) = timed(lambda: search.least_price(graph, a.ranks, mach),
                                            a.replans)
            dra_s, (dra_cuts, _) = timed(lambda: search.dra(graph, a.ranks), a.replans)
            prof = profiles[name]
            row = {"change": name, "model": kind,
                   "shape": f"{'-'.join(map(str, (pv.DIGITS[0], *shape[0], pv.DIGITS[1])))} "
                            f"batch {shape[1]}",
                   "replan_s": replan_s, "dra_s": dra_s, "profile_s": prof["profile_s"],
                   "ratio": prof["profile_s"] / replan_s, "timings": prof["timings"],
                   "model_plan": names(cuts, a.ranks), "dra_plan": names(dra_cuts, a.ranks),
                   "profile_plan": prof["profile_plan"], "predicted_step_s": price,
                   "profiled_step_s": prof["profiled_step_s"],
                   "model_choice_profiled_s": prof["model_choice_profiled_s"]}
        else:
            layers, dim, heads, seq, batch = shape
            model = hybrid.Transformer(layers, dim, heads, seq, 65, batch, "float32")
            replan_s, ranked = timed(lambda: hybrid.plan(model, mach), a.replans)
            row = {"change": name, "model": kind,
                   "shape": f"{layers} layers x {dim}, {heads} heads, context {seq}, batch {batch}",
                   "replan_s": replan_s, "dra_s": -1.0, "profile_s": -1.0, "ratio": -1.0,
                   "timings": 0, "model_plan": str(ranked[0].layout), "dra_plan": "",
                   "profile_plan": "", "predicted_step_s": ranked[0].step_s,
                   "profiled_step_s": -1.0, "model_choice_profiled_s": -1.0}
        row["same_plan"] = int(row["model_plan"] == row["profile_plan"]) if kind == "mlp" else -1
        rows.append(row)
        extra = "" if kind == "gpt" else (
            f", profiling {row['profile_s']:.2f} s ({row['timings']} timings, "
            f"{row['ratio']:.0f}x); plan {row['model_plan']} vs profiled {row['profile_plan']} "
            f"(its profiled step {row['model_choice_profiled_s'] / row['profiled_step_s'] - 1:+.1%})")
        print(f"{name}: re-plan {row['replan_s'] * 1e3:.2f} ms{extra}", flush=True)
    load_after = os.getloadavg()[0]
    attrs = {"machine": mach.name, "machine_file": path, "ranks": a.ranks, "reps": a.reps,
             "replans": a.replans, "load_before": load_before, "load_after": load_after,
             "command_line": scripts.command_line(), "wall_s": time.time() - t0}
    out = os.path.join(a.out, "results.h5")
    save_table(out, "changes", rows, attrs=attrs)
    print(f"load average {load_before:.2f} before, {load_after:.2f} after; "
          f"{time.time() - t0:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
