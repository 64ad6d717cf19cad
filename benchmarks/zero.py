"""ZeRO stage 1 against zero 0: step time and each rank's optimizer bytes, side by side.

Trains, in-process on every rank (``--dp`` = the world), the 64 MiB MLP (five hidden layers of
2048, float32, batch 256, on digits) and a GPT (4 blocks, width 128, context 64, batch 32, on
sonnet), at ``--zero=0`` and ``--zero=1`` alternately (the order swapped every round), overlap
on. Per model and stage: the median over rounds of the run's median step time (its first step
left out), and the optimizer bytes per rank from the run log's account; then the
ratios zero 1 / zero 0. Rows go to ``runs/bench/zero.h5`` (table ``zero``) with the load.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/zero.py [--rounds=3] [--steps=6]
"""
import os
import sys
import tempfile

import numpy as np
from mpi4py import MPI

from hpcnn import scripts
from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.train import train

MODELS = {"mlp-64MiB": ["--model=mlp", "--hidden=2048,2048,2048,2048,2048", "--batch_size=256"],
          "gpt": ["--model=gpt", "--dataset=sonnet", "--n_layers=4", "--dim=128", "--n_heads=4",
                  "--block_size=64", "--batch_size=32"]}


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="runs/bench/zero.h5")
    return ap


def one_run(world, tmp, model, zero, steps, k) -> tuple:
    """(the median step seconds, the optimizer bytes of every rank), on rank 0 (a step's time
    is the same on every rank: each waits for the others in the gradient reduction)."""
    log = os.path.join(tmp, f"{model}-{zero}-{k}.h5")
    cfg = parse_overrides([*MODELS[model], f"--dp={world.size}", f"--zero={zero}",
                           f"--steps={steps}", "--eval_interval=0", "--progress=false",
                           f"--log={log}", "--log_interval=1000000"])
    world.Barrier()
    train(cfg, comm=world)
    if world.rank:
        return 0.0, []
    run = read_run(log)
    per_step = float(np.median(run.metrics["step_time"][1:]))
    return per_step, [int(b) for b in run.plan["optimizer_bytes_per_rank"]]


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    world = MPI.COMM_WORLD
    tmp = world.bcast(tempfile.mkdtemp() if world.rank == 0 else None, root=0)
    seen = {(m, z): [] for m in MODELS for z in (0, 1)}
    held = {}
    for k in range(a.rounds):
        for model in MODELS:
            for zero in ((0, 1) if k % 2 == 0 else (1, 0)):
                s, b = one_run(world, tmp, model, zero, a.steps, k)
                seen[model, zero].append(s)
                held[model, zero] = b
    if world.rank:
        return 0
    load = os.getloadavg()[0]
    rows = []
    for model in MODELS:
        t0, t1 = (float(np.median(seen[model, z])) for z in (0, 1))
        b0, b1 = max(held[model, 0]), max(held[model, 1])
        rows.append({"model": model, "ranks": world.size, "zero0_step_s": t0,
                     "zero1_step_s": t1, "step_ratio": t1 / t0, "zero0_optimizer_bytes": b0,
                     "zero1_optimizer_bytes": b1, "optimizer_ratio": b1 / b0})
        print(f"{model}, {world.size} ranks, {a.rounds} rounds x {a.steps} steps (load {load:.1f}):"
              f" step zero0 {t0 * 1e3:.1f} ms, zero1 {t1 * 1e3:.1f} ms, ratio {t1 / t0:.3f}; "
              f"optimizer bytes per rank zero0 {b0 / 2**20:.1f} MiB, zero1 {b1 / 2**20:.1f} MiB, "
              f"ratio {b1 / b0:.3f}", flush=True)
    scripts.write_tables(a.out, {"zero": rows}, {"load": load, "command": scripts.command_line()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
