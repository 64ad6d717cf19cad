"""Pipeline bubble: measured vs analytic vs simulated idle fraction, and GPipe vs 1F1B memory.

pp = world size. The model is an MLP of ``--pairs`` identical Linear(W, W) + ReLU pairs (float32,
then softmax cross-entropy over W classes), cut uniformly so that every stage has the same cost;
W = 1024 and a micro-batch of 32 rows make one stage's forward a few ms on one core, so MPI latency
is small next to compute. For each schedule in {gpipe, 1f1b, interleaved (v = 2, only where
M % pp == 0), zb_h1, zb_v (v = 2 in a V)} and M in {1, 2, 4, 8, 16} micro-batches (global batch =
M x micro-batch, so the micro-batch size is fixed), the script runs ``--warmup`` untimed steps,
then ``--steps`` timed ``pipeline.train_step`` calls, each after a barrier. From the gathered
events (small: lowercase ``gather`` to rank 0):

    measured bubble = 1 - (sum over ranks of F + B + W time) / (n_ranks x step makespan)
    analytic        = (S - 1) / (M + S - 1)          S = pp (GPipe and 1F1B, equal stage costs)
    analytic_sched  = the schedule's own formula (schedules.formula_makespan) at t_f = t_b = t_w:
                      (p-1)/(vM + p-1) interleaved (Narayanan et al. 2021); (p-1)/(3M + p-1)
                      ZB-H1, M >= p, and (p-1)/(6M + p-1) ZB-V, M >= 2p-1 (Qi et al. 2024)
    simulated       = schedules.simulate(lists, t_f, t_b, t_w) with the measured per-stage means

plus the peak activation memory per rank (``peak_bytes`` from the blocks' spec, ``peak_inflight``
micro-batches) of every schedule: GPipe holds M micro-batches on stage 0, 1F1B at most S, ZB-V
at most 2S of its half-size stages.

Outputs: one HDF5 run log per configuration, runs/pipeline_bubble/<schedule>-M<M>.h5 (/timeline:
every timed step's events, times from the first timed step's barrier; /metrics: per step
t_start, t_end, step_time, bubble, loss; /ranks: compute and idle seconds, peak bytes), and the
tables "bubble" (one row per configuration) and "memory" (one row per configuration and rank) in
runs/pipeline_bubble/results.h5. Figures: analysis/pipeline_bubble.py, analysis/pipeline_gantt.py.

    mpiexec -n 4 python -m mpi4py experiments/pipeline_bubble.py
    mpiexec -n 2 python -m mpi4py experiments/pipeline_bubble.py --out=runs/pipeline_bubble_p2

CAVEAT: on a 2-core machine 4 ranks are OVERSUBSCRIBED (2 ranks per core; MPICH busy-polls while
waiting), so a rank's compute times include time descheduled and the measured bubble is distorted;
the results table records ``cores`` and ``oversubscribed`` and the figure says so in its title.
Each rank times its events from its own clock, started right after a barrier (no global clock).
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcnn import scripts  # noqa: E402
from hpcnn.schedule.ops import PIPELINE as COMPUTE  # noqa: E402  (F, B, W)
from hpcnn.log import RunLog  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.nn.chain import Chain  # noqa: E402
from hpcnn.nn.layers import Linear, ReLU  # noqa: E402
from hpcnn.nn.loss import SoftmaxCrossEntropy  # noqa: E402
from hpcnn.schedule import stages as partition, pipeline as schedules
from hpcnn.engine import pipelined as pipeline  # noqa: E402


def equal_mlp(width, pairs, seed=0):
    """``pairs`` x [Linear(width, width), ReLU], then softmax cross-entropy: equal-cost blocks."""
    blocks = []
    for i in range(pairs):
        blocks += [Linear(width, width, seed=seed, index=2 * i, dtype=np.float32, name=f"fc{i}",
                          init_std=(2.0 / width) ** 0.5), ReLU(dtype=np.float32)]
    return Chain(blocks, SoftmaxCrossEntropy(), name=f"mlp-{pairs}x{width}")


def analytic_sched(name, p, v, M):
    """Bubble fraction of the schedule's published formula at t_f = t_b = t_w = 1 per stage,
    NaN outside its conditions (see the module docstring)."""
    makespan = schedules.formula_makespan(name, p, M, 1.0, 1.0, 1.0, v)
    return float("nan") if makespan is None else 1.0 - 3.0 * v * M / makespan


def step_bubble(events, n_ranks):
    """(bubble, makespan, compute seconds per rank) of one step's events from every rank."""
    t0 = min(e[3] for e in events)
    t1 = max(e[4] for e in events)
    busy = np.zeros(n_ranks)
    for r, op, _, a, b in events:
        if op in COMPUTE:
            busy[r] += b - a
    span = t1 - t0
    return 1.0 - busy.sum() / (n_ranks * span), span, busy


def run_config(args, world, name, M, v):
    """Warm-up and timed steps of one (schedule, M); returns rank 0's row dicts (None elsewhere)."""
    rank, p = world.Get_rank(), world.Get_size()
    S = p * v
    model = equal_mlp(args.width, args.pairs, seed=args.seed)
    ranges = partition.uniform(len(model), S)
    lists = schedules.SCHEDULES[name](S, M, p)
    rng = np.random.default_rng(args.seed)
    n = M * args.micro
    x = rng.standard_normal((n, args.width)).astype(np.float32)         # (M * b, W)
    y = rng.integers(0, args.width, size=n)                              # (M * b,)
    for _ in range(args.warmup):
        pipeline.train_step(name, model, world, x, y, M, ranges=ranges, virtual=v)
    world.Barrier()
    origin = time.perf_counter()
    steps, durations = [], {}                        # (op, stage) -> [seconds] on this rank
    for _ in range(args.steps):
        world.Barrier()
        out = pipeline.train_step(name, model, world, x, y, M, ranges=ranges, virtual=v,
                                  t0=origin)
        for ins, ev in zip(lists[rank], out["events"]):                 # one event per instr
            if ins.kind in COMPUTE:
                durations.setdefault((ins.kind, ins.stage), []).append(ev[4] - ev[3])
        steps.append((out["events"], out["loss"]))
    mem = {"peak_bytes": out["peak_bytes"], "peak_inflight": out["peak_inflight"],
           "peak_inflight_stage": dict(out["peak_inflight_stage"])}
    gathered = world.gather((steps, durations, mem), root=0)
    if rank != 0:
        return None
    return summarize(args, name, M, v, p, lists, ranges, gathered)


def summarize(args, name, M, v, p, lists, ranges, gathered):
    """Rank 0: bubble per step, measured stage costs, simulation, run log, table rows."""
    S = p * v
    per_step = [[e for g in gathered for e in g[0][k][0]] for k in range(args.steps)]
    losses = [gathered[0][0][k][1] for k in range(args.steps)]
    stats = [step_bubble(ev, p) for ev in per_step]
    bubbles = np.array([s[0] for s in stats])
    spans = np.array([s[1] for s in stats])
    dur = {}
    for g in gathered:
        dur.update(g[1])
    mean = lambda op: [float(np.mean(dur[(op, s)])) if (op, s) in dur else 0.0  # noqa: E731
                       for s in range(S)]
    t_f, t_b, t_w = mean("F"), mean("B"), mean("W")
    sim = schedules.simulate(lists, t_f, t_b, t_w, n_stages=S, n_micro=M)
    path = os.path.join(args.out, f"{name}-M{M}.h5")
    config = {k: getattr(args, k) for k in ("width", "pairs", "micro", "warmup", "steps", "seed")}
    config.update(schedule=name, n_micro=M, pp=p, virtual=v)
    with RunLog(path, config, command_line=" ".join(sys.argv), world_size=p,
                mpi_library=MPI.Get_library_version().splitlines()[0], overwrite=True,
                extra_attrs={"experiment": "pipeline_bubble", "cores": os.cpu_count(),
                             "oversubscribed": p > (os.cpu_count() or 1)}) as log:
        log.set_plan({"schedule": name, "pp": p, "virtual": v, "n_stages": S, "n_micro": M,
                      "micro_batch": args.micro, "ranges": ranges, "t_f": t_f, "t_b": t_b,
                      "t_w": t_w, "predicted_makespan_s": sim.makespan,
                      "predicted_bubble": sim.bubble})
        for k, ev in enumerate(per_step):
            busy = stats[k][2]
            log.log_events(ev)
            log.log_ranks(k, [{"rank": r, "compute_s": busy[r], "idle_s": spans[k] - busy[r],
                               "peak_mem_bytes": gathered[r][2]["peak_bytes"]} for r in range(p)])
            log.log_metrics(k, t_start=min(e[3] for e in ev), t_end=max(e[4] for e in ev),
                            step_time=spans[k], bubble=bubbles[k], loss=losses[k])
    mem = [g[2] for g in gathered]
    row = {"schedule": name, "M": M, "pp": p, "virtual": v, "n_stages": S,
           "micro_batch": args.micro, "global_batch": M * args.micro,
           "makespan_s": float(np.mean(spans)), "bubble_measured": float(np.mean(bubbles)),
           "bubble_measured_std": float(np.std(bubbles)),
           "bubble_analytic": (p - 1) / (M + p - 1), "bubble_analytic_sched": analytic_sched(
               name, p, v, M), "bubble_simulated": float(sim.bubble),
           "makespan_simulated_s": float(sim.makespan), "t_f_s": float(np.mean(t_f)),
           "t_b_s": float(np.mean(t_b)), "t_w_s": float(np.mean(t_w)),
           "peak_inflight_stage0": int(mem[0]["peak_inflight_stage"][0]),
           "peak_inflight_rank_max": int(max(m["peak_inflight"] for m in mem)),
           "peak_bytes_rank0": int(mem[0]["peak_bytes"]),
           "peak_bytes_max": int(max(m["peak_bytes"] for m in mem)), "log": path}
    mem_rows = [{"schedule": name, "M": M, "rank": r, "peak_bytes": int(m["peak_bytes"]),
                 "peak_inflight": int(m["peak_inflight"]),
                 "peak_inflight_first_stage": int(m["peak_inflight_stage"][r])}
                for r, m in enumerate(mem)]
    print(f"{name:12s} M={M:3d}  bubble measured {row['bubble_measured']:.3f} "
          f"(±{row['bubble_measured_std']:.3f})  analytic {row['bubble_analytic']:.3f}  "
          f"sched {row['bubble_analytic_sched']:.3f}  simulated {row['bubble_simulated']:.3f}  "
          f"step {1e3 * row['makespan_s']:7.1f} ms  in-flight stage0 "
          f"{row['peak_inflight_stage0']:2d}  peak MB rank0 {row['peak_bytes_rank0'] / 2**20:6.1f}",
          flush=True)
    return row, mem_rows


def main(argv=None):
    ap = scripts.parser(__doc__)
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb_h1,zb_v")
    ap.add_argument("--micro-batches", dest="micro_batches", default="1,2,4,8,16")
    ap.add_argument("--width", type=int, default=1024)      # a stage's F is a few ms on one core
    ap.add_argument("--pairs", type=int, default=8)         # Linear+ReLU pairs; multiple of 2 pp
    ap.add_argument("--micro", type=int, default=32)        # rows per micro-batch (fixed)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/pipeline_bubble")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    names = args.schedules.split(",")
    Ms = [int(m) for m in args.micro_batches.split(",")]
    bad = [s for s in names if s not in schedules.SCHEDULES]
    if p < 2 or bad or args.pairs % p or args.steps < 1:   # identical on every rank: no collective
        scripts.refuse(f"need >= 2 ranks (got {p}), schedules in {list(schedules.SCHEDULES)} "
                   f"(unknown: {bad}), --pairs ({args.pairs}) a multiple of pp ({p}), "
                   f"--steps ({args.steps}) >= 1")
    os.makedirs(args.out, exist_ok=True)
    rows, mem_rows = [], []
    for name in names:
        v = 2 if name in ("interleaved", "zb_v") else 1
        for M in Ms:
            if args.pairs % (v * p) or (name == "interleaved" and M % p):
                continue                       # equal stages; interleaved needs M % pp == 0
            res = run_config(args, world, name, M, v)
            if res is not None:
                rows.append(res[0])
                mem_rows += res[1]
    if rank == 0:
        path = os.path.join(args.out, "results.h5")
        cores = os.cpu_count() or 1
        attrs = {"ranks": p, "cores": cores, "oversubscribed": p > cores,
                 "model": f"mlp {args.pairs} x (Linear {args.width}x{args.width} + ReLU), float32",
                 "micro_batch": args.micro, "steps": args.steps, "warmup": args.warmup}
        save_table(path, "bubble", rows, attrs)
        save_table(path, "memory", mem_rows, attrs)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
