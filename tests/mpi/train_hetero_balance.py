"""Online balancing in a real training run: one replica 3x slower (emulated, sleep), 2 ranks.

    mpiexec -n 2 python -m mpi4py tests/mpi/train_hetero_balance.py TMPDIR

Checks that hold whatever the machine's load (no timing bound): every rank ends with the same
shares; the slow replica's share moves down from the equal split; and the logged shares are
exactly what a :class:`Balancer` replayed from the logged per-step compute times decides, so the
training loop feeds the balancer the times it logs and the decisions depend on nothing else.
Where the split settles is not asserted here: a step's fixed part (Python overheads, on a loaded
machine the wait for a core and the sleep's wake-up) can make the minimum share the right
answer for the slow replica. test_hetero.py checks the decisions against known time models.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.parallel.data.hetero import Balancer, StepMeter
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
assert p == 2
log = os.path.join(sys.argv[1], "balance.h5")
BATCH, STEPS, K = 64, 40, 5
run = train(parse_overrides([f"--log={log}", "--model=mlp", "--hidden=512,512",
                             f"--batch_size={BATCH}", f"--steps={STEPS}", "--dp=2",
                             "--balance=proportional", f"--rebalance_every={K}", "--slowdown=1:3",
                             "--slowdown_mode=sleep", "--allreduce=mpi", "--eval_interval=0",
                             "--progress=false"]),
            comm=world)
every = world.allgather(run["shares"])
assert every[0] == every[1], every


class Replay:
    """The balancer's communicator, rank 0's view, from the log: each rank's window summary."""

    def __init__(self, rows):
        self.size, self.rank, self.rows, self.meters = p, 0, rows, [StepMeter() for _ in range(p)]

    def allgather_scalars(self, values):
        out = np.array([values] + [m.summary() for m in self.meters[1:]])
        for m in self.meters:
            m.reset()
        return out


if rank == 0:
    hist = read_run(log).plan["shares_history"]
    ranks = read_run(log).ranks
    assert [h[0] for h in hist] == list(range(0, STEPS + 1, K)), hist
    assert all(sum(h[1]) == BATCH and min(h[1]) >= 1 for h in hist), hist
    slow = np.array([h[1][1] for h in hist])
    assert slow[1] < BATCH // 2 and np.median(slow[1:]) < BATCH // 2, slow
    comm = Replay(ranks)
    bal = Balancer(comm, BATCH, "proportional", rebalance_every=K)
    for step in range(STEPS):
        t = {int(r): float(s) for r, s in zip(ranks["rank"][ranks["step"] == step],
                                              ranks["compute_s"][ranks["step"] == step])}
        comm.meters[1].record(bal.shares[1], t[1])
        bal.step(step, bal.local_share, t[0])
    assert [[s, h.tolist()] for s, h, _ in bal.history] == hist, (bal.history, hist)
    print(f"train_hetero_balance OK on {p} ranks: slow replica's shares {slow.tolist()}")
