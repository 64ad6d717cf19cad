"""The run-time allreduce calibration: only the engine's sizes are timed, a saved file is reused
without timing anything, bad files are ignored with a note, every rank decides alike.

``algorithms.calibrate`` is wrapped to count its calls and the sizes it times: "no timing" is
asserted on that count, never on a clock. Prints the key's file name (the pytest side checks it
differs between rank counts).

    mpiexec -n 3 python -m mpi4py tests/mpi/calibration_cache.py TMPDIR
"""
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.log import read_run
from hpcnn.nn import models
from hpcnn.parallel.collectives import algorithms
from hpcnn.parallel.collectives import autotune as calibration
from hpcnn.parallel.collectives import shm
from hpcnn.parallel.collectives import CommStats, Communicator
from hpcnn.parallel.data.bucketed import DataParallel

world = MPI.COMM_WORLD
r, p = world.Get_rank(), world.Get_size()
tmp = sys.argv[1]
FILE = os.path.join(tmp, "calibration.json")
os.environ[calibration.ENV] = FILE

timed = []                                  # one list of sizes per calibrate call
_calibrate = algorithms.calibrate


def counting_calibrate(comm, sizes=None, *args, **kw):
    timed.append(list(sizes))
    return _calibrate(comm, sizes, *args, **kw)


algorithms.calibrate = counting_calibrate


def fresh():
    """A new communicator, as a new run would have (no table, no state)."""
    return Communicator(world, CommStats())


def same_everywhere(obj, what):
    assert world.allgather(obj) == [obj] * p, f"{what} differs across ranks"


def write(content):
    """Rank 0 writes ``content`` to the file; every rank waits for it."""
    if r == 0:
        with open(FILE, "w") as f:
            f.write(content)
    world.Barrier()


def saved():
    """The file as rank 0 left it (read on every rank once rank 0 is done)."""
    world.Barrier()
    with open(FILE) as f:
        return json.load(f)


# -- which sizes an engine asks for ------------------------------------------------------------
c = fresh()
model = models.mlp(24, (16, 12), 5, seed=2, dtype=np.float64)
dp = DataParallel(model, c, bucket_mb=600 / 2**20, algorithm="auto", overlap=False)
sizes = dp.auto_sizes()
assert sizes == sorted({b.view.nbytes for b in dp.buckets}) and len(sizes) == 2, sizes
assert dp.n_buckets > 3                     # many buckets, two distinct sizes: 600 B and the last
for kw in ({"algorithm": "auto", "overlap": True}, {"algorithm": "mpi", "overlap": False}):
    other = DataParallel(models.mlp(24, (16,), 5, seed=2), fresh(), bucket_mb=600 / 2**20, **kw)
    assert other.auto_sizes() == [], kw     # fixed thresholds / no auto: nothing to calibrate
    other.release()
# a bucket in the shared window from ZERO_COPY_BYTES takes shm whatever the table says
cb = fresh()
big = DataParallel(models.mlp(256, (600,), 10, seed=0), cb, bucket_mb=1.0, algorithm="auto",
                   overlap=False)
n_big = [b.view.nbytes for b in big.buckets]
assert len(n_big) == 1 and n_big[0] >= shm.ZERO_COPY_BYTES, n_big
assert big.auto_sizes() == ([] if algorithms.single_node(cb) else n_big)
big.release()

# -- no file: only the engine's sizes are timed, then saved ------------------------------------
info = calibration.for_run(c, sizes, np.float64)
assert timed == [sizes], timed
assert info["source"] == "measured" and info["measured"] == sizes and info["path"] == FILE, info
same_everywhere(c.allreduce_table, "measured table")
same_everywhere(info["choice"], "choice")
assert sorted(info["choice"]) == sizes and c.allreduce_table["sizes"] == sizes
key = calibration.key(c, np.float64)
doc = saved()
assert doc["key"] == key and doc["sizes"] == sizes, doc
assert list(doc["times"]) == key["algorithms"] == algorithms.available_algorithms(c)
first = c.allreduce_table
x = (r + 1) * np.arange(1000.0)             # the measured table drives auto correctly
c.allreduce(x, algorithm="auto")
assert np.array_equal(x, p * (p + 1) / 2 * np.arange(1000.0))
dp.release()
algorithms.free(c)

# -- a saved file: loaded, nothing timed, the same decision -------------------------------------
c = fresh()
info = calibration.for_run(c, sizes, np.float64)
assert timed == [sizes] and info["source"] == "file" and info["measured"] == [], (timed, info)
assert c.allreduce_table == first and info["notes"] == []
same_everywhere(c.allreduce_table, "loaded table")
# sizes within a factor of 2 of a saved one are covered; 1 MiB is not: timed alone, merged in
info = calibration.for_run(c, [sizes[0] + 1, 2 * sizes[1], 1 << 20], np.float64)
assert timed[1:] == [[1 << 20]] and info["source"] == "file+measured", (timed, info)
assert saved()["sizes"] == sizes + [1 << 20]
algorithms.free(c)

# -- files to ignore, with one note, never a crash ----------------------------------------------
bad_key = dict(key, ranks=p + 1)
for content, note in [("{not json", "unreadable"), ('{"format": "other"}', "not an hpcnn"),
                      (json.dumps(dict(doc, key=bad_key)), "made for another ranks"),
                      (json.dumps(dict(doc, sizes=doc["sizes"][:1])), "malformed")]:
    write(content)
    c = fresh()
    n_timed = len(timed)
    info = calibration.for_run(c, sizes, np.float64)
    assert len(timed) == n_timed + 1 and info["source"] == "measured", (content, info)
    if r == 0:
        assert len(info["notes"]) == 1 and note in info["notes"][0], (note, info["notes"])
        line = info["notes"][0]
        assert "\n" not in line and calibration.describe(info)[-1].endswith(line)
    same_everywhere(c.allreduce_table["choice"], f"table after a bad file ({note})")
    assert saved()["key"] == key                            # replaced by a good one
    algorithms.free(c)

# -- HPCNN_CALIBRATION=off: measured, nothing read or written --------------------------------
if r == 0:
    os.remove(FILE)
world.Barrier()
os.environ[calibration.ENV] = "off"
c = fresh()
info = calibration.for_run(c, sizes, np.float64)
assert info["source"] == "measured" and info["path"] is None and not os.path.exists(FILE)
assert "HPCNN_CALIBRATION=off" in calibration.describe(info)[0]
algorithms.free(c)
os.environ[calibration.ENV] = FILE

# -- the key: dtype and the number of ranks change it -------------------------------------------
key32 = calibration.key(c, np.float32)
assert key32 != key and key32["dtype"] == "float32"
sub = world.Split(0 if r == 0 else 1, r)
cs = Communicator(sub, CommStats())
ks = calibration.key(cs, np.float64)
assert ks["ranks"] == (1 if r == 0 else p - 1) and ks != key
algorithms.free(cs)
sub.Free()
os.environ.pop(calibration.ENV)
default = calibration.path_for(key)
os.environ[calibration.ENV] = FILE

# -- a training run: the second one loads what the first measured -------------------------------
from hpcnn.config import parse_overrides  # noqa: E402
from hpcnn.train import train  # noqa: E402


def run(name):
    cfg = parse_overrides([f"--log={os.path.join(tmp, name)}", "--progress=false", "--model=mlp",
                           "--hidden=16", "--steps=2", "--batch_size=12", "--overlap=false",
                           "--bucket_mb=0.004", "--dtype=float64", f"--dp={p}"])
    out = train(cfg, comm=world)
    plan = read_run(out["log"]).plan if r == 0 else None
    return out, world.bcast(plan)


n_timed = len(timed)
a, plan_a = run("a.h5")
b, plan_b = run("b.h5")
got_a, got_b = plan_a["allreduce_calibration"], plan_b["allreduce_calibration"]
assert got_a["source"] == "measured" and got_b["source"] == "file", (got_a, got_b)
assert len(timed) == n_timed + 1 and timed[-1] == got_a["sizes"] and len(got_a["sizes"]) == 2
assert got_b["path"] == FILE and got_a["choice"] == got_b["choice"]
for qa, qb in zip(a["model"].params, b["model"].params):
    assert np.array_equal(qa.data, qb.data)

algorithms.calibrate = _calibrate
if r == 0:
    print(f"key file {os.path.basename(default)}")
    print(f"calibration_cache OK on {p} ranks")
