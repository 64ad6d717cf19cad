"""Allreduce bandwidth of hpcnn's algorithms vs the MPI library's, and non-blocking overlap.

For float32 messages of 1 KiB .. 256 MiB (powers of 4), the median over repeats of the slowest
rank's time of: a raw ``MPI.Comm.Allreduce`` (``raw``), ``Communicator.allreduce`` with
``mpi``, ``ring``, ``rd`` and ``auto`` (after :func:`hpcnn.parallel.allreduce.calibrate`, which is
timed too). Algorithmic bandwidth = 2(p-1)/p n / t; ``x_raw`` columns are t_raw / t (above 1 is
faster than the library). Repeats are interleaved across algorithms and fewer for big sizes.

Overlap: a 64 MiB iallreduce (the library's Iallreduce, and hpcnn's ring) started before
about as much matmul compute as the communication takes, ``test()`` called between matmul blocks
(256 and 512 square, fp32), then ``wait()``: fraction hidden = (t_comm + t_compute - t_both) /
t_comm. Tables ``algos_p{p}`` and ``overlap_p{p}`` (suffixed ``_openmpi`` etc. when the library is
not MPICH) go to runs/bench/allreduce.h5.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/allreduce.py [--max-mib=256]
        [--segment=BYTES] [--isegment=BYTES] [--no-overlap]

About 1-2 minutes on 2 ranks; with Open MPI add ``--oversubscribe`` for more ranks than cores.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.parallel import allreduce as AR  # noqa: E402
from hpcnn.parallel.comm import Communicator  # noqa: E402

OPTS = {"max-mib": 256, "segment": AR.SEGMENT_BYTES, "isegment": AR.ISEGMENT_BYTES, "overlap": 1}
for a in sys.argv[1:]:
    if a == "--no-overlap":
        OPTS["overlap"] = 0
    elif a.startswith("--") and a[2:].split("=")[0] in OPTS:
        k, v = a[2:].split("=", 1)
        OPTS[k] = int(v)
    else:
        raise SystemExit(f"unknown option {a!r}; known: --max-mib=, --segment=, --isegment=, --no-overlap")

ALGOS = ("raw", "mpi", "ring", "rd", "auto")


def library_version() -> str:
    """First line of the MPI library's version (Open MPI's carries a NUL that HDF5 refuses)."""
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def library() -> str:
    v = library_version()
    return "mpich" if "MPICH" in v else "openmpi" if "Open MPI" in v else v.split()[0].lower()


def slowest_median(world, ts) -> float:
    """Median over repeats of the slowest rank's time."""
    t = np.asarray(ts, dtype=np.float64)
    world.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return float(np.median(t))


def bench_sizes(c, world):
    p, rows = world.Get_size(), []
    sizes = [1 << k for k in range(10, 29, 2) if (1 << k) <= OPTS["max-mib"] << 20]
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, np.float32)
        reps = max(7, min(200, (1 << 27) // nbytes))   # 7 at >= 16 MiB: p=4 is noisy there
        fns = {"raw": lambda: world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
               **{a: (lambda a=a: c.allreduce(buf, algorithm=a)) for a in ALGOS[1:]}}
        ts = {a: [] for a in ALGOS}
        for rep in range(reps + 1):
            for a in ALGOS:
                world.Barrier()
                t0 = time.perf_counter()
                fns[a]()
                if rep:
                    ts[a].append(time.perf_counter() - t0)
        t = {a: slowest_median(world, ts[a]) for a in ALGOS}
        row = {"bytes": nbytes, "auto_choice": AR.choose(c, nbytes)}
        for a in ALGOS:
            row[f"{a}_us"] = t[a] * 1e6
            row[f"{a}_GBps"] = 2 * (p - 1) / p * nbytes / t[a] / 1e9
            if a != "raw":
                row[f"{a}_x_raw"] = t["raw"] / t[a]
        rows.append(row)
        if world.Get_rank() == 0:
            print(f"{nbytes:>10} " + " ".join(f"{row[f'{a}_us']:10.1f} {row[f'{a}_GBps']:6.2f}"
                                               for a in ALGOS)
                  + " " + " ".join(f"{row[f'{a}_x_raw']:5.2f}" for a in ALGOS[1:])
                  + f"  {row['auto_choice']}", flush=True)
    return rows


def bench_overlap(c, world, nbytes=64 << 20, reps=5):
    """Fraction of a non-blocking allreduce hidden behind matmul blocks with test() between."""
    rows = []
    buf = np.zeros(nbytes // 4, np.float32)
    for bs in (256, 512):
        x = np.random.default_rng(0).standard_normal((bs, bs), dtype=np.float32)
        y = np.empty_like(x)
        ts = []
        for _ in range(40):
            t0 = time.perf_counter()
            np.matmul(x, x, out=y)
            ts.append(time.perf_counter() - t0)
        t_block = slowest_median(world, ts[10:])
        for method in ("mpi", "ring"):
            def comm_only():
                c.iallreduce(buf, algorithm=method).wait()

            def compute(k, req=None):
                for _ in range(k):
                    np.matmul(x, x, out=y)
                    if req is not None:
                        req.test()

            progressed = []

            def both(k):
                req = c.iallreduce(buf, algorithm=method)
                compute(k, req)
                progressed.append(getattr(req, "progress", float(req.done)))
                req.wait()

            def timed(fn, *args):
                ts = []
                for _ in range(reps + 1):
                    world.Barrier()
                    t0 = time.perf_counter()
                    fn(*args)
                    ts.append(time.perf_counter() - t0)
                return slowest_median(world, ts[1:])

            t_comm = timed(comm_only)
            k = max(1, int(round(t_comm / t_block)))
            t_comp = timed(compute, k)
            t_both = timed(both, k)
            row = {"method": method, "block": bs, "blocks": k, "comm_ms": t_comm * 1e3,
                   "compute_ms": t_comp * 1e3, "both_ms": t_both * 1e3,
                   "exposed_ms": (t_both - t_comp) * 1e3,
                   "progress_before_wait": float(np.median(progressed)),
                   "hidden": (t_comm + t_comp - t_both) / t_comm}
            rows.append(row)
            if world.Get_rank() == 0:
                print(f"overlap {method:>4} block {bs:3d} x{k:4d}: comm {row['comm_ms']:7.1f} ms, "
                      f"compute {row['compute_ms']:7.1f} ms, both {row['both_ms']:7.1f} ms -> "
                      f"{100 * row['hidden']:5.1f} % hidden, {row['exposed_ms']:6.1f} ms exposed, "
                      f"{100 * row['progress_before_wait']:3.0f} % done before wait",
                      flush=True)
    return rows


def main():
    world = MPI.COMM_WORLD
    p, lib = world.Get_size(), library()
    c = Communicator(world)
    c.allreduce_segment_bytes = OPTS["segment"]
    c.iallreduce_segment_bytes = OPTS["isegment"]
    world.Barrier()
    t0 = time.perf_counter()
    c.allreduce_table = AR.calibrate(c)
    t_cal = time.perf_counter() - t0
    if world.Get_rank() == 0:
        print(f"{library_version()}; {p} ranks; segment {OPTS['segment']} B, "
              f"non-blocking {OPTS['isegment']} B")
        print(f"calibration {t_cal:.2f} s: " + ", ".join(
            f"{s}:{ch}" for s, ch in zip(c.allreduce_table["sizes"], c.allreduce_table["choice"])))
        print(f"{'bytes':>10} " + " ".join(f"{a + ' us':>10} {'GB/s':>6}" for a in ALGOS)
              + " " + " ".join(f"{a[:5]:>5}" for a in ALGOS[1:]) + "  (x raw)  auto")
    rows = bench_sizes(c, world)
    orows = bench_overlap(c, world) if OPTS["overlap"] else []
    if world.Get_rank() == 0:
        out = os.path.join("runs", "bench", "allreduce.h5")
        suffix = "" if lib == "mpich" else f"_{lib}"
        attrs = {"library": library_version(), "ranks": p,
                 "segment_bytes": OPTS["segment"], "isegment_bytes": OPTS["isegment"],
                 "calibration_s": t_cal,
                 "calibration": c.allreduce_table, "omp_threads": os.environ["OMP_NUM_THREADS"]}
        save_table(out, f"algos_p{p}{suffix}", rows, attrs)
        if orows:
            save_table(out, f"overlap_p{p}{suffix}", orows, attrs)
        big = [r for r in rows if r["bytes"] >= 16 << 20]
        print(f"auto vs raw: worst {min(r['auto_x_raw'] for r in rows):.2f}x (target >= 0.95)"
              + (f", at >= 16 MiB worst {min(r['auto_x_raw'] for r in big):.2f}x (target >= 1.5)"
                 if big else ""))
        print(f"wrote {out}")
    AR.free(c)


if __name__ == "__main__":
    main()
