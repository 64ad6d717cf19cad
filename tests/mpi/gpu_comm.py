"""--gpu_comm under the strict device backend, on 2 ranks.

``collectives``: each path's allreduce, iallreduce, allgather and reduce_scatter of device
arrays equal the sums of NumPy; staged makes exactly the transfers a path through host memory
needs (one copy out of what is sent, one copy back of what is received), mpi and nccl none;
nccl runs its calls (over the test double tests/mpi/nccl_double.py) with the buffers' pointers
and sizes, NCCL's datatype codes, the unique id rank 0 made and broadcast, on the path's own
stream, and makes no host synchronisation.
``train``: dp=2 and tp=2 GPT runs under each path equal the NumPy run bit for bit; the
collectives make no host transfer under mpi and nccl, and the staged run differs from the mpi
run by exactly its collectives' transfers.

    mpiexec -n 2 python -m mpi4py tests/mpi/gpu_comm.py TMPDIR collectives train
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import nccl_double
from hpcnn import backend, strict
from hpcnn.config import parse_overrides
from hpcnn.parallel.collectives import Communicator, algorithms, comm as comm_mod
from hpcnn.parallel.collectives import device_paths, gpu, mpi_base
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp, cases = sys.argv[1], sys.argv[2:]


class Counting:
    """The backend as the collectives modules see it, counting their transfers."""

    def __init__(self):
        self.n = {"to_host": 0, "to_device": 0}

    def __getattr__(self, name):
        return getattr(backend, name)

    def to_host(self, a):
        self.n["to_host"] += type(a) is strict.StrictArray
        return backend.to_host(a)

    def to_device(self, a):
        self.n["to_device"] += 1
        return backend.to_device(a)


COUNT = Counting()
for mod in (mpi_base, comm_mod, algorithms, device_paths):
    mod.backend = COUNT


def attach(mode):
    c = Communicator(world.Dup(), name="dp")
    gpu.attach({"gpu_comm": mode, "cuda_aware": (mode == "mpi", "test")}, [c])
    return c


def check_collectives(mode):
    backend.set_device("strict")
    c = attach(mode)
    xp, base = backend.xp, np.arange(12.0)
    for k in COUNT.n:
        COUNT.n[k] = 0
    backend.strict_stats(reset=True)
    a = backend.to_device(base + rank)
    c.allreduce(a)
    b = backend.to_device(base * (rank + 1))
    c.iallreduce(b).wait()
    g = xp.empty((2 * p, 3))
    c.allgather(backend.to_device(np.full((2, 3), float(rank))), g)
    r = xp.empty((6 // p,))
    c.reduce_scatter(backend.to_device(np.arange(6.0) * (rank + 1)), r)
    got = backend.strict_stats()
    expect = {"staged": {"to_host": 4, "to_device": 4}, "mpi": {"to_host": 0, "to_device": 0},
              "nccl": {"to_host": 0, "to_device": 0}}[mode]
    assert COUNT.n == expect, (mode, COUNT.n)
    assert got["to_device"] == 4 + COUNT.n["to_device"], (mode, got)     # the 4 inputs
    if mode == "nccl":
        assert got["sync"] == 0, got                   # the host never waits for NCCL
    s = p * (p - 1) / 2
    np.testing.assert_array_equal(backend.to_host(a), p * base + s)
    np.testing.assert_array_equal(backend.to_host(b), base * p * (p + 1) / 2)
    np.testing.assert_array_equal(backend.to_host(g), np.repeat(np.arange(p), 2)[:, None]
                                  * np.ones((1, 3)))
    np.testing.assert_array_equal(backend.to_host(r), (np.arange(6.0) * p * (p + 1) / 2)
                                  .reshape(p, -1)[rank])
    if mode == "nccl":
        check_nccl_calls(c.device_path, a, b)
    gpu.detach({"gpu_comm": mode}, [c])
    c.free()
    backend.set_device("cpu")


def check_nccl_calls(path, a, b):
    calls = [x for x in nccl_double.CALLS if x[0] != "init"]
    assert [x[0] for x in calls] == ["allReduce", "allReduce", "allGather", "reduceScatter"], \
        calls
    assert calls[0][1:5] == (a.data.ptr, a.data.ptr, a.size, nccl_double.NCCL_FLOAT64), calls[0]
    assert calls[1][1:5] == (b.data.ptr, b.data.ptr, b.size, nccl_double.NCCL_FLOAT64), calls[1]
    assert calls[2][3] == 6 and calls[3][3] == 6 // p, calls      # elements a rank
    assert all(x[-1] == path.stream.ptr != 0 for x in calls), calls   # its own stream
    assert len(nccl_double.UIDS) == (1 if rank == 0 else 0), nccl_double.UIDS
    nccl_double.CALLS.clear()


GPT = ["--progress=false", "--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2",
       "--block_size=8", "--batch_size=8", "--n_layers=2", "--steps=3", "--log_interval=3",
       "--eval_interval=3", "--eval_batches=2", "--optimizer=adamw", f"--pad_vocab={p}",
       "--dtype=float64"]


def run(layout, device, mode="auto"):
    for k in COUNT.n:
        COUNT.n[k] = 0
    backend.strict_stats(reset=True)
    log = os.path.join(tmp, f"{layout}-{device}-{mode}.h5")
    out = train(parse_overrides([f"--log={log}", f"--device={device}", f"--gpu_comm={mode}",
                                 *GPT, f"--{layout}={p}"]), comm=world)
    backend.set_device("cpu")
    moved = sum(backend.strict_stats()[k] for k in ("to_host", "to_device"))
    return out["model"].params, sum(COUNT.n.values()), moved


def check_train():
    for layout in ("dp", "tp"):
        ref, _, _ = run(layout, "cpu")
        moved = {}
        for mode in ("staged", "mpi", "nccl"):
            params, comm_moved, moved[mode] = run(layout, "strict", mode)
            for a, q in zip(ref, params):
                np.testing.assert_array_equal(backend.to_host(q.data), a.data,
                                              err_msg=f"{layout} {mode} {a.name}")
            assert (comm_moved > 0) == (mode == "staged"), (layout, mode, comm_moved)
            if mode == "staged":
                staged_comm = comm_moved
            if mode == "nccl":                     # the run's reductions went through NCCL
                assert any(x[0] == "allReduce" for x in nccl_double.CALLS), layout
                nccl_double.CALLS.clear()
        assert moved["staged"] - staged_comm == moved["mpi"] == moved["nccl"], (moved,
                                                                                staged_comm)
        if rank == 0:
            print(f"gpu_comm {layout}={p} OK (staged: {staged_comm} transfers by the "
                  f"collectives; mpi, nccl: 0)", flush=True)


strict.cuda.nccl = nccl_double              # the test double, for --gpu_comm=nccl
os.environ["HPCNN_STRICT_DEVICES"] = str(p)  # a device a rank (binding: test_gpu.py)
os.environ["HPCNN_CUDA_AWARE"] = "1"        # (for --gpu_comm=mpi: the declared CUDA-aware MPI)
for case in cases:
    if case == "collectives":
        for mode in ("staged", "mpi", "nccl"):
            check_collectives(mode)
        if rank == 0:
            print("gpu_comm collectives OK", flush=True)
    elif case == "train":
        check_train()
