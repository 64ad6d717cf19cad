"""The training loop with --remat under data and pipeline parallelism equals the serial loop.

    mpiexec -n N python -m mpi4py tests/mpi/train_remat.py TMPDIR DP PP
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
tmp, dp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

gpt = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=8", "--n_layers=6", "--dtype=float64", "--steps=3", "--eval_interval=3",
       "--log_interval=3", "--allreduce=mpi", "--progress=false", "--dropout=0.1"]


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", *gpt, *extra])


serial = train(cfg(f"serial-r{rank}.h5"), comm=None)
ref = {q.name: q.data for q in serial["model"].params}
layout = [f"--dp={dp}", f"--pp={pp}"]
mib = 0.12 if pp == 1 else 0.2 / dp   # gpipe holds 4 micro-batches: a quarter each
cases = [("sqrt", ["--remat=sqrt"]), ("full", ["--remat=full"]),
         ("optimal", ["--remat=optimal", f"--memory_budget={mib}"]),
         ("offload", ["--remat=optimal", f"--memory_budget={mib}", "--offload_gbps=20"])]
if pp > 1:
    cases = [(f"{n}-{s}", a + [f"--schedule={s}", "--microbatches=4"])
             for n, a in cases for s in ("1f1b", "gpipe") if (n, s) != ("full", "gpipe")]

def check_step_schedule(run, schedule):
    """--show_schedule: each rank's traced first step is its schedule list, the F and B of a
    micro-batch together run the stage's whole remat sequence, and every gradient bucket is
    launched once before the final wait."""
    from hpcnn.schedule import pipeline as schedules
    lists = schedules.SCHEDULES[schedule](pp, 4, pp) if pp > 1 else None
    for r, lines in enumerate(run.plan["step_schedule"]):
        assert lines[0] == f"rank {r} (dp {r % dp}, tp 0, pp {r // dp})", lines[0]
        body, last = [ln.strip() for ln in lines[1:-1]], lines[-1].split()
        if lists is not None:
            assert [ln.split(":")[0] for ln in body] == [str(i) for i in lists[r // dp]], body
        seq = {x["sequence"] for x in run.plan["remat_plans"] if x["rank"] == r}
        inner, launched = {}, [a for a in last[:-1]]
        for ln in body:
            head, _, ops = ln.partition(": ")
            if head.startswith(("F(", "B(")):         # buckets launch inside the last B (overlap)
                launched += [a for a in ops.split() if a.startswith("AR")]
                ops = " ".join(a for a in ops.split() if not a.startswith("AR"))
                inner.setdefault(head[2:], []).append(ops)
        assert inner and all(" ".join(v) in seq for v in inner.values()), (inner, seq)
        assert last[-1] == "AR_WAIT", lines
        assert sorted(int(a[2:]) for a in launched) == list(range(len(launched))), lines


for name, args in cases:
    if name.startswith("sqrt"):
        args = args + ["--show_schedule=true"]
    par = train(cfg(f"{name}.h5", *layout, *args), comm=world)
    local = set(par["local_params"])
    for q in par["model"].params:
        if q.name in local:
            err = np.max(np.abs(ref[q.name] - q.data))
            assert err < 1e-10, (name, q.name, err)
    if rank == 0:
        run = read_run(os.path.join(tmp, f"{name}.h5"))
        plans = run.plan["remat_plans"]
        assert {r["rank"] for r in plans} == set(range(p)), plans
        assert any(r["recomputed_forwards"] > 0 or "OFF(" in r["sequence"] for r in plans), name
        measured = run.plan["remat_measured_peak_bytes_per_rank"]
        assert len(measured) == p and all(m > 0 for m in measured)
        for r in plans:
            if r["policy"] == "optimal":          # each micro-batch's share of the budget
                assert r["predicted_peak_bytes"] <= r["budget_bytes"] + 1e-6, r
                assert abs(r["budget_bytes"] * r["inflight"] - mib * 2**20) < 1, r
        if pp > 1 and "1f1b" in name:
            assert max(r["inflight"] for r in plans) == pp
        if name.startswith("sqrt"):
            check_step_schedule(run, name.split("-")[-1])
    world.Barrier()
if dp == 2 and pp == 1:      # measured shares move: the budget must fit the largest one
    from hpcnn.config import ConfigError
    from hpcnn.memory import profile, rotor
    prof = profile.of_chain(serial["model"], (4, 8), need_dx=False)      # the equal share, 4 of 8
    tight = 1.02 * rotor.Solver(prof, 500).least / 2 ** 20
    train(cfg("equal-tight.h5", *layout, "--remat=optimal", f"--memory_budget={tight}"),
          comm=world)                                   # fits the equal share
    try:
        train(cfg("moving-tight.h5", *layout, "--remat=optimal", f"--memory_budget={tight}",
                  "--balance=proportional"), comm=world)
        raise AssertionError("a budget that only fits the equal share accepted")
    except ConfigError as e:
        assert "a replica may get up to 7 of the 8 rows" in str(e), e
if rank == 0:
    print(f"train_remat OK on {p} ranks (dp={dp}, pp={pp})")
