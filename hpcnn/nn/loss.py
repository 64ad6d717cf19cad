"""Softmax cross-entropy, the last stage of every classification chain."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy

from hpcnn import backend
from hpcnn.nn.core import BlockSpec


def checked_targets(logits_shape, targets, vocab: int, ignore_index: int):
    """Flat targets with ignored entries set to 0, and the mask of counted rows: ``(tt, valid)``,
    both (N,). Raises ValueError on a shape mismatch or an id outside [0, vocab) (that one on
    host arrays only: see :func:`hpcnn.nn.transformer.check_tokens`)."""
    xp = backend.xp
    if tuple(targets.shape) != tuple(logits_shape[:-1]):
        raise ValueError(f"targets shape {targets.shape} != logits shape without the last "
                         f"dimension {tuple(logits_shape[:-1])}")
    t = targets.reshape(-1)
    valid = t != ignore_index
    tt = xp.where(valid, t, 0)
    if tt.size and isinstance(tt, numpy.ndarray) and (int(tt.min()) < 0 or int(tt.max()) >= vocab):
        raise ValueError(f"targets must lie in [0, {vocab}) or equal ignore_index "
                         f"{ignore_index}; got range [{int(tt.min())}, {int(tt.max())}]")
    return tt, valid


def mean_loss(nll, valid, reduction: str):
    """(loss, count): the sum of ``nll`` (N,) over the counted rows ``valid`` (N,), in float64,
    divided by their count unless ``reduction`` is "sum", and the count; Python numbers on
    NumPy, device scalars on a device (:func:`hpcnn.backend.lazy`: no host round-trip in the
    step)."""
    count = valid.sum()
    total = (nll * valid).sum().astype(numpy.float64)     # as float() made it on the host
    loss = total if reduction == "sum" else total / backend.xp.maximum(count, 1)
    return backend.lazy(loss, float), backend.lazy(count, int)


class CrossEntropyCache(NamedTuple):
    """What the loss backward needs, per row of the flattened logits (N = rows)."""
    probs: Any          # (N, V) softmax probabilities
    tt: Any             # (N,) targets, ignored ones set to 0
    valid: Any          # (N,) bool: the row counts
    count: Any          # number of counted rows (an int; a device scalar on a device)
    shape: tuple        # the logits' shape (..., V)


class SoftmaxCrossEntropy:
    """Mean over the batch of -log softmax(logits)[target], skipping ``ignore_index`` targets.

    ``forward(logits, targets) -> (loss, cache)`` with logits ``(..., V)`` and integer targets
    ``(...)``; ``backward(dloss, cache) -> dlogits``. Numerically stable: the row maximum is
    subtracted before exponentiating. Cache: :class:`CrossEntropyCache`, the softmax
    probabilities, the targets, the mask of counted rows and their number. ``reduction="sum"``
    returns the sum instead of the mean (data parallelism with unequal shares combines sums).
    """

    name = "xent"

    def __init__(self, ignore_index: int = -100, reduction: str = "mean"):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.ignore_index, self.reduction = int(ignore_index), reduction
        self.params = []                     # no parameters (an own list: never shared)

    def forward(self, logits, targets):
        xp = backend.xp
        V = logits.shape[-1]
        tt, valid = checked_targets(logits.shape, targets, V, self.ignore_index)   # (N,)
        z = backend.up(logits.reshape(-1, V))                      # (N, V), 16-bit: in fp32
        zmax = z.max(axis=1, keepdims=True)
        probs = xp.exp(z - zmax)                                   # (N, V) exp, then p
        s = probs.sum(axis=1, keepdims=True)
        rows = xp.arange(z.shape[0])
        # -log p[t] = log(sum exp(z - zmax)) - (z[t] - zmax)
        nll = xp.log(s[:, 0]) - (z[rows, tt] - zmax[:, 0])
        loss, count = mean_loss(nll, valid, self.reduction)
        probs /= s                                                 # probabilities, in place
        probs = backend.down(probs, logits.dtype)                  # kept as the logits are
        return loss, CrossEntropyCache(probs=probs, tt=tt, valid=valid, count=count,
                                       shape=tuple(logits.shape))

    def backward(self, dloss, cache):
        """dlogits = (softmax - onehot(target)) * dloss / count on counted rows, 0 elsewhere."""
        d = backend.up(cache.probs)                                # (N, V) in the compute dtype
        d = d.copy() if d is cache.probs else d
        d[backend.xp.arange(d.shape[0]), cache.tt] -= 1.0
        scale = dloss if self.reduction == "sum" else dloss / backend.xp.maximum(cache.count, 1)
        d *= (cache.valid * scale).astype(d.dtype)[:, None]
        return backend.down(d, cache.probs.dtype).reshape(cache.shape)

    def spec(self, x_shape, dtype=backend.DEFAULT_DTYPE):
        """The cache is the probabilities, the flat targets (int64 assumed) and the row mask."""
        nb = backend.nbytes(x_shape, dtype)
        n = nb // backend.dtype_of(dtype).itemsize
        rows = n // max(int(x_shape[-1]), 1) if len(x_shape) else 0
        return BlockSpec(name=self.name, in_shape=tuple(x_shape), out_shape=(), flops_fwd=5 * n,
                         flops_bwd=3 * n, bytes_x=nb, bytes_y=8, bytes_cache=nb + 9 * rows,
                         bytes_params=0)
