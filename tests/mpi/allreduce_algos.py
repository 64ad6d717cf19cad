"""Every allreduce algorithm, blocking and non-blocking, against closed-form sums (any size).

Rank r contributes (r + 1) * pattern with an integer-valued pattern, so the sum is exactly
p (p + 1) / 2 * pattern in every dtype; results must also be bitwise identical on every rank,
for random (not integer-valued) data too, and shm's must be bitwise the sum in rank order.
Then: shm's window (pieces, growth, free and reuse, non-blocking requests in flight with
rings), zero copy on ``shared_zeros`` arrays (views, requests, a mismatch across ranks), the
counters of the lean path, HPCNN_SHM=0, ``auto``'s tables and calibration, and the data-parallel
engine with ``auto`` picking shm for blocking and non-blocking buckets.

    mpiexec -n 3 python -m mpi4py tests/mpi/allreduce_algos.py
"""
import os

import warnings

import numpy as np
from mpi4py import MPI

from hpcnn.parallel.collectives import algorithms
from hpcnn.parallel.collectives import shm
from hpcnn.parallel.collectives import CommStats, Communicator, Request

world = MPI.COMM_WORLD
r, p = world.Get_rank(), world.Get_size()
c = Communicator(world, CommStats())
SIZES = sorted({0, 1, 7, p - 1, p + 1, 1000, 100003})
DTYPES = (np.float64, np.float32, np.int64)


from sums import pattern, same_everywhere  # noqa: E402


def check(a, n, dtype, what):
    np.testing.assert_array_equal(a.reshape(-1), p * (p + 1) // 2 * pattern(n, dtype), err_msg=what)
    same_everywhere(a, what)


# -- blocking and non-blocking, every size and dtype, default and small segments ----------------
# (segment bytes, dtypes, sizes): small segments split chunks unevenly, 1000 B is no multiple of
# 8; fewer cases with them, as 1000s of tiny messages are slow on 4 oversubscribed ranks. shm's
# pieces: 4 x the segment (100003 floats go through the window in 25 pieces; 1000 B: uneven)
from hpcnn.parallel.collectives import cma  # noqa: E402
BLOCKING = [a for a in algorithms.ALGORITHMS if a != "cma" or cma.available(c)]
for seg, dtypes, sizes in ((algorithms.SEGMENT_BYTES, DTYPES, SIZES), (4096, DTYPES[1:2], SIZES),
                           (1000, DTYPES[:1], SIZES[:-1])):
    c.allreduce_segment_bytes = c.iallreduce_segment_bytes = seg
    c.shm_piece_bytes = cma.CHUNK_BYTES = 4 * seg              # many pieces, many chunks
    for dtype in dtypes:
        for n in sizes:
            for alg in BLOCKING:
                a = (r + 1) * pattern(n, dtype)
                assert c.allreduce(a, algorithm=alg) is a
                check(a, n, dtype, f"allreduce {alg} n={n} {dtype.__name__} seg={seg}")
            for alg in algorithms.NONBLOCKING:
                a = (r + 1) * pattern(n, dtype)
                req = c.iallreduce(a, algorithm=alg)
                assert isinstance(req, Request)
                req.wait()
                assert req.done and req.test()
                check(a, n, dtype, f"iallreduce {alg} n={n} {dtype.__name__} seg={seg}")

def drive(reqs, rounds):
    """test() the requests in a rank-dependent order until all are done (at most ``rounds``
    passes), then wait() for each."""
    for it in range(rounds):
        for q in (reqs if (it + r) % 2 else reqs[::-1]):
            q.test()
        if all(q.done for q in reqs):
            break
    for q in reqs:
        q.wait()


# -- several rings in flight at once, progressed by test() in a rank-dependent order ------------
c.allreduce_segment_bytes = c.iallreduce_segment_bytes = 2048
bufs = [(r + 1) * pattern(n, np.float64) for n in (100003, 5, 40000, 1)]
calls_before = c.stats.calls["iallreduce"]
flags = []
reqs = [algorithms.iallreduce_ring(c, b, on_done=lambda i=i: flags.append(i))
        for i, b in enumerate(bufs)]
drive(reqs, 2000)
for q in reqs:
    assert q.done and q.progress == 1.0
assert sorted(flags) == [0, 1, 2, 3], flags
assert c.stats.calls["iallreduce"] == calls_before + 4
for b, n in zip(bufs, (100003, 5, 40000, 1)):
    check(b, n, np.float64, f"concurrent rings n={n}")
# the scratch of finished rings is reused: a new ring allocates nothing
pool = list(c.collectives.get_workspace().pool)
req = algorithms.iallreduce_ring(c, (r + 1) * pattern(1000, np.float64))
assert any(req._scr is s for s in pool)
req.wait()

# -- random data: ring, rd, shm agree with mpi to rounding, bitwise equal across ranks; shm is
# bitwise the sum in rank order (rank 0's operand first), blocking and non-blocking ------------
rng = np.random.default_rng(r)
c.shm_piece_bytes = 8192                                    # 10 pieces of the float64 case
for dtype, rtol in ((np.float64, 1e-12), (np.float32, 1e-4)):
    x = rng.standard_normal((37, 271)).astype(dtype)
    ref = x.copy()
    c.allreduce(ref, algorithm="mpi")
    xs = np.empty((p,) + x.shape, dtype)
    world.Allgather(x, xs)
    in_order = xs[0].copy()
    for q in range(1, p):
        in_order += xs[q]
    for alg in ("ring", "rd", "shm", "ishm") + (("cma",) if cma.available(c) else ()):
        a = x.copy()
        if alg == "ishm":
            c.iallreduce(a, algorithm="shm").wait()
        else:
            c.allreduce(a, algorithm=alg)
        np.testing.assert_allclose(a, ref, rtol=rtol, atol=rtol * 10)
        same_everywhere(a, f"random {alg} {dtype.__name__}")
        if alg in ("shm", "ishm", "cma"):
            assert np.array_equal(a, in_order), f"{alg} not summed in rank order"

# -- the shared window: grows to the largest piece (a power of two), reused, freed ------------
algorithms.free(c)                                                  # start from no window
node = shm.node_of(c)
assert node is not None and algorithms.single_node(c) and node.half == 0
c.shm_piece_bytes = 1 << 20
for n, half in ((10, 0), (30000, 1 << 17), (10, 1 << 17), (200000, 1 << 20), (50, 1 << 20)):
    for _ in range(3):                                      # repeated calls, both halves
        a = (r + 1) * pattern(n, np.float32)
        c.allreduce(a, algorithm="shm")
        check(a, n, np.float32, f"shm growth n={n}")
    assert node.half == max(shm.MIN_HALF, half), (n, node.half)
algorithms.free(c)
assert c.collectives.workspace is None
a = (r + 1) * pattern(1000, np.float64)
c.allreduce(a, algorithm="shm")                             # made again on reuse
check(a, 1000, np.float64, "shm after free")
assert shm.node_of(c) is not node and shm.node_of(c).half == shm.MIN_HALF

# -- non-blocking shm and ring requests in flight together, tested in a rank-dependent order ---
c.shm_piece_bytes = c.iallreduce_segment_bytes = 4096
sizes = (30001, 5, 0, 12000, 1)
bufs = [(r + 1) * pattern(n, np.float64) for n in sizes]
calls_before = c.stats.calls["iallreduce"]
flags = []
algs = ["shm", "ring", "shm", "shm", "ring"]
reqs = [c.iallreduce(b, on_done=lambda i=i: flags.append(i), algorithm=a)
        for i, (b, a) in enumerate(zip(bufs, algs))]
drive(reqs, 3000)
assert sorted(flags) == list(range(len(sizes))), flags
assert c.stats.calls["iallreduce"] == calls_before + len(sizes)
for b, n in zip(bufs, sizes):
    check(b, n, np.float64, f"in flight n={n}")
a = (r + 1) * pattern(9000, np.float32)                     # queued, then a blocking call
q = c.iallreduce(a, algorithm="shm")
b = (r + 1) * pattern(7000, np.float64)
c.allreduce(b, algorithm="shm")                             # completes the queued request first
assert q.done
check(a, 9000, np.float32, "queued shm")
check(b, 7000, np.float64, "shm after queued")
a = (r + 1) * pattern(300000, np.float32)                   # a bigger piece grows the window
c.shm_piece_bytes = 1 << 20
q = c.iallreduce(a, algorithm="shm")
q.wait()
check(a, 300000, np.float32, "shm request growing the window")

# -- zero copy: arrays from shared_zeros are reduced in place, views too, blocking or not -------
zero_copy_bytes, shm.ZERO_COPY_BYTES = shm.ZERO_COPY_BYTES, 0   # zero copy at any size here
z64 = c.shared_zeros((3, 1001), np.float64)
z32 = c.shared_zeros(20011, np.float32)
empty = c.shared_zeros(0, np.int64)
assert z64.shape == (3, 1001) and not z64.any() and shm.node_of(c).find(z64.reshape(-1))
for z, dtype in ((z64, np.float64), (z32, np.float32)):
    flat = z.reshape(-1)
    for lo, hi in ((0, flat.size), (0, 1), (7, 7 + p + 1), (1, flat.size - 3)):
        flat[lo:hi] = (r + 1) * pattern(hi - lo, dtype)
        c.allreduce(flat[lo:hi], algorithm="shm")
        check(flat[lo:hi], hi - lo, dtype, f"zero copy [{lo}:{hi}] {dtype.__name__}")
c.allreduce(empty, algorithm="shm")
x = rng.standard_normal(z32.size).astype(np.float32)
xs = np.empty((p, x.size), np.float32)
world.Allgather(x, xs)
in_order = xs[0].copy()
for q in range(1, p):
    in_order += xs[q]
shm.CHUNK_BYTES, chunk = 4096, shm.CHUNK_BYTES            # summed and pushed in chunks
for how in ("blocking", "request", "auto"):
    z32[:] = x
    if how == "request":
        c.iallreduce(z32, algorithm="shm").wait()
    else:                                   # auto: a table choosing the ring runs zero-copy shm
        c.allreduce_table = {"sizes": [1], "choice": ["ring"]} if how == "auto" else None
        c.allreduce(z32, algorithm="shm" if how == "blocking" else "auto")
    assert np.array_equal(z32, in_order), f"zero copy {how}: not the sum in rank order"
shm.CHUNK_BYTES = chunk
c.allreduce_table = None
z64[...] = (r + 1) * pattern(z64.size, np.float64).reshape(z64.shape)   # in flight with others
b = (r + 1) * pattern(5000, np.float64)
reqs = [c.iallreduce(z64[0], algorithm="shm"), c.iallreduce(b, algorithm="shm"),
        c.iallreduce(z64[1:], algorithm="shm"), algorithms.iallreduce_ring(c, z32)]
while not all([q.test() for q in (reqs if r % 2 else reqs[::-1])]):
    pass
check(z64, z64.size, np.float64, "zero copy requests")
check(b, 5000, np.float64, "private request among zero copy ones")
try:                                        # ranks passing different regions: an error on all
    c.allreduce(z64.reshape(-1)[r:r + 10], algorithm="shm")
    assert p == 1, "different regions accepted"
except ValueError as e:
    assert "same region" in str(e), e
shm.ZERO_COPY_BYTES = zero_copy_bytes       # below it, shared buffers take the private path
big = c.shared_zeros(zero_copy_bytes // 4, np.float32)    # auto: zero copy from there
sh = shm.node_of(c).find(big)[0]
for it, start in enumerate((c.allreduce, c.iallreduce)):
    big[:] = (r + 1) * pattern(big.size, np.float32)
    q = start(big, algorithm="auto")
    if it:
        q.wait()
    check(big, big.size, np.float32, "auto on a shared array")
    assert sh.seq == it + 1, "auto did not reduce the shared array in place"
assert c.collectives.auto_mpi_below <= zero_copy_bytes
assert c.collectives.iauto_mpi_below <= zero_copy_bytes
z64[...] = (r + 1) * pattern(z64.size, np.float64).reshape(z64.shape)
c.allreduce(z64[1], algorithm="shm")
c.allreduce(z64[2], algorithm="auto")
np.testing.assert_array_equal(z64[1:], p * (p + 1) // 2 * pattern(z64.size, np.float64)
                              .reshape(z64.shape)[1:], err_msg="small shared buffers")
same_everywhere(z64[1:], "small shared buffers")

# -- counters: the lean path counts calls, bytes (2(p-1)/p n, floored on the total), seconds ----
stats = CommStats()
c2 = Communicator(world, stats)
c2.allreduce_table = {"sizes": [1 << 10, 1 << 16], "choice": ["mpi", "ring"]}
ones = np.ones(250)                                         # 2000 B
for alg, k in (("mpi", 3), ("auto", 4), ("ring", 2), ("shm", 1)):
    for _ in range(k):
        c2.allreduce(ones, algorithm=alg)
assert c2.collectives.auto_mpi_below == 8193                           # 8192**2 == 1024 * 65536
assert stats.calls["allreduce"] == 10 and stats.calls["iallreduce"] == 0
assert stats.bytes["allreduce"] == 2 * (p - 1) * 2000 * 10 // p == stats.bytes_sent
assert stats.seconds["allreduce"] > 0 and stats.comm_seconds == stats.seconds["allreduce"]
c2.iallreduce(ones).wait()
c2.iallreduce(ones, algorithm="auto").wait()
assert stats.calls["iallreduce"] == 2
assert stats.snapshot()["calls"] == {"allreduce": 10, "iallreduce": 2}
stats.reset()
assert stats.calls["allreduce"] == 0 and stats.bytes_sent == 0 and dict(stats.calls) == {}
c2.allreduce(ones)
assert stats.calls["allreduce"] == 1 and stats.bytes["allreduce"] == 2 * (p - 1) * 2000 // p
algorithms.free(c2)

# -- errors ------------------------------------------------------------------------------------
for bad, msg in ((lambda: c.allreduce(np.ones(4), algorithm="tree"), "unknown allreduce"),
                 (lambda: c.allreduce(np.ones((4, 4))[:, 1], algorithm="ring"), "C-contiguous"),
                 (lambda: c.allreduce(np.ones((4, 4))[:, 1], algorithm="shm"), "C-contiguous"),
                 (lambda: c.iallreduce(np.ones(4), algorithm="rd"), "unknown iallreduce")):
    try:
        bad()
        raise AssertionError(f"no error for {msg}")
    except ValueError as e:
        assert msg in str(e), e

# -- HPCNN_SHM=0: as on several nodes (no shm, the multi-node defaults) -------------------------
os.environ["HPCNN_SHM"] = "0"
c3 = Communicator(world)
assert not algorithms.single_node(c3) and algorithms.default_table(c3) is algorithms.DEFAULT_TABLE
assert algorithms.choose_nonblocking(c3, 1 << 20) == "mpi"
assert algorithms.choose_nonblocking(c3, 4 << 20) == "ring"
z = c3.shared_zeros((2, 3), np.float32)
assert type(z) is np.ndarray and z.shape == (2, 3) and not z.any()
c3.allreduce(z, algorithm="auto")
try:
    c3.allreduce(np.ones(4), algorithm="shm")
    raise AssertionError("shm accepted with HPCNN_SHM=0")
except ValueError as e:
    assert "one node" in str(e), e
algorithms.free(c3)
del os.environ["HPCNN_SHM"]

# -- auto: the defaults, a forced table, then a calibration -----------------------------------
assert algorithms.default_table(c) is algorithms.DEFAULT_SHM_TABLE
assert algorithms.choose(c, 100) == "mpi" and algorithms.choose(c, 64 << 20) == "shm"
assert algorithms.choose_nonblocking(c, 4 << 20) == "shm"
assert algorithms.choose_nonblocking(c, 1000) == "mpi"
c.allreduce_table = {"sizes": [64, 1 << 20], "choice": ["rd", "ring"]}
assert [algorithms.choose(c, n) for n in (8, 1 << 12, 1 << 14)] == ["rd", "rd", "ring"]
assert c.collectives.auto_mpi_below == 0
table = algorithms.calibrate(c, sizes=[1 << 10, 1 << 18], repeats=2)
assert c.allreduce_table is table and table["p"] == p and len(table["choice"]) == 2
timed = ["mpi", "rd", "ring", "shm"] + (["cma"] if cma.available(c) else [])
assert sorted(table["times"]) == sorted(timed)
assert all(ch in timed for ch in table["choice"]), table     # cma too, when it wins here
assert world.allgather(table) == [table] * p, "ranks calibrated differently"
for i, ch in enumerate(table["choice"]):     # never slower than mpi at a calibrated size:
    assert table["times"][ch][i] <= table["times"]["mpi"][i]     # another path wins clearly
    assert ch == "mpi" or algorithms.wins(table["low"]["mpi"][i], table["high"][ch][i]), table
    for a in timed:                          # the quartiles of every path's rounds
        assert 0 < table["low"][a][i] <= table["times"][a][i] <= table["high"][a][i], table
for n in SIZES:
    a = (r + 1) * pattern(n, np.float32)
    c.allreduce(a, algorithm="auto")
    check(a, n, np.float32, f"calibrated auto n={n}")

# -- the data-parallel engine: auto picks shm for blocking and non-blocking buckets -----------
from hpcnn.nn import models                                 # noqa: E402
from hpcnn.parallel.data.bucketed import DataParallel                # noqa: E402


def dp_grads(algorithm, overlap, shm_everywhere):
    model = models.mlp(24, (16, 12), 5, seed=2, dtype=np.float64)
    cd = Communicator(world, CommStats())
    if shm_everywhere:                      # every bucket size picks shm
        cd.allreduce_table = {"sizes": [1], "choice": ["shm"]}
        cd.collectives.iauto_mpi_below = 0
    dp = DataParallel(model, cd, bucket_mb=600 / 2 ** 20, overlap=overlap, algorithm=algorithm)
    x = np.random.default_rng(10 + r).standard_normal((6, 24))
    _, caches = model.forward(x, np.arange(6) % 5)
    dp.zero_grad()
    dp.backward(1.0 / p, caches)
    dp.finish(0)
    picked = {(algorithms.choose_nonblocking if overlap else algorithms.choose)(cd, b.view.nbytes)
              for b in dp.buckets}
    used = bool(shm.node_of(cd).half)       # the window was made: shm ran
    nb = dp.n_buckets
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp.release()                        # gradients back to private memory, windows freed
    assert dp.n_buckets == 0 and not caught, [str(w.message) for w in caught]   # none kept
    return [q.grad.copy() for q in model.params], nb, picked, used


ref = dp_grads("mpi", False, False)[0]
shm_ibytes, algorithms.IALLREDUCE_SHM_BYTES = algorithms.IALLREDUCE_SHM_BYTES, 0
for overlap in (False, True):
    got, nb, picked, used = dp_grads("auto", overlap, True)
    assert nb > 3 and picked == {"shm"} and used, (nb, picked, used)
    for g, h in zip(got, ref):
        np.testing.assert_allclose(g, h, rtol=1e-12, atol=1e-15)
        same_everywhere(g, f"dp auto shm overlap={overlap}")
algorithms.IALLREDUCE_SHM_BYTES = shm_ibytes

# -- cma: sizes that differ across ranks, and a kernel that refuses the reads --------------------
if cma.available(c):
    try:
        c.allreduce(np.ones(10 + 2 * r), algorithm="cma")
        raise AssertionError("cma accepted different sizes")
    except ValueError as e:
        assert "passed" in str(e) and str(10 * 8) in str(e), e
saved_calls, cma._calls = cma._calls, False                  # as if process_vm_* were absent
refused = Communicator(c.comm.Dup(), CommStats(), "refused")
try:
    refused.allreduce(np.ones(4), algorithm="cma")
    raise AssertionError("cma ran without process_vm_readv/writev")
except ValueError as e:
    assert "permission to read and write" in str(e), e
assert "cma" not in algorithms.calibrate(refused, sizes=[1024], repeats=1)["times"]
algorithms.free(refused)
refused.comm.Free()
cma._calls = saved_calls

# -- free() keeps a shared allocation whose array is still alive on some rank ------------------
import gc  # noqa: E402
del z64, z32, flat, reqs, big, empty
gc.collect()
algorithms.free(c)                                          # nothing in use: all windows freed
kept = c.shared_zeros(1000, np.float64)
gone = c.shared_zeros(1000, np.float64)
view = kept[10:20] if r == 0 else None                      # alive on rank 0 only
del kept, gone
gc.collect()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    algorithms.free(c)
msgs = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
assert len(msgs) == 1 and "1 shared array(s) (8000 bytes per rank)" in msgs[0], msgs
if view is not None:
    view[:] = 7.0                                           # still mapped: usable
    assert view.sum() == 70.0
del view
gc.collect()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    algorithms.free(c)
assert not [w for w in caught if issubclass(w.category, ResourceWarning)]

algorithms.free(c)
if r == 0:
    print(f"allreduce_algos OK on {p} ranks")
