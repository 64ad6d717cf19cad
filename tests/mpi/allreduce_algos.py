"""Every allreduce algorithm, blocking and non-blocking, against closed-form sums (any size).

Rank r contributes (r + 1) * pattern with an integer-valued pattern, so the sum is exactly
p (p + 1) / 2 * pattern in every dtype; results must also be bitwise identical on every rank,
for random (not integer-valued) data too.

    mpiexec -n 3 python -m mpi4py tests/mpi/allreduce_algos.py
"""
import numpy as np
from mpi4py import MPI

from hpcnn.parallel import allreduce as AR
from hpcnn.parallel.comm import CommStats, Communicator, Request

world = MPI.COMM_WORLD
r, p = world.Get_rank(), world.Get_size()
c = Communicator(world, CommStats())
SIZES = sorted({0, 1, 7, p - 1, p + 1, 1000, 100003})
DTYPES = (np.float64, np.float32, np.int64)


def pattern(n, dtype):
    return ((np.arange(n) * 7919) % 97 - 48).astype(dtype)


def same_everywhere(a, what):
    """Assert ``a`` has the same bytes on every rank."""
    b = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    allb = np.empty((p, b.size), np.uint8)
    world.Allgather(b, allb)
    assert (allb == allb[0]).all(), f"{what}: results differ across ranks"


def check(a, n, dtype, what):
    np.testing.assert_array_equal(a.reshape(-1), p * (p + 1) // 2 * pattern(n, dtype), err_msg=what)
    same_everywhere(a, what)


# -- blocking and non-blocking, every size and dtype, default and small segments ----------------
# (segment bytes, dtypes, sizes): small segments split chunks unevenly, 1000 B is no multiple of
# 8; fewer cases with them, as 1000s of tiny messages are slow on 4 oversubscribed ranks
for seg, dtypes, sizes in ((AR.SEGMENT_BYTES, DTYPES, SIZES), (4096, DTYPES[1:2], SIZES),
                           (1000, DTYPES[:1], SIZES[:-1])):
    c.allreduce_segment_bytes = c.iallreduce_segment_bytes = seg
    for dtype in dtypes:
        for n in sizes:
            for alg in AR.ALGORITHMS:
                a = (r + 1) * pattern(n, dtype)
                assert c.allreduce(a, algorithm=alg) is a
                check(a, n, dtype, f"allreduce {alg} n={n} {dtype.__name__} seg={seg}")
            for alg in ("ring", "mpi", "auto"):
                a = (r + 1) * pattern(n, dtype)
                req = c.iallreduce(a, algorithm=alg)
                assert isinstance(req, Request)
                req.wait()
                assert req.done and req.test()
                check(a, n, dtype, f"iallreduce {alg} n={n} {dtype.__name__} seg={seg}")

# -- several rings in flight at once, progressed by test() in a rank-dependent order ------------
c.allreduce_segment_bytes = c.iallreduce_segment_bytes = 2048
bufs = [(r + 1) * pattern(n, np.float64) for n in (100003, 5, 40000, 1)]
calls_before = c.stats.calls["iallreduce"]
flags = []
reqs = [AR.iallreduce_ring(c, b, on_done=lambda i=i: flags.append(i)) for i, b in enumerate(bufs)]
for it in range(2000):
    for q in (reqs if (it + r) % 2 else reqs[::-1]):
        q.test()
    if all(q.done for q in reqs):
        break
for q in reqs:
    q.wait()
    assert q.done and q.progress == 1.0
assert sorted(flags) == [0, 1, 2, 3], flags
assert c.stats.calls["iallreduce"] == calls_before + 4
for b, n in zip(bufs, (100003, 5, 40000, 1)):
    check(b, n, np.float64, f"concurrent rings n={n}")
# the scratch of finished rings is reused: a new ring allocates nothing
pool = list(AR._state(c).pool)
req = AR.iallreduce_ring(c, (r + 1) * pattern(1000, np.float64))
assert any(req._scr is s for s in pool)
req.wait()

# -- random data: ring and rd agree with mpi to rounding, bitwise equal across ranks -----------
rng = np.random.default_rng(r)
for dtype, rtol in ((np.float64, 1e-12), (np.float32, 1e-4)):
    x = rng.standard_normal((37, 271)).astype(dtype)
    ref = x.copy()
    c.allreduce(ref, algorithm="mpi")
    for alg in ("ring", "rd"):
        a = x.copy()
        c.allreduce(a, algorithm=alg)
        np.testing.assert_allclose(a, ref, rtol=rtol, atol=rtol * 10)
        same_everywhere(a, f"random {alg} {dtype.__name__}")

# -- byte counting: once per call, 2(p-1)/p n -------------------------------------------------
b0 = c.stats.bytes["allreduce"]
c.allreduce(np.ones(1000), algorithm="ring")
assert c.stats.bytes["allreduce"] - b0 == 2 * (p - 1) * 8000 // p

# -- errors ------------------------------------------------------------------------------------
for bad, msg in ((lambda: c.allreduce(np.ones(4), algorithm="tree"), "unknown allreduce"),
                 (lambda: c.allreduce(np.ones((4, 4))[:, 1], algorithm="ring"), "C-contiguous"),
                 (lambda: c.iallreduce(np.ones(4), algorithm="rd"), "unknown iallreduce")):
    try:
        bad()
        raise AssertionError(f"no error for {msg}")
    except ValueError as e:
        assert msg in str(e), e

# -- auto: a forced table, then a calibration --------------------------------------------------
assert AR.choose(c, 100) == AR.DEFAULT_TABLE["choice"][0]
c.allreduce_table = {"sizes": [64, 1 << 20], "choice": ["rd", "ring"]}
assert AR.choose(c, 8) == "rd" and AR.choose(c, 1 << 12) == "rd" and AR.choose(c, 1 << 14) == "ring"
table = AR.calibrate(c, sizes=[1 << 10, 1 << 18], repeats=2)
assert table["p"] == p and len(table["choice"]) == 2
assert all(ch in ("mpi", "ring", "rd") for ch in table["choice"])
assert world.allgather(table) == [table] * p, "ranks calibrated differently"
for i, ch in enumerate(table["choice"]):     # never slower than mpi at a calibrated size
    assert table["times"][ch][i] <= table["times"]["mpi"][i]
c.allreduce_table = table
for n in SIZES:
    a = (r + 1) * pattern(n, np.float32)
    c.allreduce(a, algorithm="auto")
    check(a, n, np.float32, f"calibrated auto n={n}")

AR.free(c)
if r == 0:
    print(f"allreduce_algos OK on {p} ranks")
