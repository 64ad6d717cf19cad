"""hpcnn train --model=gpt --plan=auto on these ranks: the layout in the log's /plan is the one
:func:`hpcnn.plan.auto.choose_gpt_layout` chooses serially, and the losses equal (bit for bit)
those of the same layout given explicitly (with its ``--layout`` when the planner cut the
stages itself). Options after the machine file are added to both runs.

    mpiexec -n N python -m mpi4py tests/mpi/train_gpt_plan.py TMPDIR MACHINE.toml [--opt=value ...]
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.datasets import for_config
from hpcnn.log import read_run
from hpcnn.plan.auto import choose_gpt_layout
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp, mach, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
base = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=4", "--n_layers=2",
        "--block_size=8", "--batch_size=8", "--steps=3", "--eval_interval=0", "--eval_batches=1",
        "--log_interval=3", "--progress=false", "--allreduce=mpi"] + extra

auto = parse_overrides(base + ["--plan=auto", f"--machine={mach}",
                               f"--log={os.path.join(tmp, 'auto.h5')}"])
chosen, record = choose_gpt_layout(auto.resolved(), p, for_config(auto.resolved()).vocab)
train(auto, comm=world)
explicit = [f"--dp={chosen.dp}", f"--tp={chosen.tp}", f"--pp={chosen.pp}",
            f"--schedule={chosen.schedule}", f"--microbatches={chosen.microbatches}"]
explicit += [f"--layout={chosen.layout}"] if chosen.layout else []
train(parse_overrides(base + explicit + [f"--log={os.path.join(tmp, 'explicit.h5')}"]), comm=world)
if rank == 0:
    a, b = read_run(os.path.join(tmp, "auto.h5")), read_run(os.path.join(tmp, "explicit.h5"))
    got = a.plan["hybrid_layout"]
    assert got == record, (got, record)
    assert (a.plan["dp"], a.plan["tp"], a.plan["pp"]) == (chosen.dp, chosen.tp, chosen.pp)
    assert chosen.dp * chosen.tp * chosen.pp == p
    assert got["stage_layout"] == chosen.layout and a.plan["pp"] == len(
        chosen.layout.split("|") if chosen.layout else [0] * chosen.pp)
    for key in ("loss", "val_loss"):
        np.testing.assert_array_equal(a.metrics[key], b.metrics[key])
    print(f"train_gpt_plan OK on {p} ranks: {got['layout']}")
