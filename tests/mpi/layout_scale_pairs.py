"""calibrate.scale.layout_scale on 4 ranks: with curves over pairs the pair plans run too and the scale of
the collectives over pairs is fitted apart (group_scales), the same on every rank; without them,
no pair plan and no group scale."""
import math

from mpi4py import MPI

from hpcnn.plan.calibrate import layout_scale
from hpcnn.plan import machine

world = MPI.COMM_WORLD
p = world.Get_size()
curve = ((0.0, 8, 1e-4), (0.0, 1 << 20, 1e-3))
curves = {f"{kind}.{n}": curve for kind in ("allreduce", "alltoall") for n in (2, p)}
dev = machine.Device("d", {"float32": 1e10}, 1e10, 1e12)
m = machine.Machine("m", (machine.Level("node", p, 1e-5, ((math.inf, 1e9),),
                                        after_compute=curves),), dev)
c, k, own = layout_scale(world, m, plans=(("col", "col", "col"), ("rep", "rep", "rep")),
                         pair_plans=(("col", "k2", "k2r"),), steps=4, rounds=1, gpts=())
assert 0.1 <= c < 1e4 and 0.1 <= k < 1e4, (c, k)
assert [n for n, _ in own] == [2] and 0.1 <= own[0][1] < 1e4, own
assert len(set(map(repr, world.allgather((c, k, own))))) == 1
alone = machine.Machine("m", (machine.Level("node", p, 1e-5, ((math.inf, 1e9),), after_compute={
    key: v for key, v in curves.items() if key.endswith(f".{p}")}),), dev)
_, k2, own2 = layout_scale(world, alone, plans=(("col", "col", "col"), ("rep", "rep", "rep")),
                           pair_plans=(("col", "k2", "k2r"),), steps=4, rounds=1, gpts=())
assert 0.1 <= k2 < 1e4 and own2 == (), (k2, own2)
world.Barrier()
if world.Get_rank() == 0:
    print(f"layout_scale_pairs OK on {p} ranks")
