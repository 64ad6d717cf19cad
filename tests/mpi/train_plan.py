"""hpcnn train --plan: the MLP laid out per layer over the --tp ranks equals the serial run.

    mpiexec -n N python -m mpi4py tests/mpi/train_plan.py TMPDIR

N a power of two: --plan=auto (the planner's search) and a plan file; any N: plan files only
(mixed per-layer cuts, including replication). Float64: losses, test metrics and the final
parameters (gathered) within 1e-10 of the serial run's.
"""
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.parallel.collectives import Communicator
from hpcnn.parallel.layout import gather_full
from hpcnn.plan import machine
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp = sys.argv[1]
base = ["--model=mlp", "--hidden=24,16", "--dtype=float64", "--steps=6", "--batch_size=12",
        "--eval_interval=3", "--log_interval=3", "--progress=false", "--allreduce=mpi"]


def run(name, *extra, comm=None):
    return train(parse_overrides([f"--log={os.path.join(tmp, name)}", *base, *extra]), comm=comm)


serial = run(f"serial-r{rank}.h5")
ref = {q.name: q.data for q in serial["model"].params}
plans = {"mixed": [[p, 1, 1], [1, 1, p], [1, p, 1]]}                  # data, column, row
if p % 2 == 0:
    plans["halves"] = [[2, 1, p // 2], [1, p // 2, 2], [p // 2, 1, 1]]   # replicated where short
cases = [(name, [f"--plan={os.path.join(tmp, name + '.json')}"]) for name in plans]
if p & (p - 1) == 0:
    cases.append(("auto", ["--plan=auto"]))
if rank == 0:
    for name, layers in plans.items():
        with open(os.path.join(tmp, name + ".json"), "w") as f:
            json.dump({"devices": p, "layers": [dict(zip(("batch", "reduce", "out"), c))
                                                 for c in layers]}, f)
world.Barrier()
for name, extra in cases:
    out = run(f"{name}.h5", f"--tp={p}", *extra, comm=world)
    full = gather_full(out["model"].params, Communicator(world))
    for k, v in full.items():
        err = np.max(np.abs(ref[k] - v))
        assert err < 1e-10, (name, k, err)
    if rank == 0:
        a, b = read_run(os.path.join(tmp, f"{name}.h5")), read_run(os.path.join(tmp, "serial-r0.h5"))
        for key in ("loss", "test_loss", "test_acc"):
            np.testing.assert_allclose(a.metrics[key], b.metrics[key], rtol=0, atol=1e-10)
        laid = a.plan["operator_layout"]
        cuts = laid["cuts"]
        assert len(cuts) == 3 and all(x * y * z <= p and p % (x * y * z) == 0 for x, y, z in cuts)
        if name in plans:
            assert cuts == plans[name] and laid["chosen_by"].startswith("plan file"), laid
        else:                     # auto: the machine file's least price where it holds p devices
            fits = p <= machine.this_machine().p
            assert laid["chosen_by"].startswith("least BSP price" if fits else "double"), laid
            assert np.isfinite(laid["predicted_step_s"]) == fits, laid
        assert a.attrs["model_params"] == b.attrs["model_params"]        # the whole model's
    world.Barrier()
if rank == 0:
    print(f"train_plan OK on {p} ranks ({', '.join(n for n, _ in cases)})")
