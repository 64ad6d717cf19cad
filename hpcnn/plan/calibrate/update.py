"""The optimizer update figures of a machine file (``Device.update``).

:func:`update_costs` times hpcnn's own optimizer step, seconds per parameter at a few parameter
counts (:data:`UPDATE_SIZES`, each split into :data:`UPDATE_ARRAYS` arrays as a layer's weights
are), as pieces ((max_params, seconds_per_param), ..., (inf, ...)). A step's rate depends on the
size: small parameter sets stay in cache, and each array adds a fixed Python and dispatch cost,
so one memory-bandwidth figure would price small models too slowly. Again a figure of the
machine, not of the model planned.

Where the node holds more ranks than cores, every rank times its own steps at once (the slowest
rank's, :func:`update_costs` with ``comm``), as training runs them: there the caches and the
memory are shared, and the counts timed between 128 Ki and 1 Mi parameters find where the ranks'
optimizer state leaves the cache.
"""
from __future__ import annotations

import numpy as np

from hpcnn.config import TrainConfig
from hpcnn.nn.core import Parameter
from hpcnn.nn.optim import make_optimizer
from hpcnn.plan.calibrate.timing import counted, evictor, median_seconds, slowest

# Parameter counts of the optimizer-update figures (16 Ki .. 8 Mi: in L2, in L3, past it; five
# between 128 Ki and 1 Mi, where several ranks' AdamW state sharing cores leaves the cache) and
# the arrays each count is split into (a layer's weights and biases are a few arrays).
UPDATE_SIZES = (1 << 14, 1 << 17, 1 << 18, 1 << 19, 3 << 18, 1 << 20, 1 << 23)
UPDATE_ARRAYS = 4
UPDATE_ROUNDS = 3               # rounds over the sizes the update figures' steps are timed in
UPDATE_OPTIMIZERS = ("adamw", "sgd")


def _update_step(optimizer: str, n: int, dtype: str, rng):
    """One step of hpcnn's ``optimizer`` as ``hpcnn train`` builds it with its default options
    (:func:`hpcnn.nn.optim.make_optimizer`, the momentum and weight decay of
    :class:`hpcnn.config.TrainConfig`) over ``n`` parameters in :data:`UPDATE_ARRAYS` arrays with
    their gradients set, as a function of no argument, after a warm-up step (the first step
    allocates the optimizer's state)."""
    params = []
    for i in range(UPDATE_ARRAYS):                          # n split as evenly as it goes
        count = n // UPDATE_ARRAYS + (i < n % UPDATE_ARRAYS)
        p = Parameter(rng.standard_normal(count).astype(dtype), f"w{i}")
        p.grad = rng.standard_normal(count).astype(dtype)
        params.append(p)
    defaults = TrainConfig()
    opt = make_optimizer(optimizer, params, momentum=defaults.momentum,
                         weight_decay=defaults.weight_decay)
    opt.step(1e-3)                                           # warm-up
    return lambda: opt.step(1e-3)


def update_repeats(rounds: int) -> int:
    """Timed optimizer steps per size for a calibration of ``rounds`` block rounds: 7/5 of them
    (21 at the default 15), at least one per :data:`UPDATE_ROUNDS` round; each follows a 64 MiB
    copy, so at a test's 3 rounds the 21 had been most of a one-rank calibration."""
    return max(UPDATE_ROUNDS, 7 * rounds // 5)


def update_costs(optimizer: str, dtype: str = "float32", sizes=UPDATE_SIZES,
                 repeats: int = 21, comm=None) -> tuple:
    """Seconds per parameter of one step of hpcnn's ``optimizer`` ("adamw", "sgd") in this
    process, as pieces ((max_params, seconds_per_param), ..., (inf, seconds_per_param)) for
    :attr:`hpcnn.plan.machine.Device.update`: one piece per size N of ``sizes`` (increasing),
    t(N) / N where t(N) is the median of ``repeats`` steps over N ``dtype`` parameters
    (:func:`_update_step`); then a last piece to infinity with the largest size's figure. The
    steps are timed in :data:`UPDATE_ROUNDS` rounds over the sizes, so that a burst of load on a
    shared machine does not fall on all the steps of one size. Each timed step follows a copy
    of :data:`~.timing.COPY_BYTES`: in training the forward and backward run between two
    updates and evict the optimizer's arrays from the caches (timed back to back, warm, a step
    is faster than in training).
    With ``comm`` (every rank calls), every rank steps its own parameters at once, each step
    after the copy and a barrier, and a step's time is the slowest rank's."""
    sizes = list(sizes)
    if (not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < UPDATE_ARRAYS
                         for n in sizes) or sizes != sorted(set(sizes))):
        raise ValueError(f"update_costs: sizes = {sizes}: expected increasing integers >= "
                         f"{UPDATE_ARRAYS} (parameters)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"update_costs: repeats = {repeats!r}: expected an integer >= 1")
    comm = None if comm is None else counted(comm)
    rng = np.random.default_rng(0)
    steps = [_update_step(optimizer, n, dtype, rng) for n in sizes]
    evict = evictor()
    times = [[] for _ in sizes]
    for r in range(UPDATE_ROUNDS):
        count = repeats // UPDATE_ROUNDS + (r < repeats % UPDATE_ROUNDS)
        for step, out in zip(steps, times):
            for _ in range(count):
                evict()                                      # the forward and backward's traffic
                if comm is None:
                    out.append(median_seconds(step, 1))
                else:
                    comm.barrier()
                    out.append(slowest(comm, median_seconds(step, 1)))
    pieces = tuple((float(n), float(np.median(t)) / n) for n, t in zip(sizes, times))
    return pieces + ((float("inf"), pieces[-1][1]),)
