"""The C allreduce path (when built) and the Python one give the same sums and the same counts.

    mpiexec -n N python -m mpi4py tests/mpi/lean_path.py EXPECT_C
"""
import gc
import sys
import weakref

import numpy as np
from mpi4py import MPI

from hpcnn.parallel.collectives import stats
from hpcnn.parallel.collectives import CommStats, Communicator

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
expect_c = sys.argv[1] == "1"

fast = Communicator(world.Dup(), CommStats(), "fast")
assert (type(fast.allreduce).__name__ == "Lean") == expect_c, type(fast.allreduce)
saved, stats._LEAN = stats._LEAN, False                   # force the Python closure
slow = Communicator(world.Dup(), CommStats(), "slow")
stats._LEAN = saved
assert type(slow.allreduce).__name__ == "function"
for cm in (fast, slow):
    cm.collectives.set_auto_mpi_below(1 << 16)

rng = np.random.default_rng(rank)
cases = [rng.standard_normal(1000).astype(np.float32), rng.standard_normal((7, 5)),
         rng.integers(-9, 9, 33), rng.integers(0, 9, 5).astype(np.int32),
         rng.standard_normal(4) + 1j * rng.standard_normal(4),        # complex: general path
         rng.standard_normal((6, 4))[:, ::2],                          # strided: general path
         np.zeros(0), rng.standard_normal(1 << 15)]                    # empty; 256 KiB
total = {i: world.allreduce(a.copy(), op=MPI.SUM) for i, a in enumerate(cases)}
for alg in ("mpi", "auto", None):
    for i, a in enumerate(cases):
        outs = []
        for com in (fast, slow):
            b = a.copy()
            r = com.allreduce(b) if alg is None else com.allreduce(b, algorithm=alg)
            assert r is b
            outs.append(b)
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_allclose(outs[0], total[i], rtol=1e-12, atol=1e-12)
fa, sa = fast.stats.counter("allreduce", 2 * (p - 1), p), slow.stats.counter("allreduce", 2 * (p - 1), p)
assert (fa.calls, fa.raw) == (sa.calls, sa.raw) == (3 * len(cases), 3 * sum(a.nbytes for a in cases))
assert fa.seconds > 0 and fast.stats.bytes_sent == slow.stats.bytes_sent
# with shared arrays about, auto: zero copy for them, the library for private buffers
from hpcnn.parallel.collectives import algorithms  # noqa: E402
shared = fast.shared_zeros(1 << 18, np.float32)                      # 1 MiB: zero copy
private = np.empty(1 << 18, np.float32)
vals = rng.standard_normal(1 << 18).astype(np.float32)
want = world.allreduce(vals.copy(), op=MPI.SUM)
for buf in (shared, private):
    buf[...] = vals
    fast.allreduce(buf, algorithm="auto")
    np.testing.assert_allclose(buf, want, rtol=1e-5, atol=1e-5)
if expect_c:
    assert fast.allreduce.shared and fast.allreduce.private_below > 0
    lo, hi = fast.allreduce.shared[0]
    assert lo <= shared.__array_interface__["data"][0] < hi
del shared, buf                                  # freed windows must not be in use
algorithms.free(fast)
try:
    fast.allreduce(cases[0], nope="mpi")
    raise AssertionError("unknown keyword accepted")
except TypeError as e:
    assert "nope" in str(e) or "allreduce" in str(e), e
try:
    fast.allreduce(cases[0], algorithm="nope")
    raise AssertionError("unknown algorithm accepted")
except ValueError as e:
    assert "nope" in str(e), e
# the fast path refers back to its Communicator (the general method): the cycle is collected
tmp = Communicator(world.Dup(), CommStats(), "tmp")
dup, ref = tmp.comm, weakref.ref(tmp)
tmp.allreduce(np.ones(3))
del tmp
gc.collect()
assert ref() is None, "a Communicator with the fast path is never freed"
dup.Free()
if rank == 0:
    print(f"lean_path OK on {p} ranks ({'C' if expect_c else 'Python'} fast path)")
