"""The chain profile the rotor solver reads: per stage times and sizes, from the blocks' ``spec()``.

A chain of blocks (and its loss, the last stage) is seen as stages ``i = 0 .. n-1``; stage i maps
``x[i] -> x[i+1]``. In the notation of Beaumont et al. (ACM TOMS, arXiv 1911.13214), per stage:

    uf[i], ub[i]   forward / backward time (seconds)
    wx[i]          bytes of the input x[i]             (i = 0 .. n; wx[n] is the chain's output)
    wbar[i+1]      bytes of x̄[i+1] = x[i+1] and everything stage i's backward needs besides x[i]
    wd[i]          bytes of the gradient δ[i] = dL/dx[i] (0 for integer tokens and the loss value)
    of[i], ob[i]   transient bytes inside forward / backward beyond their results

Sizes come from :class:`~hpcnn.nn.core.BlockSpec`: the cache's arrays that *are* x[i] or x[i+1]
(``cache_has_x`` / ``cache_has_y``) are counted once, so wbar[i+1] = bytes_y + bytes_cache_own.
A block whose output is a view of its input (Flatten, Dropout with p = 0) is counted as if it
owned it, an over-estimate. Times are a roofline model by default (``flops / rate + traffic /
bandwidth``, rates calibrated at run time, :func:`calibrate`) or measured (:func:`measure`).
Transients are 0 in the spec model and measured with ``tracemalloc`` by :func:`measure` (NumPy).
"""
from __future__ import annotations

import math
import time
import tracemalloc
from dataclasses import dataclass, replace

import numpy

from hpcnn import backend as B


@dataclass(frozen=True)
class ChainProfile:
    """Per-stage costs of a chain (see the module docstring); arrays of float64 / int64."""

    names: tuple
    uf: numpy.ndarray
    ub: numpy.ndarray
    wx: numpy.ndarray
    wbar: numpy.ndarray
    wd: numpy.ndarray
    of: numpy.ndarray
    ob: numpy.ndarray

    def __post_init__(self):
        n = len(self.names)
        for name, want in (("uf", n), ("ub", n), ("of", n), ("ob", n),
                           ("wx", n + 1), ("wbar", n + 1), ("wd", n + 1)):
            got = len(getattr(self, name))
            if got != want:
                raise ValueError(f"ChainProfile.{name} has {got} entries, expected {want} "
                                 f"for {n} stages")

    def __len__(self) -> int:
        return len(self.names)

    @property
    def store_all_time(self) -> float:
        return float(self.uf.sum() + self.ub.sum())

    def store_all_bytes(self) -> int:
        """Peak of the plain forward-then-backward (every x̄ kept), input included."""
        from hpcnn.memory.simulate import simulate
        from hpcnn.memory.sequence import store_all
        return simulate(store_all(len(self)), self).peak

    def slots(self, slot_bytes: float) -> "ChainProfile":
        """The same profile with sizes in slots of ``slot_bytes`` (rounded up: never optimistic)."""
        if not slot_bytes > 0:
            raise ValueError(f"slot size must be > 0 bytes, got {slot_bytes}")

        def up(a):
            return numpy.ceil(numpy.asarray(a, dtype=numpy.float64) / slot_bytes).astype(numpy.int64)
        return replace(self, wx=up(self.wx), wbar=up(self.wbar), wd=up(self.wd),
                       of=up(self.of), ob=up(self.ob))

    def scaled(self, start: int, stop: int) -> "ChainProfile":
        """Stages [start, stop) as a profile of their own."""
        return ChainProfile(self.names[start:stop], self.uf[start:stop], self.ub[start:stop],
                            self.wx[start:stop + 1], self.wbar[start:stop + 1],
                            self.wd[start:stop + 1], self.of[start:stop], self.ob[start:stop])


@dataclass(frozen=True)
class Rates:
    """Throughputs for the roofline time model: FLOP/s of matmul-like work, bytes/s of memory."""

    flops: float = 50e9
    bandwidth: float = 20e9


def calibrate(dtype=B.DEFAULT_DTYPE, n: int = 512, repeats: int = 3) -> Rates:
    """Measure this process's matmul rate and copy bandwidth (a fraction of a second)."""
    xp = B.xp
    a = xp.ones((n, n), dtype=dtype)
    big = xp.ones(1 << 22, dtype=dtype)
    out = xp.empty_like(big)

    def best(fn):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            B.sync()
            ts.append(time.perf_counter() - t0)
        return min(ts)
    flops = 2.0 * n ** 3 / best(lambda: a @ a)
    bandwidth = 2.0 * big.nbytes / best(lambda: xp.copyto(out, big))
    return Rates(flops=flops, bandwidth=bandwidth)


def _sizes(specs, has_loss: bool, need_dx: bool):
    n = len(specs)
    wx = numpy.zeros(n + 1, dtype=numpy.int64)
    wbar = numpy.zeros(n + 1, dtype=numpy.int64)
    wd = numpy.zeros(n + 1, dtype=numpy.int64)
    for i, s in enumerate(specs):
        wx[i] = s.bytes_x
        wd[i] = s.bytes_x
        wbar[i + 1] = s.bytes_cache_own + (0 if has_loss and i == n - 1 else s.bytes_y)
    wx[n] = 0 if has_loss else specs[-1].bytes_y
    wd[n] = 0 if has_loss else specs[-1].bytes_y
    if not need_dx:
        wd[0] = 0
    return wx, wbar, wd


def from_specs(specs, *, has_loss: bool = True, need_dx: bool = True, rates: Rates | None = None,
               int_input: bool = False) -> ChainProfile:
    """Profile from a list of BlockSpecs (the chain's ``spec(x_shape)``, loss last if ``has_loss``).

    ``need_dx=False`` (or ``int_input``, token ids) makes δ[0] free: nobody needs dL/dx[0].
    Times: ``flops / rates.flops + traffic / rates.bandwidth`` with forward traffic x + y + own
    cache and backward traffic dy + dx + cache + 2 x parameters (read W, write its gradient).
    """
    rates = rates or Rates()
    specs = list(specs)
    if not specs:
        raise ValueError("a chain profile needs at least one stage")
    wx, wbar, wd = _sizes(specs, has_loss, need_dx and not int_input)
    uf = numpy.array([s.flops_fwd / rates.flops
                      + (s.bytes_x + s.bytes_y + s.bytes_cache_own) / rates.bandwidth
                      for s in specs])
    ub = numpy.array([s.flops_bwd / rates.flops
                      + (s.bytes_y + s.bytes_x + s.bytes_cache + 2 * s.bytes_params)
                      / rates.bandwidth for s in specs])
    zeros = numpy.zeros(len(specs), dtype=numpy.int64)
    return ChainProfile(tuple(s.name for s in specs), uf, ub, wx, wbar, wd, zeros, zeros.copy())


def of_chain(chain, x_shape, *, need_dx: bool = True, rates: Rates | None = None) -> ChainProfile:
    """:func:`from_specs` of ``chain.spec(x_shape)`` (integer token input detected from block 0)."""
    specs = chain.spec(x_shape)
    int_input = bool(specs[0].cache_has_x and specs[0].bytes_x and
                     type(chain.blocks[0]).__name__.endswith("Embedding"))
    return from_specs(specs, has_loss=chain.loss is not None, need_dx=need_dx, rates=rates,
                      int_input=int_input)


def measure(chain, x, targets=None, *, need_dx: bool = True, repeats: int = 3) -> ChainProfile:
    """Profile with measured times (mean of ``repeats`` after a warm-up) and transients (``tracemalloc``, NumPy).

    Sizes stay those of the specs (they are exact for the blocks of :mod:`hpcnn.nn`); a block's
    transient is its traced peak minus what it returns and keeps, never negative.
    """
    base = of_chain(chain, x.shape, need_dx=need_dx)
    n = len(base)
    uf, ub = numpy.zeros(n), numpy.zeros(n)
    of, ob = numpy.zeros(n, dtype=numpy.int64), numpy.zeros(n, dtype=numpy.int64)
    stages = list(chain.blocks) + ([chain.loss] if chain.loss is not None else [])
    states = chain.rng_state()
    trace = B.xp is numpy and not tracemalloc.is_tracing()
    if trace:
        tracemalloc.start()
    try:
        for r in range(repeats):
            xs, caches, cur = [], [], x
            for i, st in enumerate(stages):
                xs.append(cur)
                t0 = time.perf_counter()
                if trace:
                    tracemalloc.reset_peak()
                out = st.forward(cur, targets) if i == n - 1 and chain.loss is not None \
                    else st.forward(cur)
                B.sync()
                uf[i] += _mean_add(r, repeats, time.perf_counter() - t0)
                if trace:
                    cur_mem, peak = tracemalloc.get_traced_memory()
                    of[i] = max(of[i], peak - cur_mem)
                cur, c = out
                caches.append(c)
            dy = 1.0 if chain.loss is not None else B.xp.ones_like(cur)
            for i in range(n - 1, -1, -1):
                t0 = time.perf_counter()
                if trace:
                    tracemalloc.reset_peak()
                    start = tracemalloc.get_traced_memory()[0]
                dy = stages[i].backward(dy, caches[i])
                B.sync()
                ub[i] += _mean_add(r, repeats, time.perf_counter() - t0)
                if trace:
                    peak = tracemalloc.get_traced_memory()[1]
                    ob[i] = max(ob[i], peak - start - (dy.nbytes if dy is not None else 0))
                caches[i] = None
            chain.set_rng_state(states)
    finally:
        if trace:
            tracemalloc.stop()
        chain.zero_grad()
    return replace(base, uf=uf, ub=ub, of=of, ob=ob)


def _mean_add(r, repeats, dt):
    """Times are averaged over the repeats after the first (warm-up) when there are several."""
    if repeats == 1:
        return dt
    return 0.0 if r == 0 else dt / (repeats - 1)


def slot_size(budget_bytes: float, slots: int) -> float:
    """Bytes per slot when ``budget_bytes`` is cut into ``slots`` slots."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    return math.ceil(budget_bytes / slots) if budget_bytes >= slots else 1.0
