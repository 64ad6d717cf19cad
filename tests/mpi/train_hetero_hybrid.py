"""Speed-proportional batch shares inside hybrid layouts (dp x pp, dp x tp) on 4 ranks.

    mpiexec -n 4 python -m mpi4py tests/mpi/train_hetero_hybrid.py TMPDIR

Fixed unequal speeds with the weighted combination equal the serial run (float64, GPT with
dropout); measured speeds with one emulated slow rank give the same shares on every rank of the
job (the replica is as fast as its slowest member) and fewer rows to the slow replica.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.parallel.tensor.linear import shard_array
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
assert p == 4
tmp = sys.argv[1]
GPT = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=12", "--n_layers=4", "--pad_vocab=2", "--dropout=0.1", "--dtype=float64",
       "--eval_interval=3", "--allreduce=mpi", "--progress=false"]


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", *GPT, *extra])


serial = train(cfg(f"serial-r{rank}.h5", "--steps=3"), comm=None)
ref = {q.name: q.data for q in serial["model"].params}
layouts = {"dp-pp": ["--dp=2", "--pp=2", "--microbatches=2"], "dp-tp": ["--dp=2", "--tp=2"]}
for name, layout in layouts.items():
    tp = 2 if "--tp=2" in layout else 1
    run = train(cfg(f"{name}-fixed.h5", "--steps=3", *layout, "--balance=proportional",
                    "--speeds=1,3"), comm=world)
    local = set(run["local_params"])
    for q in run["model"].params:
        if q.name in local:
            axis = getattr(q, "tp_axis", None)
            want = ref[q.name] if axis is None else shard_array(ref[q.name], axis, rank % tp, tp,
                                                               q.tp_parts)
            err = float(np.max(np.abs(want - q.data)))
            assert err < 1e-10, (name, q.name, err)
    # measured online, replica 1 three times slower (each member pads its own compute)
    run = train(cfg(f"{name}-measured.h5", "--steps=6", *layout, "--balance=proportional",
                    "--rebalance_every=2", "--slowdown=1:3"), comm=world)
    if rank == 0:
        hist = read_run(os.path.join(tmp, f"{name}-measured.h5")).plan["shares_history"]
        assert [h[0] for h in hist] == [0, 2, 4, 6], hist
        final = hist[-1][1]
        assert sum(final) == 12 and final[1] < final[0], (name, hist)
    every = world.allgather(run["shares"])             # each rank's own balancer's choice
    assert all(s == every[0] for s in every), (name, every)
    world.Barrier()
if rank == 0:
    print(f"train_hetero_hybrid OK on {p} ranks")
