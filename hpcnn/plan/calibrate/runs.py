"""Reference runs through ``hpcnn train``'s step engine on every rank, as training runs them.

:func:`engine_steps` trains a resolved config a few steps on the context
:func:`hpcnn.train.setup` builds and returns its median step (the slowest rank's);
:func:`gpt_config` and :func:`gpt_model` are a GPT's config and the model the planner prices
for it. :mod:`.contention` (the pipelines of the handoff) and :mod:`.scale` (the reference
layouts) fit the machine's figures on these runs.
"""
from __future__ import annotations

import time

import numpy as np

from hpcnn import datasets
from hpcnn.config import TrainConfig
from hpcnn.engine.step import train_step
from hpcnn.plan import hybrid
from hpcnn.plan.calibrate.timing import counted, slowest
from hpcnn.train import setup


def engine_steps(comm, cfg, steps: int) -> float:
    """The median over the steps after the first fifth of the slowest rank's step of ``cfg``
    (resolved) trained ``steps`` steps by :func:`hpcnn.engine.step.train_step` on the context
    :func:`hpcnn.train.setup` builds over ``comm`` (an MPI communicator, as
    :func:`hpcnn.train.train` takes it)."""
    cfg, ctx, task, opt, _ = setup(cfg, comm, None)
    calls = counted(comm)
    times = []
    try:
        t0 = time.perf_counter()
        for step in range(steps):
            row = train_step(ctx, task, opt, step, t0)[0]
            times.append(slowest(calls, row["step_time"]))
    finally:
        ctx.free()
    return float(np.median(times[steps // 5:]))


def gpt_config(layers: int, shape, layout, steps: int):
    """The resolved :class:`hpcnn.config.TrainConfig` of a GPT of ``layers`` blocks of
    ``shape`` (width, heads, context, sequences per micro-batch per replica) laid out by
    ``layout`` (:class:`hpcnn.plan.hybrid.Layout`, no tensor cut) on the bundled sonnet data,
    float32, trained ``steps`` steps."""
    dim, heads, seq, rows = shape
    return TrainConfig(model="gpt", dataset="sonnet", n_layers=layers, dim=dim, n_heads=heads,
                       block_size=seq, batch_size=layout.dp * layout.microbatches * rows,
                       dp=layout.dp, tp=layout.tp, pp=layout.pp,
                       microbatches=layout.microbatches, schedule=layout.schedule,
                       dtype="float32", allreduce="mpi", progress=False, eval_interval=0,
                       steps=steps).resolved()


def gpt_model(cfg):
    """The :class:`hpcnn.plan.hybrid.Transformer` the planner prices for ``cfg``
    (:func:`gpt_config`)."""
    return hybrid.Transformer(cfg.n_layers, cfg.dim, cfg.n_heads, cfg.block_size,
                              datasets.for_config(cfg).vocab, cfg.batch_size, "float32")
