"""Start-up cost of ``--allreduce=auto``: from the Communicator's creation to the first step.

(a) startup: for the MLP on digits (the default run, and with ``--overlap=false``, whose gradient
    bucket ``auto`` reduces with a calibrated choice) on 2, 3 and 4 ranks, and for the GPT of
    ``make demo`` on 2 data-parallel x 2 pipeline ranks (``gpt-demo``), the seconds from
    the run context's creation (grid, communicators) through the model build to the end of its
    ``attach`` (``hpcnn.engine.context.ParallelContext``; older code: ``train._Parallel``)
    (``start-up``), of which in ``attach`` (the data-parallel engine and the calibration) and in
    the calibration itself (this code: ``calibration.for_run``; the older code:
    ``algorithms.calibrate``; timed from a barrier), the slowest rank's, for:
      ``before``  the code of git revision ``--before=REV`` (extracted to a temporary folder);
      ``fresh``   this code with no saved calibration (``HPCNN_CALIBRATION=off``);
      ``saved``   this code with the calibration file a ``fresh`` run of the same layout wrote;
      ``mpi``     this code with ``--allreduce=mpi`` (nothing to calibrate: the floor).
    Variants alternate round by round; each figure is the median of ``--repeats`` launches.
(b) demo (``--demo``): the commands of the Makefile's ``demo`` recipe, run as written (logs in a
    temporary folder), timed end to end with the ``before`` code, this code without a saved file,
    and this code again (files saved by the previous pass), ``--repeats`` rounds; and the share
    of the calibration in it: (a)'s figures for the demo's two layouts (the MLP on 4 ranks,
    ``gpt-demo``) over the demo's median.

    OMP_NUM_THREADS=1 python benchmarks/startup.py [--before=REV] [--ranks=2,3,4] [--repeats=3] \\
        [--models=mlp,mlp-no-overlap,gpt-demo] [--demo]

Prints the load average before and after. Results: runs/bench/startup.h5 (tables ``startup``,
``demo``).
"""
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join("runs", "bench", "startup.h5")
MODELS = {"mlp": ["--model=mlp"], "mlp-no-overlap": ["--model=mlp", "--overlap=false"],
          # the GPT of `make demo`: 2 data-parallel x 2 pipeline ranks (4 ranks only)
          "gpt-demo": ["--model=gpt", "--dp=2", "--pp=2", "--schedule=1f1b", "--microbatches=4",
                       "--batch_size=32", "--n_layers=4", "--dim=64"]}


def worker(args) -> None:
    """Under mpiexec: build a run's parallel side as ``hpcnn train args`` would; print (rank 0,
    JSON) the slowest rank's seconds from the Communicator's creation to the end of ``attach``,
    of which in the calibration, and where ``auto``'s table came from."""
    import numpy
    from mpi4py import MPI

    from hpcnn.config import parse_overrides
    world = MPI.COMM_WORLD
    dp = [] if any(a.startswith("--dp=") for a in args) else [f"--dp={world.Get_size()}"]
    cfg = parse_overrides(args + dp).resolved()
    spent = [0.0]

    def timed(module, name):
        """``module.name(comm, ...)`` waits for every rank of ``comm`` first (the time is then
        its own, not a slower rank's catching up) and adds its seconds to ``spent``."""
        fn = getattr(module, name)

        def wrapper(comm, *a, **kw):
            comm.comm.Barrier()
            t = time.perf_counter()
            try:
                return fn(comm, *a, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        setattr(module, name, wrapper)
    try:
        from hpcnn.parallel.collectives import autotune as calibration      # this code: the whole of for_run
        timed(calibration, "for_run")
    except ImportError:                             # older code, before parallel/collectives/
        try:
            from hpcnn.parallel import calibration
            timed(calibration, "for_run")
        except ImportError:                         # older still: its calibrate call
            from hpcnn.parallel import allreduce
            timed(allreduce, "calibrate")
    try:                                            # this code: the run context
        from hpcnn.engine.context import ParallelContext
        from hpcnn.task import build_task
    except ImportError:                             # older code: train.py's _Parallel
        ParallelContext = None
        from hpcnn.train import _build_for, _Parallel
    world.Barrier()
    t0 = time.perf_counter()
    if ParallelContext is not None:
        par = ParallelContext(cfg, world)
        task = par.build(build_task)
        t1 = time.perf_counter()
        par.attach(task)
    else:
        par = _Parallel(cfg, world)
        task = _build_for(cfg, par)
        t1 = time.perf_counter()
        par.attach(task.model, task.micro_shape())
    t2 = time.perf_counter()
    cal = getattr(par, "calibration", None)
    slowest = numpy.array([t2 - t0, t2 - t1, spent[0]])
    world.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    par.free()
    if world.Get_rank() == 0:
        print(json.dumps({"seconds": float(slowest[0]), "attach_s": float(slowest[1]),
                          "calibration_s": float(slowest[2]),
                          "source": (cal or {}).get("source", "")}))


def launch(code, n, args, env) -> dict:
    from hpcnn import scripts
    e = dict(os.environ, PYTHONPATH=code, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **env)
    cmd = scripts.mpi_command(n, [__file__, "--worker", *args])
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=1800)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def extract(rev, into) -> str:
    """The tree of git revision ``rev`` in folder ``into`` (for the ``before`` code)."""
    os.makedirs(into)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    lean = os.path.join(ROOT, "hpcnn", "parallel", "collectives")  # this code's C fast path
    # into the folder that holds _lean.c at ``rev`` (hpcnn/parallel before the collectives package)
    dest = next(d for d in (os.path.join(into, "hpcnn", "parallel", "collectives"),
                            os.path.join(into, "hpcnn", "parallel"))
                if os.path.exists(os.path.join(d, "_lean.c")))
    for f in os.listdir(lean):
        if f.startswith("_lean") and f.endswith(".so"):
            subprocess.run(["cp", os.path.join(lean, f), dest], check=True)
    return into


def startup(opts, before, tmp) -> list:
    variants = (["before"] if before else []) + ["fresh", "saved", "mpi"]
    rows = []
    for n in opts["ranks"]:
        for model in opts["models"]:
            margs = MODELS[model]
            if model == "gpt-demo" and n != 4:
                continue
            saved = os.path.join(tmp, f"calibration-{n}-{model}.json")
            launch(ROOT, n, margs, {"HPCNN_CALIBRATION": saved})     # writes the saved file
            runs = {v: [] for v in variants}
            for _ in range(opts["repeats"]):
                for v in variants:
                    code = before if v == "before" else ROOT
                    env = {"HPCNN_CALIBRATION": saved if v == "saved" else "off"}
                    args = margs + (["--allreduce=mpi"] if v == "mpi" else [])
                    runs[v].append(launch(code, n, args, env))
            for v in variants:
                med = {f: statistics.median(r[f] for r in runs[v])
                       for f in ("seconds", "attach_s", "calibration_s")}
                rows.append({"ranks": n, "model": model, "variant": v, "startup_s": med["seconds"],
                             "attach_s": med["attach_s"], "calibration_s": med["calibration_s"],
                             "source": runs[v][-1]["source"] or "-"})
                print(f"{n} ranks {model:<15} {v:<7} start-up {med['seconds']:7.3f} s, attach "
                      f"{med['attach_s']:7.3f} s, calibration {med['calibration_s']:7.3f} s "
                      f"(auto's table: {rows[-1]['source']})", flush=True)
    return rows


def demo_commands(logs) -> list:
    """The Makefile's ``demo`` recipe, one command a line, with this Python's bin folder for
    ``$(BIN)`` and ``logs`` for ``runs``."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read().replace("\\\n", " ")
    lines = text.split("\ndemo:")[1].split("\n")[1:]
    recipe = [x.strip() for x in lines[:next(i for i, x in enumerate(lines)
                                            if not x.startswith("\t"))]]
    bindir = os.path.dirname(sys.executable)
    return [shlex.split(c.replace("$(BIN)", bindir).replace("runs/", logs + "/")) for c in recipe]


def demo(before, tmp, repeats, startup_rows) -> list:
    """Time the demo with each code, the variants alternating, ``repeats`` rounds; this code's
    calibration files go to the default place under a temporary XDG_CACHE_HOME: a new, empty
    one for each ``fresh`` pass, which the next ``saved`` pass reuses. The commands run in the
    logs' folder: ``python -m hpcnn`` would import the package in the current folder first,
    whatever PYTHONPATH says. The seconds the demo's
    runs spend calibrating are the (a) figures of its layouts, if measured: the MLP on 4 ranks
    and ``gpt-demo``."""
    env = {k: v for k, v in os.environ.items() if k != "HPCNN_CALIBRATION"}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    variants = (["before"] if before else []) + ["fresh", "saved"]
    totals = {v: [] for v in variants}
    for k in range(repeats):
        for v in variants:
            logs = os.path.join(tmp, f"demo-{k}-{v}")
            os.makedirs(logs)
            cache = os.path.join(tmp, f"cache-{k}")        # fresh: new; saved: as fresh left it
            t0 = time.perf_counter()
            for cmd in demo_commands(logs):
                subprocess.run(cmd, env=dict(env, PYTHONPATH=before if v == "before" else ROOT,
                                             XDG_CACHE_HOME=cache),
                               cwd=logs, check=True, capture_output=True, timeout=3600)
            totals[v].append(time.perf_counter() - t0)
            print(f"make demo ({v}): {totals[v][-1]:6.1f} s", flush=True)
    rows = []
    for v in variants:
        cal = {(r["model"], r["ranks"]): r["calibration_s"] for r in startup_rows
               if r["variant"] == v}
        parts = [cal.get(("mlp", 4)), cal.get(("gpt-demo", 4))]
        spent = sum(parts) if None not in parts else float("nan")
        total = statistics.median(totals[v])
        rows.append({"variant": v, "total_s": total, "min_s": min(totals[v]),
                     "calibration_s": spent, "fraction": spent / total})
        print(f"make demo ({v}): median {total:6.1f} s (min {min(totals[v]):.1f}), of which "
              f"calibration {spent:.2f} s ({100 * spent / total:.1f} %)", flush=True)
    return rows


def parser():
    import argparse
    from hpcnn import scripts
    ap = scripts.parser(__doc__)
    ap.add_argument("--before", default="", help="a git revision whose code is timed too")
    ap.add_argument("--ranks", type=scripts.ints, default=[2, 3, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", type=scripts.words, default=list(MODELS),
                    help=f"some of {','.join(MODELS)} (default all)")
    scripts.flag(ap, "demo", False, "time the Makefile's demo too")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:      # under mpiexec, with the timed code's hpcnn (PYTHONPATH),
        return worker(argv[1:])       # which may predate hpcnn.scripts: no parser here
    ap = parser()
    opts = vars(ap.parse_args(argv))
    if not set(opts["models"]) <= set(MODELS):
        ap.error(f"--models={','.join(opts['models'])}: expected some of {','.join(MODELS)}")
    from hpcnn.log.results import save_table
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        before = extract(opts["before"], os.path.join(tmp, "before")) if opts["before"] else ""
        rows = startup(opts, before, tmp)
        save_table(OUT, "startup", rows, {"before": opts["before"]})
        if opts["demo"]:
            save_table(OUT, "demo", demo(before, tmp, opts["repeats"], rows),
                       {"before": opts["before"]})
    print(f"load average {os.getloadavg()[0]:.2f} (1 min); results: {OUT}")


if __name__ == "__main__":
    main()
