"""Mixed precision under data parallelism: dp = P at bf16 and fp16 against the serial run at the
same precision (to the precision's tolerance), gradients reduced in fp32 and in the parameters'
16 bits; an fp16 run whose first steps overflow skips the same steps on every rank and as the
serial run, without the non-finite error; the replicas stay identical.

    mpiexec -n 2 python -m mpi4py tests/mpi/train_precision.py TMPDIR
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp = sys.argv[1]
GPT = ["--model=gpt", "--dataset=sonnet", "--n_layers=1", "--dim=32", "--n_heads=4",
       "--block_size=16", "--batch_size=8", "--eval_batches=2", "--steps=6", "--eval_interval=6",
       "--log_interval=2", "--progress=false", "--bucket_mb=0.01"]
# relative tolerance of the parameters (all of them as one vector) and the losses: the sums run
# in another order (in 16 bits with --grad_reduce_dtype=param), which may round a master copy's
# value to a neighbouring 16-bit number, and AdamW turns the rounding noise of a gradient that
# is zero in exact arithmetic (the key bias: the softmax ignores it) into steps of lr
TOL = {"bf16": 1e-2, "fp16": 2e-3}


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", *GPT, *extra])


def same_everywhere(model) -> bool:
    """Every rank holds bit-identical parameters."""
    mine = np.concatenate([q.data.astype(np.float64).ravel() for q in model.params])
    everyone = world.allgather(mine)
    return all(np.array_equal(everyone[0], other) for other in everyone)


cases = {"bf16": ["--precision=bf16"],
         "bf16-param": ["--precision=bf16", "--grad_reduce_dtype=param"],
         "fp16": ["--precision=fp16"],
         "fp16-param": ["--precision=fp16", "--grad_reduce_dtype=param"],
         "fp16-overflow": ["--precision=fp16", "--loss_scale_init=1099511627776",
                           "--loss_scale_growth_interval=2"]}
for name, args in cases.items():
    serial = train(cfg(f"{name}-serial.h5", *args), comm=None) if rank == 0 else None
    par = train(cfg(f"{name}-dp.h5", *args, f"--dp={p}"), comm=world)
    assert same_everywhere(par["model"]), name
    if rank == 0:
        tol = TOL[args[0].split("=")[1]]
        a, b = (np.concatenate([q.data.astype(np.float64).ravel() for q in r["model"].params])
                for r in (serial, par))
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(a), (name, np.linalg.norm(a - b))
        s = read_run(os.path.join(tmp, f"{name}-serial.h5")).metrics
        d = read_run(os.path.join(tmp, f"{name}-dp.h5")).metrics
        assert np.abs(s["loss"] - d["loss"]).max() < tol * s["loss"].max(), name
        assert abs(serial["val_loss"] - par["val_loss"]) < tol * serial["val_loss"], name
        if "loss_scale" in s:            # fp16: the same scales and skips (one agreed flag)
            assert np.array_equal(s["loss_scale"], d["loss_scale"]), name
            assert np.array_equal(s["skipped"], d["skipped"]), name
        if name == "fp16-overflow":
            assert d["skipped"][0] == 1 and par["skipped_steps"] >= 1, d["skipped"]

world.Barrier()
if rank == 0:
    print(f"train_precision OK on {p} ranks")
