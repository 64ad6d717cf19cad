"""Emulated nodes (HPCNN_NODES) and the two-level collectives over them.

Run with HPCNN_NODES=k set (k nodes of consecutive ranks): the node map, what a rank sees of its
node (shared memory only inside it), every algorithm that runs across nodes against closed-form
sums (blocking and not, every dtype, odd sizes), bitwise identical on every rank on random data
too, ``hier``'s two levels and ``auto`` choosing it, and the data-parallel engine with ``hier``
equal to ``mpi`` to rounding.

    HPCNN_NODES=2 mpiexec -n 4 python -m mpi4py tests/mpi/emulated_nodes.py
"""
import os

import numpy as np
from mpi4py import MPI

from hpcnn.parallel.collectives import Communicator, algorithms, hier, shm, topology

world = MPI.COMM_WORLD
r, p = world.Get_rank(), world.Get_size()
k = int(os.environ["HPCNN_NODES"])
q = p // k
c = Communicator(world)


from sums import pattern, same_everywhere  # noqa: E402


# -- the nodes: consecutive ranks, q a node; shared memory only inside one ------------------------
nodes = topology.node_map(world)
assert nodes == [i // q for i in range(p)], nodes
assert topology.describe(nodes) == f"{k} nodes x {q} ranks (emulated)"
# the hardware's groups are the real ones, emulation or not: one machine shares its memory
assert topology.hw_map(world, "mpi_shared_memory") in (None, [0] * p)
assert c.ranks_on_node() == q
assert shm.node_of(c) is None and not algorithms.single_node(c)
node = Communicator(world.Split(r // q, r))             # one emulated node: shm inside it
assert algorithms.single_node(node) and node.ranks_on_node() == q
levels = hier.levels_of(c)
assert levels is not None and levels.q == q and levels.rail.size == k
assert levels.node.Get_size() == q and levels.rail.rank == r // q

# -- every algorithm across nodes, closed-form sums -------------------------------------------
ACROSS = [a for a in algorithms.ALGORITHMS if a not in ("shm", "cma")]
for dtype in (np.float64, np.float32, np.int64):
    for n in sorted({0, 1, 7, q - 1, q + 1, p + 1, 1000, 100003}):
        want = p * (p + 1) // 2 * pattern(n, dtype)
        for alg in ACROSS:
            a = (r + 1) * pattern(n, dtype)
            c.allreduce(a, algorithm=alg)
            np.testing.assert_array_equal(a, want, err_msg=f"{alg} n={n} {dtype.__name__}")
            same_everywhere(a, f"{alg} n={n}")
        for alg in [a for a in algorithms.NONBLOCKING if a != "shm"]:
            a = (r + 1) * pattern(n, dtype)
            req = c.iallreduce(a, algorithm=alg)
            while not req.test():
                pass
            req.wait()
            np.testing.assert_array_equal(a, want, err_msg=f"i{alg} n={n} {dtype.__name__}")

# -- random data: hier bitwise the same on every rank, blocking or not; mpi's to rounding ---------
rng = np.random.default_rng(r)
for dtype, rtol in ((np.float64, 1e-12), (np.float32, 1e-4)):
    x = rng.standard_normal((37, 271)).astype(dtype)
    ref = x.copy()
    c.allreduce(ref, algorithm="mpi")
    a, b = x.copy(), x.copy()
    c.allreduce(a, algorithm="hier")
    c.iallreduce(b, algorithm="hier").wait()
    np.testing.assert_allclose(a, ref, rtol=rtol, atol=rtol * 10)
    same_everywhere(a, f"random hier {dtype.__name__}")
    assert np.array_equal(a, b), "blocking and non-blocking hier differ"
# several in flight, tested in a rank-dependent order
bufs = [(r + 1) * pattern(n, np.float64) for n in (100003, 5, 40000, 1)]
reqs = [c.iallreduce(b, algorithm="hier") for b in bufs]
while not all([x.test() for x in (reqs if r % 2 else reqs[::-1])]):
    pass
for b, n in zip(bufs, (100003, 5, 40000, 1)):
    np.testing.assert_array_equal(b, p * (p + 1) // 2 * pattern(n, np.float64))

# started one after another with a rank-dependent number of test() calls between (so a later
# request's first step starts before or after an earlier one's last, differently on each rank)
pokes = np.random.default_rng(100 + r)
for round_ in range(20):
    bufs, reqs = [], []
    for i, n in enumerate((3000, 70001, 1, 20000, 9)):
        bufs.append((r + 1) * pattern(n, np.float64))
        reqs.append(c.iallreduce(bufs[-1], algorithm="hier"))
        for _ in range(int(pokes.integers(0, 4))):
            for x in reqs:
                x.test()
    for x in reqs[::-1] if r % 2 else reqs:
        x.wait()
    for b, n in zip(bufs, (3000, 70001, 1, 20000, 9)):
        np.testing.assert_array_equal(b, p * (p + 1) // 2 * pattern(n, np.float64))
        same_everywhere(b, f"interleaved hier n={n}")

# -- the parts' collectives (ZeRO's) in two levels: the library's results, bitwise, for uneven
# parts with empty ones, blocking and non-blocking, several in flight ------------------------
assert levels.consecutive
for trial, n in enumerate((1, 5, 1000, 30001)):
    cuts = np.sort(np.random.default_rng(trial).integers(0, n + 1, p - 1))
    counts = np.diff(np.concatenate([[0], cuts, [n]])).astype(int).tolist()
    x = rng.standard_normal(n)
    want, got = np.empty(counts[r]), np.empty(counts[r])
    c.ireduce_scatter_parts(x, want, counts).wait()
    c.ireduce_scatter_parts(x, got, counts, "hier").wait()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    full = np.empty(n)
    world.Allgatherv(got, [full, counts])
    mine = np.zeros(n)
    mine[sum(counts[:r]):sum(counts[:r + 1])] = got
    a = mine.copy()
    c.allgather_parts(a, counts, "hier")
    assert np.array_equal(a, full), f"hier allgather_parts n={n}"
    same_everywhere(a, f"hier allgather_parts n={n}")
bufs = [np.arange(n, dtype=np.float64) * (r + 1) for n in (7, 4000, 1, 999)]
parts = [np.diff([n * i // p for i in range(p + 1)]).tolist() for n in (7, 4000, 1, 999)]
outs = [np.empty(cs[r]) for cs in parts]
reqs = [c.ireduce_scatter_parts(b, o, cs, "hier") for b, o, cs in zip(bufs, outs, parts)]
gathered = [(r + 1.0) * np.arange(n) for n in (7, 4000, 1, 999)]
reqs += [c.iallgather_parts(g, cs, "hier") for g, cs in zip(gathered, parts)]
while not all([x.test() for x in (reqs if r % 2 else reqs[::-1])]):
    pass
for n, o, cs, g in zip((7, 4000, 1, 999), outs, parts, gathered):
    lo = sum(cs[:r])
    np.testing.assert_array_equal(o, p * (p + 1) / 2 * np.arange(n)[lo:lo + cs[r]])
    owner = np.repeat(np.arange(p), cs) + 1.0
    np.testing.assert_array_equal(g, owner * np.arange(n))

# -- auto: the library below the default table's bound, hier above (blocking and not) -----------
assert algorithms.default_table(c) is algorithms.DEFAULT_HIER_TABLE
assert algorithms.choose(c, 1 << 10) == "mpi" and algorithms.choose(c, 64 << 20) == "hier"
assert algorithms.choose_nonblocking(c, 1 << 10) == "mpi"
assert algorithms.choose_nonblocking(c, 8 << 20) == "hier"

# -- the data-parallel engine: hier's gradients are mpi's to rounding -----------------------------
from hpcnn.nn import models  # noqa: E402
from hpcnn.parallel.data.bucketed import DataParallel  # noqa: E402

x = np.random.default_rng(7).standard_normal((4 * p, 8))
y = np.arange(4 * p) % 4
grads = {}
for alg in ("mpi", "hier"):
    model = models.mlp(8, (32, 32), 4, dtype=np.float64)
    dp = DataParallel(model, c, bucket_mb=2e-3, algorithm=alg)
    model.zero_grad()
    _, caches = model.forward(x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])
    dp.backward(1.0 / p, caches)
    dp.finish(0)
    grads[alg] = np.concatenate([g.grad.reshape(-1) for g in model.params])
    same_everywhere(grads[alg], f"dp {alg} gradients")
    dp.release()
assert np.abs(grads["mpi"] - grads["hier"]).max() < 1e-12

algorithms.free(node)
node.free()
algorithms.free(c)
world.Barrier()
if r == 0:
    print(f"emulated_nodes OK on {p} ranks ({k} nodes)", flush=True)
