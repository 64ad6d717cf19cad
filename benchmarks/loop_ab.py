"""Two checkouts of hpcnn, side by side: the training loop's step time and the pipeline experiment.

Timing two commits one after the other mixes their difference with whatever the machine did in
between. Here every round runs each case once per checkout, in alternating order (old first in
even rounds, new first in odd ones), each in a fresh process with ``PYTHONPATH`` set to its
checkout; a case's figure is the median over rounds of the per-round ratio new/old of

- ``hpcnn train`` cases: the median ``step_time`` of the run log's steps after the first 20 %
  (serial MLP, serial GPT with ``--remat=sqrt``, 2 data-parallel ranks, 2 x 2 data x pipeline
  ranks with remat): the whole loop, shard to optimizer, through each checkout's own engine;
- ``pipeline``: ``experiments/pipeline_bubble.py`` on 2 ranks (1f1b and zb_h1, M = 4 and 8): the
  median over its configurations of the median timed step;
- ``data_parallel``: ``benchmarks/data_parallel.py --repeats=3`` on 2 ranks: the median step time
  of its overlap table (compute only, overlap off and on, mpi, ring and auto).

    git archive <old-commit> | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    OMP_NUM_THREADS=1 python benchmarks/loop_ab.py /tmp/old . [--rounds=5] [--cases=mlp,dp2]

Each checkout uses its own C fast path if it has been built there (``make`` or its lean_build).
Prints one line per case and saves the table ``loop_ab`` in runs/bench/loop_ab.h5 (old and new
medians in seconds, the ratio, its spread over rounds, the load average before and after).
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from hpcnn import scripts  # noqa: E402

TRAIN = ["-m", "hpcnn", "train", "--progress=false", "--allreduce=mpi"]
CASES = {
    "mlp": (1, TRAIN + ["--model=mlp", "--steps=150"]),
    "gpt_remat": (1, TRAIN + ["--model=gpt", "--n_layers=2", "--dim=64", "--steps=40",
                              "--batch_size=16", "--remat=sqrt", "--eval_interval=0"]),
    "dp2": (2, TRAIN + ["--model=mlp", "--dp=2", "--steps=150"]),
    "dp2_pp2_remat": (4, TRAIN + ["--model=gpt", "--dp=2", "--pp=2", "--microbatches=4",
                                  "--n_layers=4", "--dim=64", "--steps=30", "--batch_size=32",
                                  "--remat=sqrt", "--eval_interval=0"]),
    "pipeline": (2, ["experiments/pipeline_bubble.py", "--schedules=1f1b,zb_h1",
                     "--micro-batches=4,8", "--steps=5", "--warmup=2"]),
    "data_parallel": (2, ["benchmarks/data_parallel.py", "--repeats=3"]),
}
SCRIPTS = ("pipeline", "data_parallel")      # a checkout's own script, run in the scratch folder


def _median_step(case: str, out: str) -> float:
    """The case's figure from what the run wrote in ``out``."""
    if case == "data_parallel":              # the overlap table's step times, every variant
        with h5py.File(os.path.join(out, "runs", "bench", "data_parallel.h5"), "r") as f:
            return float(np.median(f["overlap/step_s"][...]))
    if case == "pipeline":
        times = []
        for name in os.listdir(out):
            if name.endswith(".h5") and name != "results.h5":
                with h5py.File(os.path.join(out, name), "r") as f:
                    times.append(float(np.median(f["metrics/step_time"][...])))
        return float(np.median(times))
    with h5py.File(os.path.join(out, "run.h5"), "r") as f:
        t = f["metrics/step_time"][...]
    return float(np.median(t[len(t) // 5:]))


def run_once(root: str, case: str) -> float:
    """One run of ``case`` with the checkout at ``root``; returns its figure (seconds)."""
    ranks, args = CASES[case]
    with tempfile.TemporaryDirectory() as out:
        dest = {"pipeline": ["--out=" + out], "data_parallel": []}.get(
            case, ["--log=" + os.path.join(out, "run.h5")])
        if case in SCRIPTS:                  # the script of that checkout, writing under ``out``
            args = [os.path.join(os.path.abspath(root), args[0])] + args[1:]
        cmd = scripts.mpi_command(ranks, args + dest) if ranks > 1 else \
            [sys.executable] + args + dest
        env = dict(os.environ, PYTHONPATH=os.path.abspath(root), HPCNN_CALIBRATION=out)
        subprocess.run(cmd, cwd=out if case in SCRIPTS else os.path.abspath(root), env=env,
                       check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900)
        return _median_step(case, out)


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("old", help="the old checkout's folder")
    ap.add_argument("new", help="the new checkout's folder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", type=scripts.words, default=list(CASES),
                    help=f"some of {','.join(CASES)} (default all)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    old, new, cases = a.old, a.new, a.cases
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; expected some of {list(CASES)}")
    load0 = os.getloadavg()[0]
    rows = []
    for case in cases:
        times = {"old": [], "new": []}
        for r in range(a.rounds):
            order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
            for label, root in order:
                times[label].append(run_once(root, case))
        ratios = [n / o for n, o in zip(times["new"], times["old"])]
        row = {"case": case, "old_s": statistics.median(times["old"]),
               "new_s": statistics.median(times["new"]), "ratio": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": len(ratios)}
        rows.append(row)
        print(f"{case:>14}: old {row['old_s'] * 1e3:8.3f} ms  new {row['new_s'] * 1e3:8.3f} ms  "
              f"new/old {row['ratio']:.3f} (rounds {row['ratio_min']:.3f}-{row['ratio_max']:.3f})",
              flush=True)
    load1 = os.getloadavg()[0]
    print(f"load average {load0:.1f} before, {load1:.1f} after ({os.cpu_count()} cores)")
    scripts.write_tables(os.path.join("runs", "bench", "loop_ab.h5"), {"loop_ab": rows},
                         {"old": os.path.abspath(old), "new": os.path.abspath(new),
                          "load_before": load0, "load_after": load1, "cores": os.cpu_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
