"""The training loop with tensor parallelism (and dp x tp) equals the serial loop (float64).

    mpiexec -n N python -m mpi4py tests/mpi/train_tp.py TMPDIR TP
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.parallel.tensor.linear import shard_array
from hpcnn.engine.record import whole_model_params
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp, tp = sys.argv[1], int(sys.argv[2])
dp = p // tp
tp_rank = rank % tp


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", "--progress=false", "--dtype=float64",
                            "--steps=4", "--eval_interval=2", "--log_interval=2", *extra])


gpt = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=4", "--block_size=12",
       "--batch_size=8", "--n_layers=2", f"--pad_vocab={tp}", "--clip=0.5", "--optimizer=adamw",
       "--dropout=0.1"]


def same_shards(name, serial, par):
    """This rank's parameter shards equal the serial run's parameters (1e-10)."""
    ref = {q.name: q.data for q in serial["model"].params}
    for q in par["model"].params:
        axis = getattr(q, "tp_axis", None)
        want = ref[q.name] if axis is None else shard_array(ref[q.name], axis, tp_rank, tp, q.tp_parts)
        err = np.max(np.abs(want - q.data))
        assert err < 1e-10, (name, q.name, err)


cases = {"gpt": gpt, "gpt-sp": gpt + ["--sequence_parallel=true"],
         "cnn": ["--model=cnn", "--channels=4,8", "--batch_size=16", "--optimizer=sgd", "--lr=0.05"]}
for name, args in cases.items():
    # every rank runs the serial reference itself (cheap), so each can check its own shards
    serial = train(cfg(f"{name}-serial-r{rank}.h5", *args), comm=None)
    par = train(cfg(f"{name}-tp.h5", *args, f"--dp={dp}", f"--tp={tp}"), comm=world)
    same_shards(name, serial, par)
    if rank == 0:
        run = read_run(os.path.join(tmp, f"{name}-tp.h5"))
        assert run.plan["tp"] == tp and run.plan["dp"] == dp
        # the log and the header count the whole model, not this rank's shard
        assert run.attrs["model_params"] == whole_model_params(serial["model"]) \
            == serial["model"].num_params() > par["model"].num_params(), run.attrs["model_params"]
        s = read_run(os.path.join(tmp, f"{name}-serial-r0.h5")).metrics
        assert np.max(np.abs(s["loss"] - run.metrics["loss"])) < 1e-10
        key = "val_loss" if name.startswith("gpt") else "test_loss"
        np.testing.assert_allclose(s[key], run.metrics[key], rtol=0, atol=1e-10)
    world.Barrier()

# rematerialization under tp (and sp): peers solve with the same rates, so they run the same
# sequence (a recomputed forward repeats its collectives); the result is still the serial one
for name, extra in (("gpt-remat-sqrt", ["--remat=sqrt"]),
                    ("gpt-sp-remat", ["--sequence_parallel=true", "--remat=optimal"])):
    args = gpt + extra
    serial = train(cfg(f"{name}-serial-r{rank}.h5", *gpt), comm=None)
    if "--remat=optimal" in extra:                    # 60 % of store-all: recomputation needed
        probe = train(cfg(f"{name}-probe.h5", *args, "--memory_budget=1000", f"--dp={dp}",
                          f"--tp={tp}"), comm=world)
        full = world.allreduce(min(r["store_all_bytes"] for r in probe["remat_plans"]), op=MPI.MIN)
        args = args + [f"--memory_budget={0.6 * full / 2 ** 20}"]
    par = train(cfg(f"{name}-tp.h5", *args, f"--dp={dp}", f"--tp={tp}"), comm=world)
    same_shards(name, serial, par)
    seqs = world.allgather([r["sequence"] for r in par["remat_plans"]])
    for k in range(p):                                # the same sequences in each tp group
        assert seqs[k] == seqs[k - k % tp], (name, k, seqs)
    assert sum(r["recomputed_forwards"] for r in par["remat_plans"]) > 0, par["remat_plans"]
    assert par["remat_measured_peak"] > 0
    if "--remat=optimal" in extra:                    # the executor's account within the budget
        assert par["remat_measured_peak"] <= 0.6 * full + 1, (par["remat_measured_peak"], full)
    world.Barrier()

# heads that tp does not divide: the same clear error on every rank, no hang
if tp > 1:
    try:
        train(cfg("bad.h5", *gpt, "--dim=24", "--n_heads=3", f"--dp={dp}", f"--tp={tp}"), comm=world)
        raise AssertionError("3 heads accepted for tp=%d" % tp)
    except ValueError as e:
        assert f"attention heads (3) is not divisible by tp ({tp})" in str(e), e
if rank == 0:
    print(f"train_tp OK on {p} ranks (dp={dp}, tp={tp})")
