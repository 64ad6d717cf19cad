"""What the per-step stop agreement (:mod:`hpcnn.signals`) costs a training step.

Runs a tiny GPT (``--dp`` = every rank) in-process, alternately with the agreement (a 4-byte
allreduce at each step boundary) and without it (:meth:`StopSignals.poll` replaced by a no-op),
``--repeats`` times each, and prints the median loop seconds per step of each variant, their
difference, and the median time spent inside ``poll`` itself. Tiny steps are the worst case:
the agreement's cost is fixed, a larger step hides it further. ``--slowdown=F`` makes every
rank's steps F times longer (``hpcnn train --slowdown``, sleeping): with steps over 0.1 s the
agreement is completed at each boundary, one rendezvous a step, instead of overlapped.

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/stop_agreement.py [--steps=200]
        [--repeats=5] [--slowdown=1]
"""
import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

from hpcnn import scripts
from hpcnn.config import parse_overrides
from hpcnn.signals import StopSignals
from hpcnn.train import train

agreeing, in_poll = StopSignals.poll, []


def timed_poll(self):
    t0 = time.perf_counter()
    out = agreeing(self)
    in_poll.append(time.perf_counter() - t0)
    return out


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slowdown", type=float, default=1.0)
    return ap


def per_step_seconds(world, steps: int, repeats: int, slowdown: float = 1.0) -> dict:
    """variant -> the slowest rank's loop seconds per step, one per repeat, the variants
    alternating."""
    tmp = tempfile.mkdtemp() if world.rank == 0 else None
    tmp = world.bcast(tmp, root=0)
    per_step = {"agreement": [], "none": []}
    for rep in range(repeats):
        for variant in ("agreement", "none") if rep % 2 == 0 else ("none", "agreement"):
            StopSignals.poll = timed_poll if variant == "agreement" else (lambda self: 0)
            cfg = parse_overrides(["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2",
                                   "--block_size=8", "--batch_size=8", "--eval_interval=0",
                                   f"--steps={steps}", f"--dp={world.size}", "--progress=false",
                                   f"--log={os.path.join(tmp, f'{variant}-{rep}.h5')}",
                                   "--slowdown=" + ",".join(f"{r}:{slowdown:g}"
                                                            for r in range(world.size))])
            world.Barrier()
            wall = train(cfg, comm=world)["wall_s"]
            per_step[variant].append(world.allreduce(wall, op=MPI.MAX) / steps)
    StopSignals.poll = agreeing
    return per_step


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    world, steps, repeats, slowdown = MPI.COMM_WORLD, a.steps, a.repeats, a.slowdown
    per_step = per_step_seconds(world, steps, repeats, slowdown)
    polls = world.gather(in_poll, root=0)
    if world.rank == 0:
        a, n = (float(np.median(per_step[v])) for v in ("agreement", "none"))
        print(f"{world.size} ranks, slowdown {slowdown:g}, {steps} steps x {repeats} repeats "
              f"per variant (medians): "
              f"with agreement {a * 1e3:.3f} ms/step, without {n * 1e3:.3f} ms/step, "
              f"difference {(a - n) * 1e6:+.0f} us/step ({(a / n - 1) * 100:+.1f} %); inside "
              f"poll: median {np.median(np.concatenate(polls)) * 1e6:.0f} us (every rank's calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
