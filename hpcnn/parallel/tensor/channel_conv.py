"""Channel-parallel convolution, the block of :func:`hpcnn.parallel.tensor.factories.parallel_cnn`.

The output channels of a convolution are independent: in im2col form y = W cols + b with W of
shape (O, C k k), so splitting W's rows over tp is the column-parallel GEMM of Shoeybi et al. 2019
(arXiv:1909.08053, Sec. 3) with the output channels as the GEMM's output features. Rank r keeps
the channels [r O/tp, (r+1) O/tp) of the serial weight and bias (cut from the serial
:class:`~hpcnn.nn.conv.Conv2d`'s own initialisation, same keys), convolves the replicated input
with them (the serial im2col code, called on a local Conv2d), and all-gathers the output along
the channel axis, so every rank holds the full (N, O, Ho, Wo) and the layers after it (ReLU,
pooling, the MLP head) run replicated. Backward: this rank's channel slice of dy gives dW_r and
db_r; dx_r = col2im(W_r^T dy_r) is a partial sum over the ranks, allreduced (:class:`Copy`).

Per forward+backward on p ranks, under the counting convention of
:mod:`~hpcnn.parallel.collectives.comm`:
all-gather (p-1)/p |y| + allreduce 2(p-1)/p |x| bytes. FLOPs and parameters are 1/p of the serial
block's; the im2col matrix (the cache) is not: every rank builds it from the whole input.

    mpiexec -n 2 python -m mpi4py -c "import numpy as np; \\
        from hpcnn.parallel.collectives import world; \\
        from hpcnn.parallel.tensor.channel_conv import \\
        ChannelParallelConv2d; c = world(); \\
        conv = ChannelParallelConv2d(c, 3, 8, 3, padding=1, dtype=np.float64); \\
        print(conv.forward(np.ones((2, 3, 8, 8)))[0].shape, conv.spec((2, 3, 8, 8)).comm_bytes)"
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from hpcnn import backend
from hpcnn.nn.core import Block
from hpcnn.nn.conv import Conv2d
from hpcnn.parallel.tensor.linear import TPParameter, shard_array
from hpcnn.parallel.tensor.mappings import Copy, GatherLast, all_gather, check_divides, split


class GatherChannels(GatherLast):
    """:class:`~hpcnn.parallel.tensor.mappings.GatherLast` along the channel axis (1) of NCHW arrays.

    forward: (N, C/tp, H, W) -> (N, C, H, W), all-gather along the channels, rank order.
    backward: (N, C, H, W) -> (N, C/tp, H, W), this rank's channels of dy (every rank holds the
    same full dy, since everything after the gather is replicated). ``volume`` takes the gathered
    (full) size. The identity on one rank.
    """

    def forward(self, x):
        return (all_gather(self.comm, x, 1) if self.active else x), None    # (N, C, H, W)

    def backward(self, dy, cache):
        return split(self.comm, dy, 1) if self.active else dy              # (N, C/tp, H, W)


class ChannelParallelConvCache(NamedTuple):
    """The cache of :class:`ChannelParallelConv2d`: its three steps' caches."""
    c_in: Any           # self.enter's (None: a collective keeps nothing)
    c_conv: Any         # self.conv's Conv2dCache: the column matrix of the whole input
    c_out: Any          # self.gather's (None)


class ChannelParallelConv2d(Block):
    """:class:`~hpcnn.nn.conv.Conv2d` with its output channels split over tp.

    forward: x (N, C, H, W) replicated -> local convolution (N, O/tp, Ho, Wo) -> all-gathered
    (N, O, Ho, Wo) on every rank. backward: dy (N, O, Ho, Wo), the same on every rank -> this
    rank's channels give dW_r, db_r -> the partial dx (N, C, H, W) is summed over tp.
    Parameters ``weight`` (O/tp, C, k, k) and ``bias`` (O/tp,), both tp_axis 0, with the serial
    names. Cache: :class:`ChannelParallelConvCache` (the local Conv2d's holds the column matrix
    of the whole input).

    ``comm``: the tp :class:`~hpcnn.parallel.collectives.Communicator`; the other arguments are
    Conv2d's. ``out_ch`` not divisible by tp is a ValueError naming both numbers.
    """

    def __init__(self, comm, in_ch, out_ch, kernel, *, stride=1, padding=0, bias=True, seed=0,
                 index=0, dtype=backend.DEFAULT_DTYPE, name="conv", keep=None):
        super().__init__()
        check_divides(f"{name}: output channels", int(out_ch), comm.size)
        full = Conv2d(in_ch, out_ch, kernel, stride=stride, padding=padding, bias=bias, seed=seed,
                      index=index, dtype=dtype, name=name, keep=keep)   # the serial initialisation
        self._cut(comm, full)

    @classmethod
    def from_serial(cls, comm, conv: Conv2d) -> "ChannelParallelConv2d":
        """This rank's shard of an existing serial ``conv`` (its current values, copied)."""
        self = cls.__new__(cls)
        Block.__init__(self)
        self._cut(comm, conv)
        return self

    def _cut(self, comm, full: Conv2d) -> None:
        local = check_divides(f"{full.name}: output channels", full.out_ch, comm.size)
        def cut(p):                                                 # rows [r O/tp, (r+1) O/tp)
            return TPParameter(shard_array(p.data, 0, comm.rank, comm.size), p.name, tp_axis=0)
        w = cut(full.weight)                                        # (O/tp, C, k, k)
        b = cut(full.bias) if full.bias is not None else None       # (O/tp,)
        self.name, self.dtype, self.comm = full.name, full.dtype, comm
        self.in_ch, self.out_ch, self.kernel = full.in_ch, full.out_ch, full.kernel
        self.stride, self.padding = full.stride, full.padding
        conv = Conv2d(full.in_ch, local, full.kernel, stride=full.stride, padding=full.padding,
                      bias=b is not None, dtype=full.dtype, name=full.name)   # draw discarded
        conv.weight, conv.bias = w, b
        conv.params = [w] + ([b] if b is not None else [])
        self.conv, self.weight, self.bias, self.params = conv, w, b, conv.params
        self.enter = Copy(comm)                       # replicated x; backward: sum of partial dx
        self.gather = GatherChannels(comm)            # local channels -> all channels

    def forward(self, x):
        xin, c_in = self.enter.forward(x)             # (N, C, H, W) replicated
        y, c_conv = self.conv.forward(xin)            # (N, O/tp, Ho, Wo): y_r = W_r * x + b_r
        y, c_out = self.gather.forward(y)             # (N, O, Ho, Wo) on every rank
        return y, ChannelParallelConvCache(c_in=c_in, c_conv=c_conv, c_out=c_out)

    def backward(self, dy, cache):
        dyr = self.gather.backward(dy, cache.c_out)   # (N, O/tp, Ho, Wo) this rank's channels
        dx = self.conv.backward(dyr, cache.c_conv)    # (N, C, H, W) partial: from y_r = W_r * x
        return self.enter.backward(dx, cache.c_in)    # (N, C, H, W) summed over tp

    def spec(self, x_shape):
        """The local Conv2d's spec on the full input, with the gathered output and the bytes of
        one all-gather of y (forward) and one allreduce of dx (backward)."""
        p, dt = self.comm.size, self.dtype
        x_shape = tuple(x_shape)
        s = self.conv.spec(x_shape)                   # flops and parameters: 1/tp
        out = (s.out_shape[0], self.out_ch) + tuple(s.out_shape[2:])   # (N, O, Ho, Wo)
        vol = (self.enter.volume(backend.nbytes(x_shape, dt))
               + self.gather.volume(backend.nbytes(out, dt)))
        return replace(s, name=self.name, out_shape=out, bytes_y=backend.nbytes(out, dt),
                       comm_bytes=vol.sent(p))

    def __repr__(self) -> str:
        return (f"ChannelParallelConv2d({self.name}, {self.in_ch}->{self.out_ch}/tp="
                f"{self.out_ch // self.comm.size}, k={self.kernel}, tp={self.comm.size})")

