"""ZeRO stages 1, 2 and 3 against zero 0: step time and each rank's held bytes, side by side.

Trains, in-process on every rank (``--dp`` = the world), the 64 MiB MLP (five hidden layers of
2048, float32, batch 256, on digits) and a GPT (4 blocks, width 128, context 64, batch 32, on
sonnet), at ``--zero=0``, ``1``, ``2`` and ``3`` in turn (the order rotated every round), overlap
on. Per model and stage: the median over rounds of the run's median step time (its first step
left out), and from the run log's account the parameter, optimizer and gradient bytes per rank,
(stages 2, 3) the peak of the buckets' storage and (stage 3) of the gathered blocks; then the
ratios to zero 0. ``--grad_accum=N`` runs each step as N micro-batches (stages 2 and 3
reduce-scatter each in its own backward). Rows go to ``runs/bench/zero.h5`` (table ``zero``)
with the load.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/zero.py [--rounds=3] [--steps=6]
        [--grad_accum=1]
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
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--out", default="runs/bench/zero.h5")
    return ap


STAGES = (0, 1, 2, 3)


def one_run(world, tmp, model, zero, steps, k, accum=1) -> tuple:
    """(the median step seconds, rank 0's parameter, optimizer and gradient bytes, buckets'
    peak, gathered blocks' peak), on
    rank 0 (a step's time is the same on every rank: each waits for the others in the gradient
    reduction)."""
    log = os.path.join(tmp, f"{model}-{zero}-{k}.h5")
    cfg = parse_overrides([*MODELS[model], f"--dp={world.size}", f"--zero={zero}",
                           f"--steps={steps}", f"--grad_accum={accum}",
                           "--eval_interval=0", "--progress=false",
                           f"--log={log}", "--log_interval=1000000"])
    world.Barrier()
    train(cfg, comm=world)
    if world.rank:
        return 0.0, 0, 0, 0, 0, 0
    run = read_run(log)
    plan = run.plan
    return (float(np.median(run.metrics["step_time"][1:])),
            *(int(plan[key][0]) for key in ("param_bytes_per_rank", "optimizer_bytes_per_rank",
                                            "grad_bytes_per_rank",
                                            "grad_buffer_peak_bytes_per_rank",
                                            "param_gather_peak_bytes_per_rank")))


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    world = MPI.COMM_WORLD
    tmp = world.bcast(tempfile.mkdtemp() if world.rank == 0 else None, root=0)
    seen = {(m, z): [] for m in MODELS for z in STAGES}
    held = {}
    for k in range(a.rounds):
        for model in MODELS:
            for zero in STAGES[k % 4:] + STAGES[:k % 4]:
                s, *b = one_run(world, tmp, model, zero, a.steps, k, a.grad_accum)
                seen[model, zero].append(s)
                held[model, zero] = b
    if world.rank:
        return 0
    load = os.getloadavg()[0]
    rows = []
    for model in MODELS:
        t0 = float(np.median(seen[model, 0]))
        for zero in STAGES:
            t = float(np.median(seen[model, zero]))
            pb, o, g, buf, gat = held[model, zero]
            rows.append({"model": model, "ranks": world.size, "grad_accum": a.grad_accum,
                         "zero": zero, "step_s": t,
                         "step_ratio": t / t0, "param_bytes": pb, "optimizer_bytes": o,
                         "grad_bytes": g, "bucket_peak_bytes": buf, "gather_peak_bytes": gat})
            accum = f", {a.grad_accum} micro-batches" if a.grad_accum > 1 else ""
            print(f"{model}, {world.size} ranks{accum}, zero {zero}, {a.rounds} rounds x "
                  f"{a.steps} steps "
                  f"(load {load:.1f}): step {t * 1e3:.1f} ms ({t / t0:.3f} of zero 0); per rank "
                  f"parameters {pb / 2**20:.1f} MiB, optimizer {o / 2**20:.1f} MiB, gradients "
                  f"{g / 2**20:.1f} MiB"
                  + (f", buckets' peak {buf / 2**20:.1f} MiB" if zero >= 2 else "")
                  + (f", gathered blocks' peak {gat / 2**20:.1f} MiB" if zero == 3 else ""),
                  flush=True)
    scripts.write_tables(a.out, {"zero": rows}, {"load": load, "command": scripts.command_line()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
