"""The naive data-parallel twin against the bucketed engine and the serial run (float64).

    mpiexec -n 3 python -m mpi4py tests/mpi/dp_naive.py

For an MLP and a small GPT, unequal shares of one global batch, with micro-batches or not, the
gradients of :class:`NaiveDataParallel` (one allreduce per parameter after the backward) equal
those of :class:`DataParallel` (buckets that cut parameters, overlap on and off) to 1e-12, and the
serial full-batch gradient to 1e-10. The naive engine makes exactly one allreduce per parameter.
"""
import numpy as np
from mpi4py import MPI

from hpcnn import datasets as data
from hpcnn.nn import models
from hpcnn.parallel.collectives import CommStats, Communicator
from hpcnn.parallel.data.bucketed import DataParallel, dloss_for, shard
from hpcnn.parallel.data.naive import NaiveDataParallel

world = MPI.COMM_WORLD
r, P = world.Get_rank(), world.Get_size()
stats = CommStats()
comm = Communicator(world, stats, name="dp")
TINY = 256 / 2 ** 20          # 32 float64 per bucket: cuts every weight matrix

digits = data.digits()
text = data.shakespeare(fallback=True)


def make(kind):
    if kind == "mlp":
        return models.mlp(64, (32, 16), 10, seed=3, dtype=np.float64)
    return models.gpt(text.vocab, 16, 2, 32, 4, dropout=0.0, seed=3, dtype=np.float64)


def batch(kind, total):
    if kind == "mlp":
        idx = data.batch_indices(len(digits.y_train), total, 0, seed=1)
        return digits.x_train[idx].astype(np.float64), digits.y_train[idx]
    return data.text_batch(text.train, total, 16, 0, seed=1)


def grads(model):
    return [p.grad.copy() for p in model.params]


def maxdiff(a, b):
    return max(float(np.abs(g - h).max()) for g, h in zip(a, b))


def serial(kind, total):
    """The reference gradient: one process, the whole global batch, the mean loss."""
    model = make(kind)
    x, y = batch(kind, total)
    model.zero_grad()
    _, caches = model.forward(x, y)
    model.backward(1.0, caches, need_dx=False)
    return grads(model)


def run(engine, kind, shares, micro):
    """One step's reduced gradients on this rank: its shard in ``micro`` micro-batches."""
    x, y = batch(kind, sum(shares))
    xs, ys = shard(x, shares, r), shard(y, shares, r)
    engine.zero_grad()
    parts = np.array_split(np.arange(shares[r]), min(micro, shares[r]))
    for k, part in enumerate(parts):
        _, caches = engine.model.forward(xs[part], ys[part])
        engine.backward(dloss_for("weighted", len(part), shares, local=shares[r]), caches,
                        sync=k == len(parts) - 1)
    if isinstance(engine, DataParallel):
        engine.finish(0)
    return grads(engine.model)


unequal = [1 + i % 3 for i in range(P)]          # [1, 2] on 2 ranks, [1, 2, 3] on 3
for kind, total in (("mlp", 16), ("gpt", 8)):
    shares = list(unequal)
    shares[-1] += total - sum(shares)
    ref = serial(kind, total)
    for micro in (1, 2):
        model = make(kind)
        naive = NaiveDataParallel(model, comm)
        stats.reset()
        g_naive = run(naive, kind, shares, micro)
        assert stats.calls["allreduce"] == len(naive.params), (dict(stats.calls), naive)
        d = maxdiff(g_naive, ref)
        assert d < 1e-10, (kind, micro, "naive vs serial", d)
        for overlap in (True, False):
            dp = DataParallel(make(kind), comm, bucket_mb=TINY, overlap=overlap)
            g_dp = run(dp, kind, shares, micro)
            d = maxdiff(g_naive, g_dp)
            assert d < 1e-12, (kind, micro, overlap, "naive vs bucketed", d)
            dp.release()

if r == 0:
    print(f"dp_naive OK on {P} ranks")
