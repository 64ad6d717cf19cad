"""The plain twins against their fast paths (float64).

    mpiexec -n 3 python -m mpi4py tests/mpi/plain_twins.py

Ring (any p): :func:`hpcnn.parallel.collectives.plain_ring.allreduce` gives bit-for-bit what
``Communicator.allreduce(buf, algorithm="ring")`` gives (the same order of additions), on sizes
0, 1, below p, not divisible by p and large enough for several ring segments, float64 and
float32 random data and int64, and the library's ``MPI_Allreduce`` to 1e-12 relative.

Pipeline (p = 2 or 3): :func:`hpcnn.engine.plain_pipeline.train_step` against
:func:`hpcnn.engine.pipelined.train_step` with the same schedule (gpipe, 1f1b), for an MLP on
digits and a small GPT, uniform and uneven stages, 1, 2 and 4 micro-batches of uneven sizes:
every local gradient and the loss to 1e-12 relative (the backwards run in the same order, so
they come out bitwise equal; the OK line counts them).
"""
import numpy as np
from mpi4py import MPI

from hpcnn import datasets as data
from hpcnn.engine import plain_pipeline
from hpcnn.nn import models
from hpcnn.engine import pipelined as pipeline
from hpcnn.parallel.collectives import Communicator, plain_ring

world = MPI.COMM_WORLD
r, P = world.Get_rank(), world.Get_size()
comm = Communicator(world, name="pp")
TOL = 1e-12


def rel(a, b) -> float:
    scale = max(float(np.abs(b).max()), 1e-300) if np.size(b) else 1.0
    return float(np.abs(np.asarray(a) - np.asarray(b)).max()) / scale if np.size(b) else 0.0


def check_ring():
    rng = np.random.default_rng(10 + r)
    sizes = sorted({0, 1, P - 1, P + 1, 7 * P + 2, 1000, 300001})   # 300001: several segments
    cases = 0
    for dtype in (np.float64, np.float32, np.int64):
        for n in sizes:
            a = (rng.standard_normal(n) * 1e3).astype(dtype)
            fast, plain, lib = a.copy(), a.copy(), a.copy()
            comm.allreduce(fast, algorithm="ring")
            assert plain_ring.allreduce(comm, plain) is plain
            world.Allreduce(MPI.IN_PLACE, lib, op=MPI.SUM)
            tag = f"ring n={n} {np.dtype(dtype).name} on {P} ranks"
            assert np.array_equal(plain.view(np.uint8), fast.view(np.uint8)), tag
            if dtype is np.float32:
                assert rel(plain, lib) < 1e-5, tag
            else:
                assert rel(plain, lib) < TOL, tag
            cases += 1
    shaped = np.arange(2 * 3 * 5, dtype=np.float64).reshape(2, 3, 5) * (r + 1)
    plain_ring.allreduce(comm, shaped)                      # any C-contiguous shape
    assert np.array_equal(shaped, np.arange(30.0).reshape(2, 3, 5) * (P * (P + 1) // 2))
    return cases


digits = data.digits()
text = data.shakespeare(fallback=True)
BATCH = {"mlp": 10, "gpt": 6}                  # 4 micro-batches: sizes 3,3,2,2 and 2,2,1,1
LAYOUTS = {("mlp", 2): [None, "2|5"], ("mlp", 3): [None, "2|3|2"],
           ("gpt", 2): [None, "5|3"], ("gpt", 3): [None, "2|4|2"]}


def make(kind):
    if kind == "mlp":
        return models.mlp(64, (32, 32, 32), 10, seed=3, dtype=np.float64)
    return models.gpt(text.vocab, 8, 5, 16, 2, dropout=0.0, seed=3, dtype=np.float64)


def batch(kind):
    if kind == "mlp":
        idx = data.batch_indices(len(digits.y_train), BATCH[kind], 0, seed=1)
        return digits.x_train[idx].astype(np.float64), digits.y_train[idx]
    return data.text_batch(text.train, BATCH[kind], 8, 0, seed=1)


def check_pipeline():
    runs = bitwise = total = 0
    for kind in ("mlp", "gpt"):
        x, y = batch(kind)
        for name in ("gpipe", "1f1b"):
            for layout in LAYOUTS[(kind, P)]:
                for M in (1, 2, 4):
                    tag = f"{kind} {name} layout={layout} M={M} on {P} ranks"
                    fast = pipeline.train_step(name, make(kind), comm, x, y, M, layout=layout)
                    stage, loss = plain_pipeline.train_step(name, make(kind), comm, x, y, M,
                                                            layout=layout)
                    (st,) = fast["stages"]
                    assert len(st.chain.params) == len(stage.params) > 0, tag
                    for p, q in zip(stage.params, st.chain.params):
                        assert p.name == q.name and rel(p.grad, q.grad) < TOL, (tag, p.name)
                        bitwise += bool(np.array_equal(p.grad, q.grad))
                        total += 1
                    if r == P - 1:
                        assert abs(loss - fast["loss"]) <= TOL * abs(fast["loss"]), tag
                    else:
                        assert loss is None, tag
                    runs += 1
    return runs, bitwise, total


ring_cases = check_ring()
pp_runs, same, total = check_pipeline() if P in (2, 3) else (0, 0, 0)
if r == 0:
    print(f"plain_twins OK on {P} ranks: ring {ring_cases} cases bitwise equal, "
          f"pipeline {pp_runs} steps ({same} of {total} gradients bitwise equal on rank 0)")
