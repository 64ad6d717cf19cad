"""``hpcnn calibrate --write`` on the ranks of this job: every rank returns 0, rank 0 writes the
file, and the file read back has one level "node" of fan-out = ranks with sane positive figures.

    mpiexec -n 2 python -m mpi4py tests/mpi/machine_calibration.py TMPDIR
"""
import math
import os
import sys

from mpi4py import MPI

from hpcnn.cli_tools import cmd_calibrate
from hpcnn.plan import machine

world = MPI.COMM_WORLD
r, p = world.Get_rank(), world.Get_size()
path = os.path.join(sys.argv[1], "here.toml")

assert cmd_calibrate(["--write", path, "--rounds=3"]) == 0
world.Barrier()                                    # rank 0 has written the file
m = machine.load(path)
assert m.name == "here" and m.p == p, m
(node,) = m.levels
assert node.name == "node" and node.fanout == p
assert 0 < node.latency_s < 1e-2, node.latency_s           # seconds: microseconds expected
sizes = [b for b, _ in node.bandwidth]
assert sizes == [1 << 10, 1 << 16, 1 << 20, 1 << 24, math.inf], sizes
assert all(1e6 < rate < 1e12 for _, rate in node.bandwidth), node.bandwidth
assert node.message_seconds(1 << 20) > node.message_seconds(8) > 0
assert [b for b, _ in node.reduce_bandwidth][-1] == math.inf and len(node.reduce_bandwidth) == 5
assert all(1e6 < rate < 1e12 for _, rate in node.reduce_bandwidth), node.reduce_bandwidth
assert node.allreduce_seconds(1 << 20, p) > 0
assert all(1e8 < v < 1e14 for v in m.device.flops.values()) and len(m.device.flops) == 2
assert 1e8 < m.device.memory_bandwidth < 1e13 and m.device.memory_bytes > 1e8
assert all(0 < v <= 1 for v in m.device.efficiency.values()) and len(m.device.efficiency) == 2
# the blocks' kinds, and the stage pass ("stage") where it measured above the block's own time
assert all(1e-7 < v < 1e-1 for v in m.device.overhead.values())    # microseconds expected
assert set(m.device.overhead) - {"stage"} == {"transformer", "linear"}
assert all(0 <= v < 1e-6 for v in m.device.elementwise.values())
assert set(m.device.elementwise) == {"transformer", "linear", "held"}   # held: the step engine's
assert all(0 < v < 1 for v in m.device.forward.values())
assert set(m.device.forward) == set(m.device.overhead)
assert set(m.device.update) == {"adamw", "sgd"}                    # seconds per parameter
assert all(0 < s < 1e-6 for pieces in m.device.update.values() for _, s in pieces)
assert set(m.device.split) == {"transformer", "linear"}
assert all(0 < a < 2 and 0 < b < 2 for a, b in m.device.split.values())
assert set(m.device.activation) == {"linear"} and 0 <= m.device.activation["linear"] < 1e-6
with open(path) as f:
    text = f.read()
assert "ping-pong, all pairs at once" in text and "MPI allreduce (float32 sum" in text
# timed cold (after a copy) unless the node holds more ranks than cores
from hpcnn.plan.calibrate import cores_here  # noqa: E402
# the transformer's tokens slowdown only where each rank has a core, the linear kind's rows
# slowdown everywhere (calibrate.machine_file.machine_of)
assert set(m.device.tokens) == ({"transformer", "linear"} if p <= cores_here() else {"linear"})
for kind, pieces in m.device.tokens.items():  # the ladders: 64 .. 512 tokens, 32 .. 256 rows
    assert [t for t, _ in pieces] == ([64, 128, 256, 512, math.inf] if kind == "transformer"
                                      else [32, 64, 128, 256, math.inf]), pieces
    assert [f for _, f in pieces][-2:] == [1.0, 1.0] and all(0.2 < f < 10 for _, f in pieces)
assert text.count("# Cold (each call after a copy" if p <= cores_here() else
                  "# Back to back (more ranks than cores here)") == 1, text
# the handoff (a blocking exchange's wait for its peer's core) and the pipeline's fill and drain
# weight are measured only where ranks share cores; measured here anyway on one shape, finite,
# in range and the same on every rank
from hpcnn.plan.calibrate import handoff_points  # noqa: E402
assert ("# Handoff" in text) == (p > cores_here()) == bool(node.handoff), text
assert node.bubble_weight == (min(1.0, cores_here() / p) if node.handoff else 1.0), node
# a core per rank: the transformer's element-wise seconds slowed as the step engine's GPT, the
# others' as the copy; ranks sharing cores: by the blocks'
assert ("each block kind's figures by its reference blocks'" in text) == (p > cores_here()), text
assert ("the transformer element-wise seconds by the step engine's GPT x" in text) == (
    1 < p <= cores_here()), text
pts, w = handoff_points(world, m, 0.5, steps=5, shapes=((8, 2, 4, 1),), rounds=2)
assert len(pts) == 1 and 0 < pts[0][0] < 0.05 and 0 <= pts[0][1] < 0.05 and w == 0.5, (pts, w)
assert len({repr((pts, w)) for _ in [0]} | set(map(repr, world.allgather((pts, w))))) == 1
# the optimizer timed all ranks at once and the collectives after compute: recorded only where
# ranks share cores; measured here anyway on small settings, sane and the same on every rank
from hpcnn.plan.calibrate import after_compute_points, update_costs  # noqa: E402
shared = p > cores_here()
assert ("# Optimizer step all ranks at once" in text) == shared == bool(node.after_compute), text
pieces = update_costs("adamw", sizes=(64, 1024), repeats=2, comm=world)
assert [n for n, _ in pieces] == [64.0, 1024.0, math.inf] and all(0 < s < 1e-3 for _, s in pieces)
assert len(set(map(repr, world.allgather(pieces)))) == 1, pieces
curves = after_compute_points(world, sizes=(8, 1 << 12), matmuls=(1, 2), calls=2, rounds=1)
assert set(curves) == {f"{kind}.{q}" for kind in ("allreduce", "alltoall") for q in {2, p}
                       if p % q == 0}, curves
for rows in curves.values():
    assert len(rows) == 4 and all(0 < c < 1 and 0 <= t < 1 for c, _, t in rows), rows
    for c in {c for c, _, _ in rows}:
        curve = [(b, t) for cc, b, t in rows if cc == c]
        assert [b for b, _ in curve] == [8.0, 4096.0] and curve[0][1] <= curve[1][1], curve
assert len(set(map(repr, world.allgather(curves)))) == 1
lv = machine.Level("node", p, 1e-6, ((math.inf, 1e9),), after_compute=curves)
assert lv.collective_seconds("allreduce", p, 1024) >= 0
# the executor's collectives in training against those curves: reference MLPs through the engine
from dataclasses import replace  # noqa: E402
from hpcnn.plan.calibrate import layout_scale  # noqa: E402
with_curves = replace(m, levels=(replace(node, after_compute=curves),))
c, k, own = layout_scale(world, with_curves, plans=(("col", "col", "col"), ("rep", "rep", "rep")),
                         steps=5, rounds=1, gpts=((1, 32, 2, 16, 2),))
assert 0.1 <= c < 1e4 and 0.1 <= k < 1e4 and len(set(world.allgather((c, k)))) == 1, (c, k)
assert own == (), own                   # on 2 ranks the pairs are all ranks: one scale
assert ("collective_scale" in text) == (shared and node.collective_scale != 1), text
assert ("the device's seconds took" in text) == shared, text   # compute_scale where cores shared
# a directory that does not exist: refused on every rank, before any collective
assert cmd_calibrate([f"--write={os.path.join(sys.argv[1], 'no', 'x.toml')}"]) == 2
world.Barrier()
if r == 0:
    print(f"machine_calibration OK on {p} ranks")
