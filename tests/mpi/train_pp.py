"""The training loop with pipeline parallelism (and dp x pp, tp x pp) equals the serial loop.

    mpiexec -n N python -m mpi4py tests/mpi/train_pp.py TMPDIR DP TP PP
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.nn.core import is_placeholder
from hpcnn.parallel.tensor.linear import shard_array
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp, dp, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tp_rank = rank % tp


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", "--progress=false", "--dtype=float64",
                            "--steps=3", "--eval_interval=3", "--log_interval=3", "--allreduce=mpi", *extra])


mlp = ["--model=mlp", "--hidden=16,16,16", "--batch_size=24", "--optimizer=sgd", "--lr=0.05",
       "--clip=1.0"]
gpt = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=8", "--n_layers=6", f"--pad_vocab={tp}", "--dropout=0.1"]
cases = []
for sched in ("gpipe", "1f1b", "zb_h1"):
    cases.append((f"mlp-{sched}", mlp + [f"--schedule={sched}", "--microbatches=4"]))
if 2 * pp <= 7:                                # ZB-V: 2 pp stages in a V (the MLP has 7 blocks)
    cases.append(("mlp-zb_v", mlp + ["--schedule=zb_v", "--virtual=2", "--microbatches=3"]))
cases.append(("mlp-uneven", mlp + ["--schedule=1f1b", "--microbatches=3",
                                   "--layout=" + "|".join(["1"] * (pp - 1) + [str(7 - (pp - 1))])]))
for sched in ("gpipe", "1f1b", "zb_h1"):
    cases.append((f"gpt-{sched}", gpt + [f"--schedule={sched}", "--microbatches=2"]))
cases.append(("gpt-interleaved", gpt + ["--schedule=interleaved", "--virtual=2", f"--microbatches={pp}"]))
cases.append(("gpt-zb_v", gpt + ["--schedule=zb_v", "--virtual=2", "--microbatches=2"]))
for name, args in cases:
    if tp > 1 and name.startswith("mlp"):
        continue
    serial = train(cfg(f"{name}-serial-r{rank}.h5", *args), comm=None)
    par = train(cfg(f"{name}-pp.h5", *args, f"--dp={dp}", f"--tp={tp}", f"--pp={pp}"), comm=world)
    ref = {q.name: q.data for q in serial["model"].params}
    local = set(par["local_params"])
    for q in par["model"].params:
        # another pipeline rank's stage: a placeholder, no storage (built so from the start)
        assert is_placeholder(q.data) == (q.name not in local), (name, q.name)
        if q.name not in local:
            assert q.data.base is not None and q.data.base.size == 1, (name, q.name)
            continue
        axis = getattr(q, "tp_axis", None)
        want = ref[q.name] if axis is None else shard_array(ref[q.name], axis, tp_rank, tp, q.tp_parts)
        err = np.max(np.abs(want - q.data))
        assert err < 1e-10, (name, q.name, err)
    covered = set().union(*world.allgather(local))
    assert covered == set(ref), (name, set(ref) - covered)
    if rank == 0:
        run = read_run(os.path.join(tmp, f"{name}-pp.h5"))
        s = read_run(os.path.join(tmp, f"{name}-serial-r0.h5")).metrics
        assert np.max(np.abs(s["loss"] - run.metrics["loss"])) < 1e-10, name
        key = "val_loss" if name.startswith("gpt") else "test_loss"
        np.testing.assert_allclose(s[key], run.metrics[key], rtol=0, atol=1e-10)
        assert run.plan["pp"] == pp and len(run.plan["stages"]) >= pp
        assert len(run.plan["stages"]) == (2 * pp if "zb_v" in name or "interleaved" in name
                                           else pp), name
        peaks = run.plan["peak_activation_bytes_per_rank"]
        assert len(peaks) == p and all(b > 0 for b in peaks), peaks
        held = run.plan["param_bytes_per_rank"]                  # each rank: its stages only
        whole = sum(q.data.nbytes for q in serial["model"].params)
        assert len(held) == p and all(0 <= b < whole for b in held), (held, whole)
        if tp == 1:
            assert sum(held) == dp * whole, (held, whole)
        kinds = set(run.timeline["kind"].tolist())
        assert {"F", "B"} <= kinds, kinds
        assert ("W" in kinds) == ("zb_" in name), (name, kinds)
    world.Barrier()
if rank == 0:
    print(f"train_pp OK on {p} ranks (dp={dp}, tp={tp}, pp={pp})")
