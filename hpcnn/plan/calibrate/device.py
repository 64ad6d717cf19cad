"""The device section of a machine file, as rank 0 measures it by itself.

:func:`device_rates` gathers every device figure of this process: the matmul rate per dtype
(:func:`matmul_rate`), a large copy's memory bandwidth (:func:`copy_bandwidth`), the per-kind
block figures (:mod:`.blocks`), the step engine's passes (:mod:`.passes`) and the optimizer's
update (:mod:`.update`). :func:`memory_bytes` and :func:`cpu_name` describe the node.

:func:`hpcnn.plan.calibrate.measure` runs :func:`device_rates` on rank 0 alone; what a rank gets
while all compute is derived from it in :mod:`.shared`.

    from hpcnn.plan.calibrate.device import device_rates
    rates = device_rates(rounds=3)          # {"float32": FLOP/s, "copy": B/s, ...}
"""
from __future__ import annotations

import os
import platform

import numpy as np

from hpcnn.plan.calibrate.blocks import EFFICIENCY_SHAPES, block_costs
from hpcnn.plan.calibrate.passes import (TOKENS_LADDER, held_costs, rows_costs, stage_costs,
                                         tokens_costs)
from hpcnn.plan.calibrate.timing import (COPY_BYTES, DTYPES, FULL_ROUNDS, MATMUL_N,
                                         median_seconds)
from hpcnn.plan.calibrate.update import UPDATE_OPTIMIZERS, update_costs, update_repeats


def matmul_rate(dtype: str, n: int = MATMUL_N, repeats: int = 5) -> float:
    """FLOP/s of an n x n matmul in ``dtype`` in this process (median of ``repeats``)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    c = np.empty((n, n), dtype=dtype)
    np.matmul(a, b, out=c)                                   # warm-up
    return 2.0 * n ** 3 / median_seconds(lambda: np.matmul(a, b, out=c), repeats)


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes/s of a large copy counted as STREAM does: read + written bytes over the time."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)                                      # touch the pages first
    return 2.0 * src.nbytes / median_seconds(lambda: np.copyto(dst, src), repeats)


def memory_bytes(ranks_here: int = 1) -> float:
    """Physical memory of this node shared by the ``ranks_here`` ranks on it."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks_here


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def device_rates(rounds: int = FULL_ROUNDS) -> dict:
    """Matmul FLOP/s per dtype, copy bytes/s and the float32 block figures of this process:
    {"float32": .., "copy": .., "efficiency.transformer": .., "overhead.transformer": ..,
    "elementwise.transformer": .., "activation.linear": .., "forward.transformer": ..,
    "split.transformer": (in, w), "overhead.stage": .., "forward.stage": .. (the stage pass,
    :func:`~.passes.stage_costs`), "elementwise.held": .. (:func:`~.passes.held_costs`),
    "tokens.transformer": ((tokens, slowdown), ...), "tokens.linear": ((rows, slowdown), ...),
    "update.adamw": ((max_params, seconds_per_param), ...)}.

    The float32 matmul rate is the median of the rates :func:`~.blocks.block_costs` timed in its
    rounds (30 at the default 15 rounds, spread over the block timings), the rate every
    efficiency is a fraction of; float64's is its own median of five calls moved in the same
    proportion as float32's. Five calls at one moment would set the level of every compute price
    by the load of that moment."""
    rates = {dt: matmul_rate(dt) for dt in DTYPES}
    rates["copy"] = copy_bandwidth()
    rounds_f32 = []
    for kind in EFFICIENCY_SHAPES:
        (rates[f"efficiency.{kind}"], rates[f"overhead.{kind}"], rates[f"elementwise.{kind}"],
         act, rates[f"forward.{kind}"], rates[f"split.{kind}"], got) = block_costs(
            kind, "float32", rounds)
        rounds_f32 += got
        if act is not None:
            rates[f"activation.{kind}"] = act
    # the matmul rate the efficiencies were solved against (above)
    level = float(np.median(rounds_f32)) / rates["float32"]
    for dt in DTYPES:
        rates[dt] *= level
    stage = stage_costs("float32", rounds)
    if stage is not None:
        rates["overhead.stage"], rates["forward.stage"] = stage
    for kind in TOKENS_LADDER:                  # through the step engine: the stage pass too
        rates[f"tokens.{kind}"] = tokens_costs(
            kind, "float32", rates[f"overhead.{kind}"] + (stage[0] if stage else 0.0), rounds)
    rates["tokens.linear"] = rows_costs("float32", rates["overhead.linear"], rounds)
    rates["elementwise.held"] = held_costs("float32", rounds)
    for optimizer in UPDATE_OPTIMIZERS:
        rates[f"update.{optimizer}"] = update_costs(optimizer, repeats=update_repeats(rounds))
    return rates
