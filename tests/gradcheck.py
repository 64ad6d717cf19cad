"""Finite-difference checks of a block's input and parameter gradients (float64)."""
from __future__ import annotations

import numpy as np


def _loss_and_weights(y, rng):
    """A random linear functional L = sum(w * y) so every output element matters."""
    w = rng.standard_normal(y.shape)
    return float(np.sum(w * y)), w


def check_block_gradients(block, x, *, eps=1e-6, rtol=1e-5, atol=1e-7, seed=0,
                          check_input=True, max_entries=40):
    """Compare ``block.backward`` with central differences of L(x) = sum(w * forward(x)).

    ``x`` is float64 (or integer token ids, then only parameters are checked). At most
    ``max_entries`` randomly chosen entries of each array are perturbed, to keep tests fast.
    Raises AssertionError naming the tensor and the worst entry.
    """
    assert x.flags.c_contiguous, "x must be C-contiguous (entries are perturbed in place)"
    rng = np.random.default_rng(seed)
    state = block.rng_state()
    y, cache = block.forward(x)
    _, w = _loss_and_weights(np.asarray(y), rng)
    for p in block.params:
        p.grad[...] = 0
    dx = block.backward(w.copy(), cache)

    def loss_at():
        block.set_rng_state(state)
        yy, _ = block.forward(x)
        return float(np.sum(w * yy))

    targets = []
    if check_input and np.issubdtype(np.asarray(x).dtype, np.floating):
        assert dx is not None and dx.shape == x.shape, (dx is None or dx.shape, x.shape)
        targets.append(("input", x, dx))
    for p in block.params:
        targets.append((p.name, p.data, p.grad.copy()))
    for name, arr, analytic in targets:
        flat = arr.reshape(-1)
        idx = rng.choice(flat.size, size=min(max_entries, flat.size), replace=False)
        for i in idx:
            old = flat[i]
            flat[i] = old + eps
            lp = loss_at()
            flat[i] = old - eps
            lm = loss_at()
            flat[i] = old
            numeric = (lp - lm) / (2 * eps)
            a = analytic.reshape(-1)[i]
            assert abs(a - numeric) <= atol + rtol * max(abs(a), abs(numeric)), \
                f"{type(block).__name__} d/d{name}[{i}]: analytic {a!r} vs numeric {numeric!r}"
    block.set_rng_state(state)
    return dx
