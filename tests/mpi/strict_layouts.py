"""Each parallel layout (and ZeRO stage) under the strict device backend equals the same layout
on NumPy, bit for bit (losses, validation losses, this rank's parameters), its MPI traffic
staged through the host (tests/test_strict.py has the serial checks).

    mpiexec -n 2 python -m mpi4py tests/mpi/strict_layouts.py TMPDIR dp tp pp zero1 zero2 zero3
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn import backend
from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp, layouts = sys.argv[1], sys.argv[2:]

GPT = ["--progress=false", "--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2",
       "--block_size=8", "--batch_size=8", "--n_layers=2", "--steps=3", "--log_interval=3",
       "--eval_interval=3", "--eval_batches=2", "--optimizer=adamw", "--dropout=0.1",
       f"--pad_vocab={p}"]
LAYOUT = {"dp": [f"--dp={p}"], "tp": [f"--tp={p}"], "pp": [f"--pp={p}", "--microbatches=2"],
          **{f"zero{z}": [f"--dp={p}", f"--zero={z}"] for z in (1, 2, 3)}}

for layout in layouts:
    runs = {}
    for device in ("cpu", "strict"):
        log = os.path.join(tmp, f"{layout}-{device}.h5")
        runs[device] = train(parse_overrides([f"--log={log}", f"--device={device}", *GPT,
                                              *LAYOUT[layout]]), comm=world)
        backend.set_device("cpu")
    for a, b in zip(runs["cpu"]["model"].params, runs["strict"]["model"].params):
        np.testing.assert_array_equal(backend.to_host(b.data), a.data, err_msg=a.name)
    if rank == 0:
        a, b = (read_run(os.path.join(tmp, f"{layout}-{d}.h5")).metrics for d in ("cpu", "strict"))
        for k in ("loss", "val_loss"):
            np.testing.assert_array_equal(b[k], a[k], err_msg=f"{layout} {k}")
        print(f"strict {layout}={p} OK", flush=True)
