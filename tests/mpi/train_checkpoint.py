"""A checkpoint written under one layout resumes under another and ends where the serial run ends.

    mpiexec -n 4 python -m mpi4py tests/mpi/train_checkpoint.py TMPDIR

tp=2 x pp=2 saves (tensor-parallel shards gathered, pipeline stages sent to rank 0); dp=2 x tp=2,
dp=4 and serial runs resume (each rank takes its own shards and stages); all equal the serial
uninterrupted run to 1e-10 (float64, dropout on, AdamW, clipping, warm-up).
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import ConfigError, parse_overrides
from hpcnn.log import read_run
from hpcnn.parallel.tensor.linear import shard_array
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
assert p == 4, "four ranks: tp=2 x pp=2, dp=2 x tp=2, dp=4"
tmp = sys.argv[1]
GPT = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=8", "--n_layers=4", "--pad_vocab=2", "--dropout=0.1", "--dtype=float64",
       "--steps=6", "--eval_interval=3", "--clip=1.0", "--warmup=2", "--allreduce=mpi",
       "--progress=false"]


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", *GPT, *extra])


def equal_to(ref, run, name, tp):
    """This rank's parameters (its stages, its shards) equal the reference's."""
    local = set(run["local_params"])
    for q in run["model"].params:
        if q.name not in local:
            continue
        axis = getattr(q, "tp_axis", None)
        want = ref[q.name] if axis is None else shard_array(ref[q.name], axis, rank % tp, tp,
                                                           q.tp_parts)
        err = float(np.max(np.abs(want - q.data)))
        assert err < 1e-10, (name, q.name, err)


serial = train(cfg(f"serial-r{rank}.h5"), comm=None)
ref = {q.name: q.data for q in serial["model"].params}
ck = os.path.join(tmp, "ck-{step}.h5")
saved = train(cfg("tp-pp.h5", "--tp=2", "--pp=2", "--microbatches=2", f"--checkpoint={ck}",
                  "--checkpoint_every=2"), comm=world)
equal_to(ref, saved, "tp x pp", 2)
for name, layout, ck_step in (("dp-tp", ["--dp=2", "--tp=2"], 2), ("dp4", ["--dp=4"], 4)):
    run = train(cfg(f"{name}.h5", *layout, f"--resume={ck.replace('{step}', str(ck_step))}"),
                comm=world)
    equal_to(ref, run, name, 2 if "--tp=2" in layout else 1)
    if rank == 0:
        m = read_run(os.path.join(tmp, f"{name}.h5")).metrics
        s = read_run(os.path.join(tmp, "serial-r0.h5")).metrics
        np.testing.assert_allclose(m["loss"], s["loss"][ck_step:], rtol=0, atol=1e-10)
alone = train(cfg(f"alone-r{rank}.h5", f"--resume={ck.replace('{step}', '4')}"), comm=None)
equal_to(ref, alone, "serial resume", 1)
try:                                                  # refused on every rank, no hang
    train(cfg("bad.h5", "--dp=2", "--pp=2", "--dim=32", f"--resume={ck.replace('{step}', '2')}"),
          comm=world)
    raise AssertionError("a checkpoint of another width accepted")
except ConfigError as e:
    assert "another model: --dim=16 in the checkpoint, 32 here" in str(e), e
try:                                                  # seen by rank 0 only: all stop, none waits
    mine = ck.replace("{step}", "2") if rank == 0 else os.path.join(tmp, "elsewhere.h5")
    train(cfg("bad2.h5", "--dp=4", f"--resume={mine}"), comm=world)
    raise AssertionError("a checkpoint missing on some ranks accepted")
except ConfigError as e:
    assert "no such checkpoint file (on rank(s) [1, 2, 3] of 4)" in str(e), e
blocked = os.path.join(tmp, "plain")                 # cannot be written: every rank refuses it
if rank == 0:
    with open(blocked, "w") as f:
        f.write("a file, not a directory")
world.Barrier()
try:
    train(cfg("bad3.h5", "--pp=4", "--steps=1", f"--checkpoint={os.path.join(blocked, 'c.h5')}"),
          comm=world)
    raise AssertionError("an unwritable checkpoint went unnoticed")
except ConfigError as e:                              # before step 0 (its checks), not at the save
    assert "plain/c.h5' cannot be written" in str(e), e
world.Barrier()
if rank == 0:
    print(f"train_checkpoint OK on {p} ranks")
