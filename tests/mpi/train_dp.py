"""The training loop under data parallelism equals the serial loop (float64), every option path.

    mpiexec -n N python -m mpi4py tests/mpi/train_dp.py TMPDIR
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import ConfigError, parse_overrides
from hpcnn.log import read_run
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp = sys.argv[1]


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", "--progress=false", "--dtype=float64",
                            "--steps=6", "--eval_interval=3", "--log_interval=2", *extra])


def params(r):
    return [q.data.copy() for q in r["model"].params]


cases = {
    "mlp-weighted-speeds": ["--model=mlp", "--hidden=16,16", "--batch_size=24", "--optimizer=sgd",
                            "--lr=0.05", "--balance=proportional", f"--speeds={','.join(str(i + 1) for i in range(p))}",
                            "--allreduce=ring", "--bucket_mb=0.001"],
    "mlp-accum-skewed": ["--model=mlp", "--hidden=16,16", "--batch_size=24", "--grad_accum=2",
                         "--shard=skewed", "--allreduce=mpi", "--overlap=false"],
    "gpt-weighted": ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=12",
                     "--batch_size=8", "--balance=proportional", "--speeds=" + ",".join(["1"] * (p - 1) + ["3"])],
    # dropout: a sample's mask depends on its global row and the step, not on the split
    "gpt-dropout-accum": ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=12",
                          "--batch_size=12", "--dropout=0.2", "--grad_accum=2", "--balance=proportional",
                          "--speeds=" + ",".join(str(i + 1) for i in range(p))],
}
def one_replica(args):
    """The arguments of the serial reference run: fixed speeds describe dp > 1 replicas."""
    return [a for a in args if not a.startswith("--speeds=")]


for name, args in cases.items():
    serial = train(cfg(f"{name}-serial.h5", *one_replica(args)), comm=None) if rank == 0 else None
    par = train(cfg(f"{name}-dp.h5", *args, f"--dp={p}"), comm=world)
    if rank == 0:
        for a, b in zip(params(serial), params(par)):
            assert np.max(np.abs(a - b)) < 1e-10, (name, np.max(np.abs(a - b)))
        run = read_run(os.path.join(tmp, f"{name}-dp.h5"))
        assert run.attrs["world_size"] == p and run.attrs["status"] == "finished"
        assert sorted(set(run.ranks["rank"].tolist())) == list(range(p)), run.ranks["rank"]
        assert len(run.ranks["rank"]) == 6 * p                    # one row per rank per step
        assert (run.ranks["bytes_sent"] > 0).all()
        s_loss = read_run(os.path.join(tmp, f"{name}-serial.h5")).metrics["loss"]
        assert np.max(np.abs(s_loss - run.metrics["loss"])) < 1e-10
    # every rank holds the same parameters
    mine = np.concatenate([x.ravel() for x in params(par)])
    both = np.empty((p, mine.size))
    world.Allgather(mine, both)
    assert (both == both[0]).all(), name

# uniform combination with unequal shares differs from the full-batch run
args = cases["mlp-weighted-speeds"]
uni = train(cfg("uniform.h5", *args, f"--dp={p}", "--combine=uniform"), comm=world)
if rank == 0:
    serial = train(cfg("uni-serial.h5", *one_replica(args)), comm=None)
    diff = max(np.max(np.abs(a - b)) for a, b in zip(params(serial), params(uni)))
    assert diff > 1e-6, diff

# a layout that does not fit the world: the same clear error on every rank, no hang
try:
    train(cfg("bad.h5", "--model=mlp", f"--dp={p + 1}"), comm=world)
    raise AssertionError("accepted dp larger than the world")
except ConfigError as e:
    assert f"world size ({p}) != dp*tp*pp ({p + 1}*1*1" in str(e), e

world.Barrier()
if rank == 0:
    print(f"train_dp OK on {p} ranks")
