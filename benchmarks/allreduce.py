"""Allreduce bandwidth of hpcnn's algorithms vs the MPI library's, per-call overhead, overlap.

For float32 messages of 1 KiB .. 256 MiB (powers of 4), the median over repeats of the slowest
rank's time of: a raw ``MPI.Comm.Allreduce`` (``raw``), ``Communicator.allreduce`` with
``mpi``, ``ring``, ``rd``, ``shm`` (when all ranks share a node), ``cma`` (single-copy reads
of the peers' memory, where the kernel allows it) and ``auto`` (after
:func:`hpcnn.parallel.collectives.algorithms.calibrate`, which is timed too), all on a private
NumPy buffer;
``shm0`` and ``auto0``: shm and auto on a buffer from ``Communicator.shared_zeros`` (zero copy);
``impi``, ``iauto`` and ``iauto0``: ``iallreduce(...).wait()`` with ``mpi`` (the library's
Iallreduce) and with ``auto`` on the private and the shared buffer: the thresholds of the
non-blocking ``auto``, so ``x_raw`` of ``iauto*`` is against ``impi`` (the request's own cost
against a bare ``Iallreduce().Wait()`` is in the overhead lines).
Algorithmic bandwidth = 2(p-1)/p n / t; ``x_raw`` columns are t_raw / t (above 1 is faster than
the library). Repeats are interleaved across algorithms, in a random order each (one algorithm's
cache footprint slows the next one), and fewer for big sizes.

``--runs=N`` repeats the calibration and the sizes N times in a row (a fresh communicator and
calibration each run) and ends with one line a run: the load average (1 min) before and after,
``auto``'s worst ratio to ``raw`` and at which size, ``auto0``'s worst ratio from 16 MiB,
``iauto``'s worst ratio to ``impi``, and ``mpi``'s worst ratio to ``raw`` (the library's
call through hpcnn against itself: how far noise alone moves a ratio); and the verdict against the targets (``auto`` >= 0.95x at
every size in all runs but one and >= 0.85x in all; ``auto0`` >= 1.5x from 16 MiB). Table
``runs_p{p}``; ``algos_p{p}`` holds every run's rows (column ``run``).

Overhead: back-to-back calls at 8 B and 1 KiB (blocks of calls, blocks interleaved, the median
block): raw ``Allreduce`` against ``allreduce`` with ``mpi`` and ``auto``, and raw
``Iallreduce().Wait()`` against ``iallreduce().wait()``.

Overlap: a 64 MiB iallreduce (the library's Iallreduce, hpcnn's ring, shm) started before
about as much matmul compute as the communication takes, ``test()`` called between matmul blocks
(256 and 512 square, fp32), then ``wait()``: fraction hidden = (t_comm + t_compute - t_both) /
t_comm. Tables ``algos_p{p}``, ``overhead_p{p}`` and ``overlap_p{p}`` (suffixed ``_openmpi`` etc.
when the library is not MPICH) go to runs/bench/allreduce.h5.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/allreduce.py [--max-mib=256]
        [--segment=BYTES] [--isegment=BYTES] [--piece=BYTES] [--no-overlap] [--no-calibrate]
        [--no-nonblocking] [--runs=N]

About 2-3 minutes a run on 2 ranks; with Open MPI add ``--oversubscribe`` for more ranks than cores.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcnn import scripts  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.parallel.collectives import algorithms  # noqa: E402
from hpcnn.parallel.collectives import shm  # noqa: E402
from hpcnn.parallel.collectives import Communicator  # noqa: E402

OPTS = {"max-mib": 256, "segment": algorithms.SEGMENT_BYTES, "isegment": algorithms.ISEGMENT_BYTES,
        "piece": shm.PIECE_BYTES, "overlap": 1, "calibrate": 1, "runs": 1}  # main() sets them


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--max-mib", type=int, default=OPTS["max-mib"], help="largest message, MiB")
    ap.add_argument("--segment", type=int, default=OPTS["segment"],
                    help="allreduce segment bytes")
    ap.add_argument("--isegment", type=int, default=OPTS["isegment"],
                    help="non-blocking allreduce segment bytes")
    ap.add_argument("--piece", type=int, default=OPTS["piece"], help="shm piece bytes")
    scripts.flag(ap, "overlap", True, "time the overlap of iallreduce with compute")
    scripts.flag(ap, "calibrate", True, "calibrate auto's table first")
    scripts.flag(ap, "nonblocking", True, "time Iallreduce and the non-blocking auto per size")
    ap.add_argument("--runs", type=int, default=OPTS["runs"],
                    help="calibrations and size sweeps in a row, then one summary line a run")
    return ap


ALGOS = ["raw", "mpi", "ring", "rd", "shm", "cma", "auto", "shm0", "auto0",  # shm*, cma: one node
         "impi", "iauto", "iauto0"]                 # non-blocking, against impi
IALGOS = ("iauto", "iauto0")


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


def bench_sizes(c, world, run=0):
    p, rows = world.Get_size(), []
    sizes = [1 << k for k in range(10, 29, 2) if (1 << k) <= OPTS["max-mib"] << 20]
    shared = c.shared_zeros(sizes[-1] // 4, np.float32) if "shm" in ALGOS else None
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, np.float32)
        reps = max(15, min(200, (1 << 27) // nbytes))  # 15 at >= 16 MiB: medians of noisy runs
        fns = {"raw": lambda: world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
               "impi": lambda: c.iallreduce(buf, algorithm="mpi").wait(),
               "iauto": lambda: c.iallreduce(buf, algorithm="auto").wait(),
               **{a: (lambda a=a: c.allreduce(buf, algorithm=a))
                  for a in ALGOS[1:] if a[-1] != "0" and a[0] != "i"}}
        if shared is not None:                          # zero copy: the buffer is shared memory
            sbuf = shared[:nbytes // 4]
            fns["shm0"] = lambda: c.allreduce(sbuf, algorithm="shm")
            fns["auto0"] = lambda: c.allreduce(sbuf, algorithm="auto")
            fns["iauto0"] = lambda: c.iallreduce(sbuf, algorithm="auto").wait()
        ts = {a: [] for a in ALGOS}
        for rep in range(reps + 1):
            for a in np.random.default_rng(rep).permutation(ALGOS):   # same order on all ranks
                a = str(a)
                world.Barrier()
                t0 = time.perf_counter()
                fns[a]()
                if rep:
                    ts[a].append(time.perf_counter() - t0)
        t = {a: slowest_median(world, ts[a]) for a in ALGOS}
        row = {"run": run, "bytes": nbytes, "auto_choice": algorithms.choose(c, nbytes)}
        for a in ALGOS:
            row[f"{a}_us"] = t[a] * 1e6
            row[f"{a}_GBps"] = 2 * (p - 1) / p * nbytes / t[a] / 1e9
            if a not in ("raw", "impi"):
                row[f"{a}_x_raw"] = t["impi" if a in IALGOS else "raw"] / t[a]
        rows.append(row)
        if world.Get_rank() == 0:
            print(f"{nbytes:>10} " + " ".join(f"{row[f'{a}_us']:10.1f} {row[f'{a}_GBps']:6.2f}"
                                               for a in ALGOS)
                  + " " + " ".join(f"{row[f'{a}_x_raw']:6.2f}" for a in ALGOS if a not in ("raw", "impi"))
                  + f"  {row['auto_choice']}", flush=True)
    return rows


def bench_overhead(c, world, block=2000, rounds=15):
    """Per-call time of back-to-back calls at 8 B and 1 KiB: the Python wrapper's overhead."""
    rows = []
    IP, S = MPI.IN_PLACE, MPI.SUM
    for nbytes in (8, 1024):
        buf = np.zeros(nbytes // 4, np.float32)
        c.allreduce(buf, algorithm="auto")
        c.iallreduce(buf, algorithm="auto").wait()      # both auto lookups compiled
        fns = {"raw": lambda: world.Allreduce(IP, buf, S),
               "mpi": lambda: c.allreduce(buf),
               "auto": lambda: c.allreduce(buf, algorithm="auto"),
               "iraw": lambda: world.Iallreduce(IP, buf, S).Wait(),
               "impi": lambda: c.iallreduce(buf).wait(),
               "iauto": lambda: c.iallreduce(buf, algorithm="auto").wait()}
        ts = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(block):
                    fn()
                ts[k].append((time.perf_counter() - t0) / block)
        t = {k: slowest_median(world, v) for k, v in ts.items()}
        row = {"bytes": nbytes, **{f"{k}_us": v * 1e6 for k, v in t.items()}}
        for k in ("mpi", "auto"):
            row[f"{k}_x_raw"] = t["raw"] / t[k]
            row[f"i{k}_x_raw"] = t["iraw"] / t[f"i{k}"]
        rows.append(row)
        if world.Get_rank() == 0:
            print(f"per call {nbytes:5d} B: raw {row['raw_us']:.2f} us, mpi {row['mpi_us']:.2f} "
                  f"({row['mpi_x_raw']:.3f}x), auto {row['auto_us']:.2f} ({row['auto_x_raw']:.3f}x)"
                  f" | Iallreduce raw {row['iraw_us']:.2f} us, mpi {row['impi_us']:.2f} "
                  f"({row['impi_x_raw']:.3f}x), auto {row['iauto_us']:.2f} "
                  f"({row['iauto_x_raw']:.3f}x)", flush=True)
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
        for method in ("mpi", "ring") + (("shm",) if "shm" in ALGOS else ()):
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


def summary(rows, run, load, t_cal) -> dict:
    """One run's figures against the targets: auto's worst ratio to raw (and the size),
    auto0's worst from 16 MiB, iauto's worst to impi."""
    def worst(a, rs):
        r = min(rs, key=lambda r: r[f"{a}_x_raw"]) if rs and a in ALGOS else None
        return (r[f"{a}_x_raw"], r["bytes"]) if r else (float("nan"), 0)
    big = [r for r in rows if r["bytes"] >= 16 << 20]
    (auto, at), (auto0, at0), (iauto, iat) = worst("auto", rows), worst("auto0", big), \
        worst("iauto", rows)
    return {"run": run, "load_before": load[0], "load_after": load[1], "calibration_s": t_cal,
            "mpi_worst_x_raw": worst("mpi", rows)[0],      # the same call: the noise floor
            "auto_worst_x_raw": auto, "auto_worst_bytes": at, "auto0_16mib_worst_x_raw": auto0,
            "auto0_16mib_worst_bytes": at0, "iauto_worst_x_impi": iauto, "iauto_worst_bytes": iat}


def _mib(n) -> str:
    if not n:
        return "-"
    return f"{n / 2**20:g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def print_summary(runs) -> None:
    """One line a run, then the verdict against the targets of the issue."""
    print(f"{'run':>3} {'load 1-min':>11} {'auto/raw worst':>22} {'auto0/raw >=16MiB':>22} "
          f"{'iauto/impi worst':>22} {'mpi/raw worst':>13}")
    for s in runs:
        print(f"{s['run']:>3} {s['load_before']:5.2f}-{s['load_after']:<5.2f} "
              + " ".join(f"{s[a]:10.2f}x at {_mib(s[b]):>8}" for a, b in (
                  ("auto_worst_x_raw", "auto_worst_bytes"),
                  ("auto0_16mib_worst_x_raw", "auto0_16mib_worst_bytes"),
                  ("iauto_worst_x_impi", "iauto_worst_bytes")))
              + f" {s['mpi_worst_x_raw']:12.2f}x")
    w = [s["auto_worst_x_raw"] for s in runs]
    w0 = [s["auto0_16mib_worst_x_raw"] for s in runs]
    print(f"auto >= 0.95x at every size in {sum(x >= 0.95 for x in w)} of {len(w)} runs (target: "
          f"all but one), >= 0.85x in {sum(x >= 0.85 for x in w)} (target: all); auto0 >= 1.5x "
          f"from 16 MiB in {sum(x >= 1.5 for x in w0)} (target: all)")


def main(argv=None):
    a = parser().parse_args(argv)
    OPTS.update({"max-mib": a.max_mib, "segment": a.segment, "isegment": a.isegment,
                 "piece": a.piece, "overlap": int(a.overlap), "calibrate": int(a.calibrate),
                 "runs": max(1, a.runs)})
    world = MPI.COMM_WORLD
    p, lib = world.Get_size(), library()

    def communicator():
        c = Communicator(world)
        c.allreduce_segment_bytes = OPTS["segment"]
        c.iallreduce_segment_bytes = OPTS["isegment"]
        c.shm_piece_bytes = OPTS["piece"]
        return c

    c = communicator()
    if not algorithms.single_node(c):
        for x in ("shm", "shm0", "auto0", "iauto0"):
            ALGOS.remove(x)
    from hpcnn.parallel.collectives import cma
    if not cma.available(c):
        ALGOS.remove("cma")
    if not a.nonblocking:
        for x in ("impi", "iauto", "iauto0"):
            if x in ALGOS:
                ALGOS.remove(x)
    hrows = bench_overhead(c, world)
    rows, runs, tables = [], [], []
    for run in range(OPTS["runs"]):
        if run:
            algorithms.free(c)
            c = communicator()
        load0 = os.getloadavg()[0]
        world.Barrier()
        t0 = time.perf_counter()
        if OPTS["calibrate"]:
            algorithms.calibrate(c)
        t_cal = time.perf_counter() - t0
        table = c.allreduce_table or algorithms.default_table(c)
        tables.append({k: table[k] for k in ("sizes", "choice")})
        if world.Get_rank() == 0:
            print(f"run {run}: {library_version()}; {p} ranks; segment {OPTS['segment']} B, "
                  f"non-blocking {OPTS['isegment']} B, shm piece {OPTS['piece']} B, "
                  f"{'one node' if 'shm' in ALGOS else 'several nodes'}; load {load0:.2f}")
            print(f"calibration {t_cal:.2f} s: " if OPTS["calibrate"] else "default table: ",
                  ", ".join(f"{s}:{ch}" for s, ch in zip(table["sizes"], table["choice"])))
            print(f"{'bytes':>10} " + " ".join(f"{x + ' us':>10} {'GB/s':>6}" for x in ALGOS)
                  + " " + " ".join(f"{x[:6]:>6}" for x in ALGOS if x not in ("raw", "impi"))
                  + "  (x raw)  auto", flush=True)
        got = bench_sizes(c, world, run)
        rows += got
        runs.append(summary(got, run, (load0, os.getloadavg()[0]), t_cal))
    orows = bench_overlap(c, world) if OPTS["overlap"] else []
    if world.Get_rank() == 0:
        out = os.path.join("runs", "bench", "allreduce.h5")
        suffix = "" if lib == "mpich" else f"_{lib}"
        attrs = {"library": library_version(), "ranks": p,
                 "segment_bytes": OPTS["segment"], "isegment_bytes": OPTS["isegment"],
                 "shm_piece_bytes": OPTS["piece"], "calibration_s": runs[-1]["calibration_s"],
                 "calibration": tables[-1] if OPTS["runs"] == 1 else tables,
                 "calibrated": OPTS["calibrate"], "omp_threads": os.environ["OMP_NUM_THREADS"]}
        save_table(out, f"algos_p{p}{suffix}", rows, attrs)
        save_table(out, f"runs_p{p}{suffix}", runs, attrs)
        save_table(out, f"overhead_p{p}{suffix}", hrows, attrs)
        if orows:
            save_table(out, f"overlap_p{p}{suffix}", orows, attrs)
        print_summary(runs)
        print("back-to-back auto vs raw: " + ", ".join(
            f"{r['bytes']} B {r['auto_x_raw']:.3f}x (+{r['auto_us'] - r['raw_us']:.2f} us)"
            for r in hrows))
        print(f"wrote {out}")
    algorithms.free(c)


if __name__ == "__main__":
    main()
