"""Data parallelism on 2 ranks: the bucketed gradient path, overlap on/off, and efficiency.

(a) reduce: DataParallel's bucketed reduction of an MLP's gradients (4 x 2048^2 float32, 64 MiB),
    with and without the finiteness check, against one raw ``Allreduce`` of the same bytes in one
    flat buffer, in the same run (ratio).
(b) overlap: step time of that MLP (forward, backward, reduce, SGD with momentum) with overlap off
    and on, for bucket sizes and allreduce algorithms (ring progresses only when tested, which the
    backward does after every block); "compute" is the same step with no communication, both ranks
    busy at once, so step - compute is the communication left exposed.
(c) efficiency: samples/s of 2 ranks (global batch 2B) against 1 rank (batch B, rank 0 alone on
    COMM_SELF while rank 1 sleeps), the 1-rank and 2-rank phases alternating in rounds.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/data_parallel.py [--repeats=8] \\
        [--batch=64]

Each figure is the median over steps of the slowest rank's time at that step; variants are
interleaved round by round so that drifts of a shared host hit them all alike. Results:
runs/bench/data_parallel.h5, tables ``reduce``, ``overlap``, ``efficiency``.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcnn import scripts  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.nn import models  # noqa: E402
from hpcnn.nn.optim import SGD  # noqa: E402
from hpcnn.parallel.collectives import Communicator  # noqa: E402
from hpcnn.parallel.data.bucketed import DataParallel  # noqa: E402

REPEATS, BATCH = 8, 64                  # --repeats, --batch: main() sets them
WIDTH, LAYERS = 2048, 4
OUT = os.path.join("runs", "bench", "data_parallel.h5")

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()


def say(*a):
    scripts.say(*a, rank=rank)


def idle_until_rank0():
    """Rank 1's side of a phase that rank 0 runs alone: sleep (no busy-polling MPI barrier)."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def replica(comm, **dp_kw):
    """A fresh model (same seed on every rank), its optimizer and a DataParallel over ``comm``."""
    model = models.mlp(WIDTH, (WIDTH,) * (LAYERS - 1), WIDTH, seed=0, dtype=np.float32)
    return model, SGD(model.params, momentum=0.9), DataParallel(model, comm, **dp_kw)


def batch():
    rng = np.random.default_rng(rank)
    return (rng.standard_normal((BATCH, WIDTH), dtype=np.float32),
            rng.integers(0, WIDTH, size=BATCH))


def steps(rep, x, y, dloss, n, barrier):
    """n steps: a list of (step, finish wait, blocking reduce) seconds per step."""
    model, opt, dp = rep
    rows = []
    for s in range(n):
        barrier()
        t = time.perf_counter()
        dp.zero_grad()
        _, caches = model.forward(x, y)
        dp.backward(dloss, caches)
        info = dp.finish(s)
        opt.step(1e-5)
        rows.append((time.perf_counter() - t, info["wait_s"], info["reduce_s"]))
    return rows


def job_median(rows, comm=world):
    """Per column: the median over steps of the slowest rank's value at each step."""
    a = np.ascontiguousarray(rows, dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, a, op=MPI.MAX)
    return [float(v) for v in np.median(a, axis=0)]


# -- (a) the bucketed reduction vs one raw Allreduce of the same bytes ----------------------------
def bench_reduce():
    comm = Communicator(world)
    model = replica(comm)[0]
    # (bucket MiB, finite check, algorithm); "auto" picks shm on one node, which sums the
    # peers' flat gradient buffers in place (they live in the node's shared window)
    variants = [(25.0, True, "mpi"), (25.0, False, "mpi"), (1e4, False, "mpi"), (4.0, False, "mpi"),
                (25.0, True, "auto"), (25.0, False, "auto"), (1e4, False, "auto")]
    dps = {v: DataParallel(model, comm, bucket_mb=v[0], overlap=False, check_finite=v[1],
                           algorithm=v[2])
           for v in variants}                     # each its own flat buffer (the last is bound)
    flat = np.full(model.num_params(), 1e-3, np.float32)
    times = {v: [] for v in [*variants, "raw"]}
    for rnd in range(REPEATS + 1):                # interleaved, so drifts hit every variant alike
        for v, ts in times.items():
            for f in ([flat] if v == "raw" else dps[v].flats):
                f.fill(1e-3)
            world.Barrier()
            t = time.perf_counter()
            if v == "raw":
                world.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            else:
                dps[v].finish(0)                  # nothing started yet: reduces every bucket
            if rnd:
                ts.append((time.perf_counter() - t,))
    raw = job_median(times["raw"])[0]
    rows = []
    for v, ts in times.items():
        t = job_median(ts)[0]
        name = "raw Allreduce, 1 buffer" if v == "raw" else (
            f"DataParallel {v[2]} {v[0]:g} MiB buckets" + ("" if v[1] else ", no finite check"))
        rows.append({"path": name, "buckets": 1 if v == "raw" else dps[v].n_buckets,
                     "bytes": flat.nbytes, "seconds": t, "GB_per_s": flat.nbytes / t / 1e9,
                     "time_over_raw": t / raw})
    return rows


# -- (b) overlap on vs off, and the same step with no communication --------------------------------
VARIANTS = [("compute only (no comm)", False, 25.0, False, "mpi"),
            ("overlap off", True, 25.0, False, "mpi"),
            ("overlap on", True, 25.0, True, "mpi"),
            ("overlap on", True, 4.0, True, "mpi"),
            ("overlap on", True, 25.0, True, "ring"),
            ("overlap on", True, 4.0, True, "ring"),
            ("overlap off", True, 25.0, False, "auto"),
            ("overlap on", True, 25.0, True, "auto")]


def bench_overlap(reps, x, y):
    res = {v: [] for v in VARIANTS}
    for rnd in range(REPEATS):                    # interleaved rounds: drifts hit every variant
        for v in VARIANTS:
            rows = steps(reps[v], x, y, 1.0 / size, 3 if rnd == 0 else 2, world.Barrier)
            res[v] += rows[1:] if rnd == 0 else rows      # the very first step warms up
    t_comp = job_median(res[VARIANTS[0]])[0]
    out = []
    for v in VARIANTS:
        t, wait, red = job_median(res[v])
        out.append({"variant": v[0], "bucket_mb": v[2], "algorithm": v[4],
                    "buckets": reps[v][2].n_buckets, "step_s": t, "wait_s": wait,
                    "blocking_reduce_s": red, "exposed_comm_s": t - t_comp,
                    "samples_per_s": size * BATCH / t})
    return out


# -- (c) 2 ranks vs 1 rank -------------------------------------------------------------------------
def one_rank_steps(rep, x, y, n):
    """Rank 0 alone (COMM_SELF) while rank 1 sleeps: n step times, known on every rank."""
    t = None
    if rank == 0:
        t = [r[0] for r in steps(rep, x, y, 1.0, n, lambda: None)]
        world.Ibarrier().Wait()
    else:
        idle_until_rank0()
    return world.bcast(t, root=0)


def bench_efficiency(reps, x, y):
    alone = replica(Communicator(MPI.COMM_SELF)) if rank == 0 else None
    one_rank_steps(alone, x, y, 1)                 # warm-up
    t1, two = [], {v: [] for v in VARIANTS        # 2 ranks: overlap off / on, 25 MiB, mpi / auto
                   if v[1] and v[2] == 25.0 and v[4] in ("mpi", "auto")}
    for _ in range(max(2, REPEATS // 2)):          # 1-rank and 2-rank phases alternate
        t1 += one_rank_steps(alone, x, y, 3)
        for v in two:
            two[v] += steps(reps[v], x, y, 1.0 / size, 3, world.Barrier)
    t1 = float(np.median(t1))
    rows = [{"ranks": 1, "variant": "alone", "algorithm": "-", "global_batch": BATCH, "step_s": t1,
             "samples_per_s": BATCH / t1, "efficiency": 1.0}]
    for v, ts in two.items():
        t2 = job_median(ts)[0]
        rows.append({"ranks": size, "variant": v[0], "algorithm": v[4],
                     "global_batch": size * BATCH, "step_s": t2,
                     "samples_per_s": size * BATCH / t2, "efficiency": t1 / t2})
    return rows


def table(title, rows):
    cells = [list(rows[0])] + [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()]
                               for r in rows]
    widths = [max(len(c[j]) for c in cells) for j in range(len(cells[0]))]
    say(f"\n{title}")
    for c in cells:
        say("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--batch", type=int, default=BATCH, help="per rank")
    return ap


def main(argv=None):
    global REPEATS, BATCH
    a = parser().parse_args(argv)
    REPEATS, BATCH = a.repeats, a.batch
    x, y = batch()
    world_comm, alone = Communicator(world), Communicator(MPI.COMM_SELF)
    reps = {v: replica(world_comm if v[1] else alone, bucket_mb=v[2], overlap=v[3],
                       algorithm=v[4]) for v in VARIANTS}
    mib = sum(p.data.nbytes for p in reps[VARIANTS[0]][0].params) / 2 ** 20
    say(f"{size} ranks, MLP {LAYERS} x {WIDTH}^2 float32 ({mib:.1f} MiB of gradients), "
        f"batch {BATCH} per rank, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
        f"MPI: {MPI.Get_library_version().splitlines()[0]}")
    results = {"reduce": bench_reduce(),
               "overlap": bench_overlap(reps, x, y),
               "efficiency": bench_efficiency(reps, x, y)}
    for name, rows in results.items():
        table(name, rows)
    if rank == 0:
        attrs = {"ranks": size, "batch_per_rank": BATCH, "repeats": REPEATS, "width": WIDTH,
                 "layers": LAYERS, "omp_threads": os.environ["OMP_NUM_THREADS"],
                 "mpi": MPI.Get_library_version().splitlines()[0]}
        for name, rows in results.items():
            save_table(OUT, name, rows, attrs=attrs)
        print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
