"""Channel-parallel convolution: tp = 1 against the serial blocks and finite differences, byte
formulas and errors serially; equivalence with Conv2d and the CNN under mpiexec (tp = 2, 4)."""
import numpy as np
import pytest

from gradcheck import check_block_gradients
from hpcnn.nn import models
from hpcnn.nn.conv import Conv2d
from hpcnn.parallel.tensor.linear import gather_params
from hpcnn.parallel.tensor.channel_conv import ChannelParallelConv2d
from hpcnn.parallel.tensor.factories import parallel_cnn
from mpi_util import run_mpi
from mpi_util import single
from test_tensor_parallel import sized

F64 = np.float64
GEOMETRY = [(3, 1, 1), (3, 2, 0), (2, 2, 1)]           # (kernel, stride, padding)


def _x(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


# -- one rank: the serial block, the collectives bypassed ------------------------------------------
@pytest.mark.parametrize("kernel,stride,padding", GEOMETRY)
def test_tp1_conv_equals_serial(kernel, stride, padding):
    c = single()
    kw = dict(stride=stride, padding=padding, seed=2, index=3, dtype=F64)
    ser, par = Conv2d(3, 4, kernel, **kw), ChannelParallelConv2d(c, 3, 4, kernel, **kw)
    x = _x((2, 3, 7, 6))
    (ys, cs), (yp, cp) = ser.forward(x), par.forward(x)
    np.testing.assert_array_equal(yp, ys)
    dy = _x(ys.shape, seed=2)
    np.testing.assert_array_equal(par.backward(dy.copy(), cp), ser.backward(dy.copy(), cs))
    g = gather_params(par, c, grads=True)
    for p in ser.params:
        np.testing.assert_array_equal(g[p.name], p.grad)
    assert c.stats.bytes_sent == 0 and par.spec(x.shape).comm_bytes == 0


@pytest.mark.parametrize("kernel,stride,padding", GEOMETRY)
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_finite_differences(kernel, stride, padding, bias):
    blk = ChannelParallelConv2d(single(), 3, 4, kernel, stride=stride, padding=padding,
                                bias=bias, seed=4, dtype=F64)
    if bias:
        blk.bias.data[...] = _x(4, seed=5)
    check_block_gradients(blk, _x((2, 3, 7, 6)), max_entries=12)


def test_tp1_cnn_equals_serial():
    c = single()
    ser = models.cnn(1, 8, (4, 8), 16, 10, seed=2, dtype=F64)
    par = parallel_cnn(c, 1, 8, (4, 8), 16, 10, seed=2, dtype=F64)
    assert [type(b).__name__ for b in par.blocks][:4] == ["ChannelParallelConv2d", "ReLU",
                                                          "MaxPool2d", "ChannelParallelConv2d"]
    x, t = _x((5, 1, 8, 8)), np.arange(5)
    losses = []
    for m in (ser, par):
        m.zero_grad()
        loss, caches = m.forward(x, t)
        m.backward(1.0, caches, need_dx=False)
        losses.append(loss)
    assert losses[0] == losses[1]
    g = gather_params(par, c, grads=True)
    assert list(g) == [p.name for p in ser.params]
    for p in ser.params:
        np.testing.assert_array_equal(g[p.name], p.grad)


# -- cost formulas ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4])
def test_spec_one_allgather_one_allreduce(p):
    """Forward all-gather of y, (p-1)/p |y|; backward allreduce of dx, 2(p-1)/p |x|; FLOPs and
    parameters 1/p of the serial block's, the im2col cache not."""
    x_shape = (4, 3, 8, 8)
    ser = Conv2d(3, 8, 3, padding=1, dtype=F64).spec(x_shape)
    par = ChannelParallelConv2d(sized(p), 3, 8, 3, padding=1, dtype=F64).spec(x_shape)
    y_nb, x_nb = 4 * 8 * 8 * 8 * 8, 4 * 3 * 8 * 8 * 8
    assert par.comm_bytes == (p - 1) * y_nb // p + 2 * (p - 1) * x_nb // p
    assert par.out_shape == ser.out_shape and par.bytes_y == ser.bytes_y == y_nb
    assert par.flops_fwd == ser.flops_fwd / p and par.flops_bwd == ser.flops_bwd / p
    assert par.bytes_params == ser.bytes_params / p and par.bytes_cache == ser.bytes_cache


@pytest.mark.parametrize("make, msg", [
    (lambda c: ChannelParallelConv2d(c, 3, 8, 3, name="c0"),
     r"c0: output channels \(8\) is not divisible by tp \(3\)"),
    (lambda c: parallel_cnn(c, 1, 8, (6, 8)),
     r"conv1: output channels \(8\) is not divisible by tp \(3\)"),
    (lambda c: ChannelParallelConv2d(c, 3, 6, 3, stride=0),
     r"need kernel >= 1, stride >= 1, padding >= 0; got kernel=3, stride=0"),
    (lambda c: parallel_cnn(c, 1, 6, (3, 6)), r"image side 6 is not divisible by 2\*\*2"),
])
def test_bad_dimensions(make, msg):
    with pytest.raises(ValueError, match=msg):
        make(sized(3, rank=1))


# -- many ranks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long)])
def test_tp_conv_mpi(n):
    assert f"tp_conv OK on {n} ranks" in run_mpi("tp_conv", n, timeout=120)
