"""Grid rank order and the named collectives against closed-form results (any world size)."""
import pickle

import numpy as np
from mpi4py import MPI

from hpcnn.parallel.collectives import CommStats, Communicator
from hpcnn.parallel.collectives.stats import SAMPLE_EVERY, SAMPLED_BELOW
from hpcnn.parallel.collectives.grid import GridError, ProcessGrid, coords_of, rank_of

world = MPI.COMM_WORLD
r, p = world.Get_rank(), world.Get_size()

# -- grid: every factorisation of p ----------------------------------------------------------
for dp in range(1, p + 1):
    for tp in range(1, p + 1):
        if p % (dp * tp):
            continue
        pp = p // (dp * tp)
        g = ProcessGrid(world, dp, tp, pp)
        assert (g.dp_rank, g.tp_rank, g.pp_rank) == coords_of(r, dp, tp, pp)
        assert r == g.tp_rank + tp * (g.dp_rank + dp * g.pp_rank)
        for axis, comm, idx in (("tp", g.tp_comm, g.tp_rank), ("dp", g.dp_comm, g.dp_rank),
                                ("pp", g.pp_comm, g.pp_rank)):
            members = comm.allgather(r)
            assert members == g.group(axis), (axis, members, g.group(axis))
            assert comm.Get_rank() == idx
        if g.pp_rank > 0:
            assert g.prev_stage == rank_of(g.dp_rank, g.tp_rank, g.pp_rank - 1, dp, tp, pp)
        else:
            assert g.prev_stage == MPI.PROC_NULL and g.pp_prev == MPI.PROC_NULL
        if g.pp_rank == pp - 1:
            assert g.next_stage == MPI.PROC_NULL
        assert str(g) == f"TP({g.tp_rank}/{tp})-DP({g.dp_rank}/{dp})-PP({g.pp_rank}/{pp})-Rank({r}/{p})"
        g.free()
        try:
            g.dp_comm
            raise AssertionError("use after free not detected")
        except RuntimeError as e:
            assert "after free" in str(e)

# a size that does not factor: same error on every rank, before any collective
try:
    ProcessGrid(world, p + 1, 1, 1)
    raise AssertionError("bad layout accepted")
except GridError as e:
    assert f"world size ({p}) != dp*tp*pp ({p + 1}*1*1 = {p + 1})" in str(e), e

# -- collectives ----------------------------------------------------------------------------
stats = CommStats()
c = Communicator(world, stats)
a = np.full(5, float(r))
c.allreduce(a)
assert np.all(a == p * (p - 1) / 2), a                     # sum of range(p)
assert stats.bytes["allreduce"] == 2 * (p - 1) * 40 // p

send = np.arange(3 * p, dtype=np.float64) + r              # p blocks of 3
recv = np.empty(3)
c.reduce_scatter(send, recv)
np.testing.assert_array_equal(recv, p * (np.arange(3) + 3 * r) + p * (p - 1) / 2)

mine = np.full(2, r, dtype=np.int64)
allv = np.empty(2 * p, dtype=np.int64)
c.allgather(mine, allv)
np.testing.assert_array_equal(allv, np.repeat(np.arange(p), 2))

b = np.arange(4.0) if r == 0 else np.zeros(4)
c.bcast(b)
np.testing.assert_array_equal(b, np.arange(4.0))

req = c.iallreduce(np.ones(7) * (r + 1))
req.wait()
assert req.done

s = c.allreduce_scalars([r, 1.0])
assert s[0] == p * (p - 1) / 2 and s[1] == p
assert c.allreduce_scalars([r], "max")[0] == p - 1
g2 = c.allgather_scalars([r, 2 * r])
np.testing.assert_array_equal(g2, np.c_[np.arange(p), 2 * np.arange(p)])

# ring shift with sendrecv
out = np.array([float(r)])
got = np.empty(1)
c.sendrecv(out, (r + 1) % p, got, (r - 1) % p)
assert got[0] == (r - 1) % p

# small library allreduces: calls and bytes exact, seconds sampled (one call in SAMPLE_EVERY timed)
s2 = CommStats()
c2 = Communicator(world, s2)
small = np.ones(16)
for _ in range(2 * SAMPLE_EVERY):
    c2.allreduce(small)
assert s2.calls["allreduce"] == 2 * SAMPLE_EVERY
assert s2.bytes["allreduce"] == 2 * SAMPLE_EVERY * 2 * (p - 1) * small.nbytes // p
assert s2.seconds["allreduce"] > 0.0
big = np.ones(SAMPLED_BELOW // 8)                      # at the threshold: every call timed
c2.allreduce(big)
assert s2.calls["allreduce"] == 2 * SAMPLE_EVERY + 1

# small picklable objects: every rank's in rank order, root's only, root's everywhere; counted
# bytes are the pickled sizes under the buffer collectives' conventions
so = CommStats()
co = Communicator(world, so, "objects")
mine = {"rank": r, "tag": "x" * r}
assert co.allgather_objects(mine) == [{"rank": q, "tag": "x" * q} for q in range(p)]
root = p - 1
got = co.gather_objects((r, r * r), root=root)
assert got == ([(q, q * q) for q in range(p)] if r == root else None), got
assert co.bcast_object(f"from {r}", root=root) == f"from {root}"
size = len(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL))
assert so.bytes["allgather_objects"] == size * (p - 1)
assert so.bytes["gather_objects"] == (0 if r == root else
                                      len(pickle.dumps((r, r * r), pickle.HIGHEST_PROTOCOL)))
assert so.bytes["bcast_object"] == (len(pickle.dumps(f"from {r}", pickle.HIGHEST_PROTOCOL))
                                    if r == root else 0)
assert all(so.calls[op] == 1 for op in ("allgather_objects", "gather_objects", "bcast_object"))
try:
    co.bcast_object(1, root=p)
    raise AssertionError("bad root not refused")
except ValueError as e:
    assert f"root {p} is not a rank of objects (size {p})" in str(e)

if r == 0:
    print(f"grid_collectives OK on {p} ranks")
