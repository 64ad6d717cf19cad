"""Online load balancing with a straggler appearing mid-run (any world size >= 2).

Every rank computes in t(b) = 0.1 + 0.01·b seconds for b samples (synthetic times: a fixed part
and a per-sample part) except rank 1, which becomes 3x slower from step 10 on (both parts, as
an emulated slowdown pads them). The balancer starts with equal shares, measures every K = 5
steps, and must (a) hold bitwise-identical shares and speeds on every rank at every step,
(b) keep sum = batch, (c) keep equal shares while all ranks are alike, (d) at the first
rebalance that sees the straggler, balance by the measured samples/s (one share measured per
rank since the change), and (e) end at the integer split that minimises the slowest true time,
to one sample. A last phase measures real time: compute is a sleep, rank 1's slowness an
emulated :class:`Slowdown`.

    mpiexec -n 4 python -m mpi4py tests/mpi/hetero_balancer.py
"""
import time

import numpy as np
from mpi4py import MPI

from hpcnn.parallel.collectives import Communicator
from hpcnn.parallel.data.hetero import Balancer, Slowdown, balanced_shares, equal_shares

world = MPI.COMM_WORLD
r, p = world.Get_rank(), world.Get_size()
assert p >= 2, "needs a straggler and at least one other rank"
comm = Communicator(world)
BATCH, K, ONSET, STEPS = 120, 5, 10, 60
FIRST = (ONSET // K + 1) * K - 1                 # first rebalance whose window is all straggler
FIXED, PER_SAMPLE = 0.1, 0.01


def factor(rank, step):
    return 3.0 if rank == 1 and step >= ONSET else 1.0


def true_seconds(rank, step, b):
    return factor(rank, step) * (FIXED + PER_SAMPLE * b)


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
bal = Balancer(comm, BATCH, "proportional", rebalance_every=K)
equal = equal_shares(p, BATCH)
np.testing.assert_array_equal(bal.shares, equal)
same_everywhere(bal, -1)
for step in range(STEPS):
    b = bal.local_share
    before = bal.shares.copy()
    rebalanced = bal.step(step, b, true_seconds(r, step, b))
    assert rebalanced == ((step + 1) % K == 0)
    same_everywhere(bal, step)
    assert bal.shares.sum() == BATCH and bal.shares.min() >= 1, bal.shares
    if rebalanced and step < FIRST:              # all alike: no change
        np.testing.assert_array_equal(bal.shares, equal)
    if step == FIRST:                            # samples/s at the shares measured
        per_sample = [true_seconds(i, step, before[i]) / before[i] for i in range(p)]
        np.testing.assert_array_equal(bal.shares, balanced_shares(np.zeros(p), per_sample, BATCH))
        assert abs(ratio(bal.shares) - 1 / 3) < 0.05, bal.shares
assert [h[0] for h in bal.history] == list(range(0, STEPS + 1, K))
fixed = [factor(i, STEPS) * FIXED for i in range(p)]
best = balanced_shares(fixed, [factor(i, STEPS) * PER_SAMPLE for i in range(p)], BATCH)
assert np.abs(bal.shares - best).max() <= 1, (bal.shares, best)
assert ratio(best) < 0.3, best                   # the fixed part: less than samples/s would give

# -- real time: compute is a sleep, rank 1 padded by an emulated 3x slowdown from ONSET ------
# (1 ms a sample: wake-up latency of a few ms on oversubscribed cores stays small against it)
SAMPLE_S, STEPS, BATCH = 1e-3, FIRST + 1, 24 * p
bal = Balancer(comm, BATCH, "proportional", rebalance_every=K)
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
# ~1/3 on an idle machine; waiting for a core (4 ranks on 2 busy cores) adds unpadded time to
# every rank alike, which pulls the split toward equal: bound only the direction and the floor
assert 0.1 < ratio(bal.shares) < 0.9, (bal.shares, bal.speeds)

if r == 0:
    print(f"hetero_balancer OK on {p} ranks: shares {bal.shares.tolist()}, "
          f"speeds {np.round(bal.speeds).tolist()}")
