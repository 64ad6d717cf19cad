"""Graph convolution (Kipf and Welling's GCN layer) on a row partition of the graph.

A GCN layer computes ``Z = Â (H W) + b`` (σ is a separate block, :class:`~hpcnn.nn.layers.ReLU`),
with ``Â = D̃^{-1/2} (A + I) D̃^{-1/2}`` (:func:`hpcnn.graph.normalized_adjacency`). Full-batch
and distributed by rows (:mod:`hpcnn.graph.rows`): rank r holds its rows of H, of Â and of Z.

Forward on rank r: ``P = H_r W`` (its rows only), then a **halo exchange** (one ``Alltoallv``)
brings the rows of P that r's rows of Â reference on other ranks, and ``Z_r = Â_r [P_r; P_ghost]``
(Â_r is r's local matrix, columns renumbered: own rows, then ghosts by owner).

Backward (Â is symmetric, but rank r holds rows, so the transpose product needs a reverse
exchange): ``[dP_r; dP_ghost] = Â_rᵀ dZ_r``; the ghost rows' gradients go back to their owners (one
``Alltoallv`` along the reversed lists) and are **added** to the owners' ``dP``; then
``dW += H_rᵀ dP_r`` (summed over ranks by the data-parallel gradient allreduce), ``db += Σ dZ_r``,
``dH_r = dP_r Wᵀ``. Each exchange moves ``width = n_out`` columns: per layer the ranks together
send ``Σ_r |send list of r| · n_out · itemsize`` bytes forward and as many backward
(:meth:`GraphOperator.halo_bytes`).

With one rank (``comm`` None or of size 1) Â_r is the whole Â and no exchange happens: the serial
GCN is the same code.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy

from hpcnn import backend
from hpcnn.nn.chain import Chain
from hpcnn.nn.core import Block, param_from_host
from hpcnn.nn.layers import Linear, LinearCache, ReLU
from hpcnn.nn.loss import CrossEntropyCache, SoftmaxCrossEntropy


class GraphOperator:
    """This rank's rows of Â (local matrix with halo columns) and the two halo exchanges.

    ``halo``: a :class:`hpcnn.graph.rows.Halo`; ``comm``: an hpcnn
    :class:`~hpcnn.parallel.collectives.Communicator` of the partition's ranks (its ``alltoallv``
    counts the bytes), or None for one process. Host (NumPy/SciPy) arrays only.
    """

    def __init__(self, halo, comm=None, dtype=backend.DEFAULT_DTYPE):
        self.halo, self.comm = halo, comm
        self.dtype = backend.dtype_of(dtype)
        self.matrix = halo.local.astype(self.dtype).tocsr()              # (n_local, n_local + g)
        self.matrix_t = self.matrix.T.tocsr()                            # for the backward
        self.distributed = comm is not None and comm.size > 1

    @classmethod
    def from_global(cls, a_hat, part=None, comm=None, dtype=backend.DEFAULT_DTYPE):
        """From the whole Â held on every rank, cut by ``part`` (contiguous rows by default)."""
        from hpcnn.graph.rows import RowPartition, build_halo
        size, rank = (1, 0) if comm is None else (comm.size, comm.rank)
        part = part or RowPartition.contiguous(a_hat.shape[0], size)
        if part.size != size:
            raise ValueError(f"GraphOperator: a partition of {part.size} ranks on {size} ranks")
        raw = comm.comm if comm is not None and size > 1 else None
        return cls(build_halo(a_hat, part, rank, raw), comm, dtype)

    @property
    def n_local(self) -> int:
        return self.halo.n_local

    @property
    def n_ghost(self) -> int:
        return int(self.halo.ghosts.size)

    def gather(self, p):
        """``[p; ghosts]`` (n_local + n_ghost, c): this rank's rows, then the halo rows received."""
        if not self.distributed:
            return p
        h, c = self.halo, p.shape[1]
        ext = numpy.empty((self.n_local + self.n_ghost, c), dtype=p.dtype)
        ext[: self.n_local] = p
        send = numpy.ascontiguousarray(p[h.send_index])                 # (Σ send, c)
        self.comm.alltoallv(send, h.send_counts * c, ext[self.n_local:], h.recv_counts * c)
        return ext

    def scatter_add(self, d_ext):
        """The reverse of :meth:`gather`: this rank's rows of ``d_ext`` plus the ghost rows the
        other ranks computed for rows owned here (sent back along the reversed lists)."""
        if not self.distributed:
            return d_ext
        h, c = self.halo, d_ext.shape[1]
        d = d_ext[: self.n_local].copy()
        back = numpy.empty((int(h.send_counts.sum()), c), dtype=d_ext.dtype)
        self.comm.alltoallv(numpy.ascontiguousarray(d_ext[self.n_local:]), h.recv_counts * c,
                            back, h.send_counts * c)
        numpy.add.at(d, h.send_index, back)           # a row may be a ghost of several ranks
        return d

    def halo_bytes(self, width: int) -> tuple[int, int]:
        """(forward, backward) bytes this rank sends in one layer's exchanges of ``width``
        columns: its send list's rows, then its ghost rows (0 on one rank)."""
        if not self.distributed:
            return 0, 0
        item = self.dtype.itemsize * int(width)
        return int(self.halo.send_counts.sum()) * item, self.n_ghost * item


class GraphConvCache(NamedTuple):
    """The cache of the product ``P = X W``: the input rows (n_local, in), for ``dW = Xᵀ dP``."""
    c_lin: LinearCache


class GraphConv(Block):
    """``Z = Â (X W) + b`` on this rank's rows (see the module docstring); W of shape (in, out).

    ``op``: the :class:`GraphOperator` (the whole Â for a serial model). ``X W`` is a
    :class:`~hpcnn.nn.layers.Linear` without bias (named like the block: parameters
    ``{name}.weight``, ``{name}.bias``; Glorot initial values keyed by seed and index, so a model
    is the same on any number of ranks), whose weight gradient can be deferred
    (``backward(dz, cache, defer=pending)``, as a Linear's). The bias is added after the
    aggregation (Â's rows do not sum to 1). Cache: :class:`GraphConvCache`.
    """

    defers_weights = True

    def __init__(self, op: GraphOperator, n_in, n_out, *, bias=True, seed=0, index=0,
                 dtype=backend.DEFAULT_DTYPE, name="gcn", keep=None):
        super().__init__()
        self.op, self.name, self.n_in, self.n_out = op, name, int(n_in), int(n_out)
        self.dtype = backend.dtype_of(dtype)
        if op.dtype != self.dtype:
            raise ValueError(f"{name}: operator in {op.dtype}, block in {self.dtype}")
        self.lin = Linear(n_in, n_out, bias=False, seed=seed, index=index, dtype=dtype,
                          init_std=(2.0 / (n_in + n_out)) ** 0.5, name=name, keep=keep)
        self.params = list(self.lin.params)
        self.bias = None
        if bias:
            self.bias = param_from_host(numpy.zeros(n_out), self.dtype, f"{name}.bias", keep=keep)
            self.params.append(self.bias)

    def forward(self, x):
        if backend.xp is not numpy:        # Â is a scipy.sparse matrix in host memory
            raise NotImplementedError(f"{self.name}: graph convolution runs on the CPU only "
                                      f"(a host scipy.sparse Â), not on device "
                                      f"{backend.device!r}")
        if x.ndim != 2 or x.shape != (self.op.n_local, self.n_in):
            raise ValueError(f"{self.name}: input of shape {x.shape}, expected this rank's "
                             f"{self.op.n_local} rows of {self.n_in} features")
        p, c_lin = self.lin.forward(x)                              # P_r = X_r W (n_local, out)
        z = self.op.matrix @ self.op.gather(p)                      # Z_r = Â_r [P_r; P_ghost]
        if self.bias is not None:
            z += self.bias.data
        return z, GraphConvCache(c_lin=c_lin)

    def backward(self, dz, cache, defer=None):
        """From Z_r = Â_r [P_r; P_ghost] + b: [dP_r; dP_ghost] = Â_rᵀ dZ_r, the ghost rows
        returned to and added on their owners, db += Σ dZ_r; then P = X W's backward."""
        dp = self.op.scatter_add(self.op.matrix_t @ dz)             # (n_local, out)
        if self.bias is not None:
            self.bias.add_grad(dz.sum(axis=0))
        return self.lin.backward(dp, cache.c_lin, defer=defer)

    def spec(self, x_shape):
        lin = self.lin.spec(x_shape)
        spmm = 2.0 * self.op.matrix.nnz * self.n_out
        bias = lin.bytes_y // self.dtype.itemsize if self.bias is not None else 0
        return replace(lin, name=self.name, flops_fwd=lin.flops_fwd + spmm + bias,
                       flops_bwd=lin.flops_bwd + spmm + bias,
                       bytes_params=sum(backend.nbytes(p.shape, self.dtype) for p in self.params),
                       comm_bytes=sum(self.op.halo_bytes(self.n_out)))


class NodeLossCache(NamedTuple):
    """The cross-entropy's cache over this rank's rows and the factor applied to its sum."""
    xent: CrossEntropyCache
    scale: float


class NodeLoss(SoftmaxCrossEntropy):
    """Mean cross-entropy over the training nodes of the whole graph, from one rank's rows.

    Targets are the labels on training nodes and ``ignore_index`` (-1) elsewhere. The training
    loop weighs each rank's loss and gradient by its rows' share ``n_r / n_nodes`` (as it weighs a
    data-parallel replica's share of a batch, :func:`hpcnn.parallel.data.bucketed.dloss_for`); this loss
    returns its rows' cross-entropy sum times ``n_nodes / (n_r · n_train)``, so that the weighted
    sum over ranks is ``Σ_train CE / n_train`` and so is the gradient. Cache: :class:`NodeLossCache`.
    """

    name = "node_xent"

    def __init__(self, n_nodes: int, n_train: int, ignore_index: int = -1):
        if not 1 <= n_train <= n_nodes:
            raise ValueError(f"NodeLoss: need 1 <= n_train={n_train} <= n_nodes={n_nodes}")
        super().__init__(ignore_index=ignore_index, reduction="sum")
        self.n_nodes, self.n_train = int(n_nodes), int(n_train)

    def forward(self, logits, targets):
        total, cache = super().forward(logits, targets)
        scale = self.n_nodes / (max(int(logits.shape[0]), 1) * self.n_train)
        return total * scale, NodeLossCache(xent=cache, scale=scale)

    def backward(self, dloss, cache):
        return super().backward(dloss * cache.scale, cache.xent)


def gcn(op: GraphOperator, n_in: int, hidden=(16,), n_out: int = 2, *, n_train: int,
        n_nodes: int, seed: int = 0, dtype=backend.DEFAULT_DTYPE, keep=None):
    """GraphConv -> ReLU -> ... -> GraphConv, then :class:`NodeLoss` (one block per layer and
    activation, like :func:`hpcnn.nn.models.mlp`)."""
    dims = [int(n_in), *[int(h) for h in hidden], int(n_out)]
    blocks = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        blocks.append(GraphConv(op, a, b, seed=seed, index=len(blocks), dtype=dtype,
                                name=f"gcn{i}", keep=keep))
        if i < len(dims) - 2:
            blocks.append(ReLU(dtype=dtype))
    return Chain(blocks, NodeLoss(n_nodes, n_train), name="gcn")
