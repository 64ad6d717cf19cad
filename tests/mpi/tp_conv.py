"""Channel-parallel Conv2d and CNN against the serial ones (float64, 1e-10), tp = the world size.

    mpiexec -n 2 python -m mpi4py tests/mpi/tp_conv.py

Covers ChannelParallelConv2d for several kernel/stride/padding/bias variants (output, input
gradient and gathered parameter gradients equal to the serial Conv2d's; bytes counted during one
forward+backward equal ``spec().comm_bytes`` and the closed form), a few SGD steps of
``parallel_cnn`` on digits against ``models.cnn`` (max and average pooling; the replicated head
stays bitwise equal over the ranks), dp x tp = 2 x 2 on 4 ranks, and channel counts that tp does
not divide.
"""
import numpy as np
from mpi4py import MPI

from hpcnn import datasets as data
from hpcnn.nn import models
from hpcnn.nn.conv import Conv2d
from hpcnn.parallel.collectives import CommStats, Communicator
from hpcnn.parallel.tensor.linear import gather_params
from hpcnn.parallel.tensor.channel_conv import ChannelParallelConv2d
from hpcnn.parallel.tensor.factories import parallel_cnn

import sgd_loop  # noqa: E402 - tests/mpi/sgd_loop.py, beside this script

world = MPI.COMM_WORLD
r, P = world.Get_rank(), world.Get_size()
stats = CommStats()
comm = Communicator(world, stats, name="tp")
TOL = 1e-10
F64 = np.float64


def rand(shape, *key):
    return np.random.default_rng([7, *key]).standard_normal(shape)


def close(a, b, what, tol=TOL):
    d = float(np.abs(np.asarray(a) - np.asarray(b)).max()) if np.size(a) else 0.0
    assert np.shape(a) == np.shape(b) and d < tol, (what, np.shape(a), np.shape(b), d)


# -- the block against the serial Conv2d -----------------------------------------------------------
O = 8                                                   # divisible by 2 and 4
for i, (k, s, pad, bias) in enumerate([(3, 1, 1, True), (3, 2, 0, True), (2, 2, 1, False),
                                       (3, 2, 1, True), (1, 1, 0, True)]):
    what = f"conv k={k} s={s} p={pad} bias={bias}"
    kw = dict(stride=s, padding=pad, bias=bias, seed=3, index=i, dtype=F64, name="c")
    ser, par = Conv2d(3, O, k, **kw), ChannelParallelConv2d(comm, 3, O, k, **kw)
    d = gather_params(par, comm)                        # cut from the same initialisation
    assert list(d) == [p.name for p in ser.params], (what, list(d))
    for p in ser.params:
        assert np.array_equal(d[p.name], p.data), (what, p.name)
    if bias:                                            # non-zero, so the forward checks it
        b = rand(O, 1, i)
        ser.bias.data[...] = b
        par.bias.data[...] = b[r * O // P:(r + 1) * O // P]
    x = rand((2, 3, 7, 6), 2, i)
    y_s, c_s = ser.forward(x.copy())
    dy = rand(y_s.shape, 3, i)
    ser.zero_grad()
    dx_s = ser.backward(dy.copy(), c_s)
    par.zero_grad()
    stats.reset()
    y_p, c_p = par.forward(x.copy())
    dx_p = par.backward(dy.copy(), c_p)
    sent = stats.bytes_sent
    spec = par.spec(x.shape)
    assert sent == spec.comm_bytes == (P - 1) * y_s.nbytes // P + 2 * (P - 1) * x.nbytes // P, \
        (what, sent, spec.comm_bytes)
    assert spec.out_shape == y_s.shape and spec.flops_fwd * P == ser.spec(x.shape).flops_fwd
    close(y_p, y_s, f"{what}: output")
    close(dx_p, dx_s, f"{what}: input gradient")
    g = gather_params(par, comm, grads=True)
    for p in ser.params:
        close(g[p.name], p.grad, f"{what}: d{p.name}")


# -- parallel_cnn: SGD steps on digits against the serial cnn --------------------------------------
digits = world.bcast(data.digits(image=True) if r == 0 else None, root=0)   # sklearn once


def batch(step, n=32):
    idx = data.batch_indices(len(digits.y_train), n, step, seed=1)
    return digits.x_train[idx].astype(F64), digits.y_train[idx]


def sgd(model, steps, dp=None):
    return sgd_loop.sgd(model, steps, batch, lr=0.1, dp=dp)


STEPS, CH = 3, (8, 16)
for pool in ("max", "avg"):
    ckw = dict(pool=pool, seed=5, dtype=F64)
    serial = models.cnn(1, 8, CH, 24, 10, **ckw)
    ref_losses = sgd(serial, STEPS)
    ref = {p.name: p.data for p in serial.params}
    init = {p.name: p.data for p in models.cnn(1, 8, CH, 24, 10, **ckw).params}
    assert all(np.abs(ref[k] - init[k]).max() > 1e-4 for k in ref if "weight" in k), pool
    model = parallel_cnn(comm, 1, 8, CH, 24, 10, **ckw)
    close(sgd(model, STEPS), ref_losses, f"cnn {pool}: losses")
    got = gather_params(model, comm)
    assert list(got) == list(ref), list(got)
    for name in ref:
        close(got[name], ref[name], f"cnn {pool}: {name}")
    for p in model.params:                              # the replicated head stays identical
        if getattr(p, "tp_axis", None) is None:
            every = np.asarray(world.allgather(p.data))
            assert np.all(every == every[0]), (pool, p.name)
    x, y = batch(0)                                     # one step's bytes: the chain's spec
    stats.reset()
    model.zero_grad()
    model.backward(1.0, model.forward(x, y)[1], need_dx=False)
    want = sum(s.comm_bytes for s in model.spec(x.shape))
    assert stats.bytes_sent == want and (want > 0) == (P > 1), (pool, stats.bytes_sent, want)

# -- dp x tp = 2 x 2 -------------------------------------------------------------------------------
if P == 4:
    from hpcnn.parallel.data.bucketed import DataParallel
    from hpcnn.parallel.collectives.grid import ProcessGrid
    grid = ProcessGrid(world, dp=2, tp=2)
    tp2 = Communicator(grid.tp_comm, CommStats(), name="tp")
    serial = models.cnn(1, 8, CH, 24, 10, seed=5, dtype=F64)
    sgd(serial, STEPS)
    model = parallel_cnn(tp2, 1, 8, CH, 24, 10, seed=5, dtype=F64)
    dp = DataParallel(model, Communicator(grid.dp_comm, CommStats(), name="dp"),
                      bucket_mb=0.01, overlap=True)
    sgd(model, STEPS, dp=dp)
    got = gather_params(model, tp2)
    for p in serial.params:
        close(got[p.name], p.data, f"dp x tp: {p.name}")
    grid.free()

# -- channel counts tp does not divide: rejected with the numbers, on every rank -------------------
if P > 1:
    bad = [
        (lambda: ChannelParallelConv2d(comm, 3, 2 * P + 1, 3, name="c"),
         f"c: output channels ({2 * P + 1}) is not divisible by tp ({P})"),
        (lambda: parallel_cnn(comm, 1, 8, (4 * P, 4 * P + 2 - (P == 2))),
         f"conv1: output channels ({4 * P + 2 - (P == 2)}) is not divisible by tp ({P})"),
    ]
    for make, msg in bad:
        try:
            make()
            raise AssertionError(f"not rejected: {msg}")
        except ValueError as e:
            assert msg in str(e), (str(e), msg)

if r == 0:
    print(f"tp_conv OK on {P} ranks")
