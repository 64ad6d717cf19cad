"""Online load balancing with a straggler appearing mid-run (any world size >= 2).

Every rank runs at 100 samples/s except rank 1, which becomes 3x slower from step 10 on. The
balancer starts with equal shares, measures speeds every K = 5 steps, and must (a) hold
bitwise-identical shares and speeds on every rank at every step, (b) keep sum = batch, and
(c) give rank 1 about 1/3 of the others' share at the first rebalance that sees the straggler
(smoothing 0), or converge towards it (smoothing 0.5). A last phase measures real time: compute
is a sleep, rank 1's slowness an emulated :class:`Slowdown`.

    mpiexec -n 4 python -m mpi4py tests/mpi/hetero_balancer.py
"""
import time

import numpy as np
from mpi4py import MPI

from hpcnn.parallel.comm import Communicator
from hpcnn.parallel.hetero import Balancer, Slowdown, equal_shares, proportional_shares

world = MPI.COMM_WORLD
r, p = world.Get_rank(), world.Get_size()
assert p >= 2, "needs a straggler and at least one other rank"
comm = Communicator(world)
BATCH, K, ONSET, STEPS = 120, 5, 10, 30
FIRST = (ONSET // K + 1) * K - 1                 # first rebalance whose window is all straggler


def true_speed(rank, step):
    return 100.0 / 3 if rank == 1 and step >= ONSET else 100.0


def same_everywhere(bal, step):
    """Shares and speeds, byte for byte, equal to rank 0's (one small pickled allgather)."""
    speeds = bal.speeds if bal.speeds is not None else np.zeros(0)
    mine = bal.shares.tobytes() + speeds.tobytes()
    allv = world.allgather(mine)
    assert all(x == mine for x in allv), f"shares or speeds differ across ranks at step {step}"


def ratio(shares):
    """Rank 1's share over the mean share of the others."""
    return shares[1] / np.delete(shares, 1).mean()


# -- synthetic compute times: deterministic, exact expectations --------------------------------
for smoothing in (0.0, 0.5):
    bal = Balancer(comm, BATCH, "proportional", rebalance_every=K, smoothing=smoothing)
    np.testing.assert_array_equal(bal.shares, equal_shares(p, BATCH))
    rank1 = []
    same_everywhere(bal, -1)
    for step in range(STEPS):
        b = bal.local_share
        rebalanced = bal.step(step, b, b / true_speed(r, step))
        assert rebalanced == ((step + 1) % K == 0)
        same_everywhere(bal, step)
        assert bal.shares.sum() == BATCH and bal.shares.min() >= 1, bal.shares
        if rebalanced and step < FIRST:          # all equal speeds: no change
            np.testing.assert_array_equal(bal.shares, proportional_shares(np.ones(p), BATCH))
        if rebalanced and step >= FIRST:
            rank1.append(int(bal.shares[1]))
        if step == FIRST and smoothing == 0.0:
            truth = [true_speed(i, step) for i in range(p)]
            np.testing.assert_array_equal(bal.shares, proportional_shares(truth, BATCH))
            assert abs(ratio(bal.shares) - 1 / 3) < 0.05, bal.shares
    assert [h[0] for h in bal.history] == list(range(0, STEPS + 1, K))
    if smoothing == 0.5:                          # EMA: 2/3, 1/2, 5/12, 3/8 of the others' speed
        assert rank1 == sorted(rank1, reverse=True) and rank1[0] > rank1[-1], rank1
        assert 1 / 3 < ratio(bal.shares) < 0.45, bal.shares

# -- real time: compute is a sleep, rank 1 padded by an emulated 3x slowdown from ONSET ------
# (1 ms a sample: wake-up latency of a few ms on oversubscribed cores stays small against it)
SAMPLE_S, STEPS, BATCH = 1e-3, FIRST + 1, 24 * p
bal = Balancer(comm, BATCH, "proportional", rebalance_every=K, smoothing=0.0)
slow = Slowdown(3.0 if r == 1 else 1.0, "sleep")
for step in range(STEPS):
    t = time.perf_counter()
    time.sleep(bal.local_share * SAMPLE_S)
    compute = time.perf_counter() - t
    if step >= ONSET:
        compute += slow.pad(compute)
    if bal.step(step, bal.local_share, compute):
        same_everywhere(bal, step)
assert bal.shares.sum() == BATCH
assert 0.15 < ratio(bal.shares) < 0.55, (bal.shares, bal.speeds)

if r == 0:
    print(f"hetero_balancer OK on {p} ranks: shares {bal.shares.tolist()}, "
          f"speeds {np.round(bal.speeds).tolist()}")
