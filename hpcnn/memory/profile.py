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

import time
import tracemalloc
from dataclasses import dataclass, replace

import numpy

from hpcnn import backend


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
        from hpcnn.schedule.sequences import store_all
        return simulate(store_all(len(self)), self).peak

    def slots(self, slot_bytes: float) -> "ChainProfile":
        """The same profile with sizes in slots of ``slot_bytes`` (rounded up: never optimistic)."""
        if not slot_bytes > 0:
            raise ValueError(f"slot size must be > 0 bytes, got {slot_bytes}")

        def up(a):
            return numpy.ceil(numpy.asarray(a, dtype=numpy.float64) / slot_bytes).astype(numpy.int64)
        return replace(self, wx=up(self.wx), wbar=up(self.wbar), wd=up(self.wd),
                       of=up(self.of), ob=up(self.ob))


@dataclass(frozen=True)
class Rates:
    """Throughputs for the roofline time model: FLOP/s of matmul-like work, bytes/s of memory."""

    flops: float = 50e9
    bandwidth: float = 20e9


def calibrate(dtype=backend.DEFAULT_DTYPE, n: int = 512, repeats: int = 3) -> Rates:
    """Measure this process's matmul rate and copy bandwidth (a fraction of a second)."""
    xp = backend.xp
    a = xp.ones((n, n), dtype=dtype)
    big = xp.ones(1 << 22, dtype=dtype)
    out = xp.empty_like(big)

    def best(fn):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            backend.sync()
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
    # token ids in (an Embedding, serial or vocabulary-parallel, whatever its cache): no dL/dx[0]
    int_input = bool(specs[0].bytes_x and type(chain.blocks[0]).__name__.endswith("Embedding"))
    # without need_dx only a block with a separate weight backward skips producing dL/dx[0]
    skips = not need_dx and hasattr(chain.blocks[0], "backward_weight")
    return from_specs(specs, has_loss=chain.loss is not None, need_dx=not skips, rates=rates,
                      int_input=int_input)


def measure(chain, x, targets=None, *, need_dx: bool = True, repeats: int = 3) -> ChainProfile:
    """Profile with measured times and transients.

    Times: the median of ``repeats`` passes after a warm-up, without tracing. Transients (NumPy):
    one more pass under ``tracemalloc``, a block's traced peak minus what it returns and keeps,
    never negative. Sizes stay those of the specs (exact for the blocks of :mod:`hpcnn.nn`).
    The chain's RNG states are restored and its gradients zeroed afterwards.
    """
    base = of_chain(chain, x.shape, need_dx=need_dx)
    n = len(base)
    stages = list(chain.blocks) + ([chain.loss] if chain.loss is not None else [])
    uf, ub = numpy.zeros((repeats, n)), numpy.zeros((repeats, n))
    of, ob = numpy.zeros(n, dtype=numpy.int64), numpy.zeros(n, dtype=numpy.int64)
    states = chain.rng_state()
    trace = backend.xp is numpy and not tracemalloc.is_tracing()
    try:
        for r in range(-1, repeats + int(trace)):
            traced = r == repeats
            if traced:
                tracemalloc.start()
            try:
                timed = (uf[r], ub[r]) if 0 <= r < repeats else None
                _pass(chain, stages, x, targets, need_dx, timed, (of, ob) if traced else None)
            finally:
                if traced:
                    tracemalloc.stop()
            chain.set_rng_state(states)
    finally:
        chain.zero_grad()
    return replace(base, uf=numpy.median(uf, axis=0), ub=numpy.median(ub, axis=0), of=of, ob=ob)


def _pass(chain, stages, x, targets, need_dx, timed, transients):
    """One forward and backward, stage by stage, timing into ``timed`` = (uf, ub) rows and/or
    recording traced transients into ``transients`` = (of, ob)."""
    n, has_loss = len(stages), chain.loss is not None
    caches, cur = [], x
    for i, st in enumerate(stages):
        if transients is not None:
            tracemalloc.reset_peak()
        t0 = time.perf_counter()
        cur, c = st.forward(cur, targets) if has_loss and i == n - 1 else st.forward(cur)
        backend.sync()
        if timed is not None:
            timed[0][i] = time.perf_counter() - t0
        if transients is not None:
            now, peak = tracemalloc.get_traced_memory()
            transients[0][i] = max(transients[0][i], peak - now)
        caches.append(c)
    dy = 1.0 if has_loss else backend.xp.ones_like(cur)
    for i in range(n - 1, -1, -1):
        if transients is not None:
            tracemalloc.reset_peak()
            start = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        if i == 0 and not need_dx and hasattr(stages[0], "backward_weight"):
            stages[0].backward_weight(dy, caches[0])
            dy = None
        else:
            dy = stages[i].backward(dy, caches[i])
        backend.sync()
        if timed is not None:
            timed[1][i] = time.perf_counter() - t0
        if transients is not None:
            peak = tracemalloc.get_traced_memory()[1]
            kept = dy.nbytes if dy is not None else 0
            transients[1][i] = max(transients[1][i], peak - start - kept)
        caches[i] = None
