"""``--remat=optimal`` at the least feasible ``--memory_budget``: the executor's measured account
equals the plan's predicted peak on every rank, so it stays within the budget, under tensor
parallelism (with and without sequence parallelism: the vocabulary-parallel loss's cache) and
under a pipeline (the first stage's micro-batches are views of the rank's batch).

    mpiexec -n 2 python -m mpi4py tests/mpi/remat_least_budget.py TMPDIR
"""
import os
import re
import sys

from mpi4py import MPI

from hpcnn.config import ConfigError, parse_overrides
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp = sys.argv[1]

# a small GPT whose logits dominate (vocabulary padded to 64): at the least budget the peak is
# the loss's backward, where the loss's cache counts
gpt = ["--model=gpt", "--dataset=sonnet", "--dim=8", "--n_heads=2", "--block_size=4",
       "--batch_size=8", "--n_layers=1", "--pad_vocab=64", "--dtype=float64", "--steps=2",
       "--eval_interval=2", "--log_interval=2", "--progress=false", "--dropout=0.1",
       "--remat=optimal"]
LEAST = re.compile(r"\((\d+) micro-batch\(es\) in flight\): memory budget [^:]*"
                   r"least feasible one for this chain: [\d.]+ MiB \((\d+) B\)")


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", *gpt, *extra])


def least_budget(name, args):
    """The least budget (MiB) the planner accepts on every rank: start below everything and
    raise it to what the refusal names (micro-batches in flight x the chain's least), until it
    is accepted. The planner refuses on every rank with every rank's reason, so all agree."""
    mib = 1e-6
    for attempt in range(8):
        try:
            return mib, train(cfg(f"{name}-{attempt}.h5", *args, f"--memory_budget={mib}"),
                              comm=world)
        except ConfigError as e:
            found = LEAST.findall(str(e))
            assert found, str(e)
            mib = max(mib, max(int(k) * (int(b) + 1) for k, b in found) / 2**20)
    raise AssertionError(f"{name}: no accepted budget after 8 attempts ({mib} MiB)")


cases = {"tp-sp": ["--tp=2", "--sequence_parallel=true"], "tp": ["--tp=2"],
         "pp-1f1b": ["--pp=2", "--microbatches=4", "--schedule=1f1b"],
         "pp-gpipe": ["--pp=2", "--microbatches=4", "--schedule=gpipe"]}
for name, args in cases.items():
    mib, out = least_budget(name, args)
    plans, measured = out["remat_plans"], out["remat_measured_peak"]
    assert plans and all(r["predicted_peak_bytes"] <= r["budget_bytes"] for r in plans), plans
    predicted = max(r["predicted_peak_bytes"] for r in plans)
    # the account follows the model exactly: neither above it (over the budget) nor below
    assert measured == predicted, (name, rank, measured, predicted, measured - predicted)
    assert measured <= max(r["budget_bytes"] for r in plans), (name, rank, measured)
    world.Barrier()
if rank == 0:
    print(f"remat_least_budget OK on {p} ranks")
