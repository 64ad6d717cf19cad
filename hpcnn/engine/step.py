"""One optimizer step on one rank: shard, run the rank's schedule, reduce, clip, update.

The same code for every layout (:class:`~.context.ParallelContext`): the rank takes its share of
the global batch (:func:`hpcnn.parallel.data.bucketed.shard`), cuts it into micro-batches, runs its
schedule list over its stages (:func:`.execute.run`, data parallelism launching buckets from the
backwards' hook), waits for the gradient reduction, puts the loss on every rank, reports its
compute time to the balancer, clips and steps the optimizer. Returns the step's metrics row, this
rank's timing row and its timeline events.
"""
from __future__ import annotations

import contextlib
import math
import resource
import time

import numpy

from hpcnn import backend
from hpcnn.engine.execute import run
from hpcnn.engine.record import check_loss
from hpcnn.nn import precision
from hpcnn.nn.optim import clip_grad_norm, lr_at
from hpcnn.parallel.data.bucketed import dloss_for, shard


def split_batch(x, y, n_micro: int):
    """Cut a batch along axis 0 into ``n_micro`` contiguous micro-batches (sizes differ by at
    most one, the larger first); returns the lists (xs, ys)."""
    n = int(x.shape[0])
    if not isinstance(n_micro, int) or not 1 <= n_micro <= n:
        raise ValueError(f"n_micro ({n_micro!r}) must be an integer in [1, batch size ({n})]")
    q, r = divmod(n, n_micro)
    cuts = [0]
    for i in range(n_micro):
        cuts.append(cuts[-1] + q + (i < r))
    return ([x[a:b] for a, b in zip(cuts, cuts[1:])], [y[a:b] for a, b in zip(cuts, cuts[1:])])


def micro_draws(step: int, row0: int, sizes) -> list:
    """Per micro-batch of ``sizes`` rows, starting at global row ``row0`` of ``step``'s batch:
    the (step, first global row) its dropouts draw at, so that masks are the serial step's."""
    draws, row = [], int(row0)
    for m in sizes:
        draws.append((int(step), row))
        row += int(m)
    return draws


def forward_backward(ctx, task, x, y, shares, step: int, row0: int, t_start: float, trace=None,
                     scale: float = 1.0):
    """This rank's forward and backward of its rows ``x, y`` (rows ``row0 ..`` of the step's
    global batch) as its schedule says; returns (loss sum over its rows, events). The loss sum
    is known on the last stage's rank only (0 elsewhere); on a device it stays there.
    ``trace``: see :func:`.execute.run`.
    ``scale``: the loss scale (fp16), a factor on every loss gradient."""
    cfg = ctx.cfg
    x, y = task.to_device(x, y)
    xs, ys = split_batch(x, y, ctx.n_micro(len(x)))
    sizes = [int(a.shape[0]) for a in xs]
    # weighted: m/B (the replicas' sum is the full-batch gradient); uniform: m/(P b_i)
    dloss = [dloss_for(cfg.combine, m, shares, local=len(x)) * scale for m in sizes]
    draws = micro_draws(step, row0, sizes)
    engine, last = ctx.engine, len(xs) - 1           # buckets launched as blocks finish
    out = run(ctx.schedule(len(xs)), ctx.stages, ctx.pp, xs, ys, dloss=dloss,
              shapes=ctx.shapes(a.shape for a in xs),
              dtype=ctx.dtype, t0=t_start, rank=ctx.rank, draws=draws,
              hook=(lambda mb: engine.hook_for(mb, last)) if engine.overlap else None,
              trace=trace)
    ctx.peak_stage_bytes = max(ctx.peak_stage_bytes, int(out["peak_bytes"]))
    loss = sum(out["losses"][mb] * sizes[mb] for mb in sorted(out["losses"]))
    return backend.lazy(loss, float), out["events"]


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _update(ctx, task, opt, lr: float, scale: float, row: dict) -> float:
    """After the reduction: fp16's check (one flag agreed by every rank) and unscaling, the
    clipping, the optimizer step (skipped on an inf/NaN gradient under fp16), the loss scale's
    update; the step's ``grad_norm``, ``loss_scale`` and ``skipped`` into ``row``. Returns the
    time the optimizer's step began (:func:`time.perf_counter`)."""
    cfg, scaler, skip = ctx.cfg, task.scaler, False
    if scaler is not None:
        skip = precision.found_non_finite(opt.clipped)
        skip = bool(ctx.world.allreduce_scalars([float(skip)], "max")[0])
        if not skip:
            precision.unscale(opt.clipped, scale)
        row.update(loss_scale=scale, skipped=float(skip))
    if cfg.clip > 0:
        row["grad_norm"] = float("nan") if skip else clip_grad_norm(
            opt.clipped, cfg.clip, norm_sq=ctx.grad_norm_sq(opt.clipped))
    td = time.perf_counter()
    if not skip:
        opt.step(lr)
    if scaler is not None:
        scaler.update(skip)
    backend.sync()
    return td


def train_step(ctx, task, opt, step: int, t_start: float):
    """One optimizer step on this rank's shard: returns (metrics row, rank row, events)."""
    cfg = ctx.cfg
    lr = lr_at(step, cfg.lr, task.steps, cfg.warmup, cfg.min_lr, cfg.lr_schedule)
    shares = ctx.balancer.shares
    xg, yg = task.global_batch(step)
    mine = shard(numpy.arange(cfg.batch_size), shares, ctx.dp.rank)
    comm_before, bytes_before = ctx.stats.comm_seconds, ctx.stats.bytes_sent
    trace = [] if ctx.tracing else None                  # --show_schedule: this step's ops
    scale = task.scaler.scale if task.scaler is not None else 1.0
    t0 = time.perf_counter()
    ctx.local.zero_grad()
    with numpy.errstate(over="ignore", invalid="ignore") if task.scaler is not None else \
            contextlib.nullcontext():   # fp16: an overflow is the scaler's to find, not a warning
        loss_sum, events = forward_backward(ctx, task, xg[mine], yg[mine], shares, step,
                                            int(mine[0]) if len(mine) else 0, t_start, trace,
                                            scale)
    # (less the step's waits on dp collectives inside it, ZeRO-2 and 3's: not this replica's)
    compute = time.perf_counter() - t0 - ctx.engine.waited_s
    pad = ctx.slowdown.pad(compute)
    if pad:
        events.append((ctx.rank, "emulated_slowdown", -1, t0 + compute - t_start,
                       t0 + compute + pad - t_start))
    compute += pad
    tw = time.perf_counter()
    ctx.engine.finish(step)          # each pipeline rank starts as soon as its stages are done
    if trace is not None:
        ctx.traced, ctx.tracing = (trace, list(ctx.engine.last_launched)), False
    ctx.sync_replicated()
    # a device's loss of a one-rank run stays there until the log flush (check_loss then)
    lazy = ctx.world.size == 1 and not isinstance(loss_sum, (int, float))
    if not lazy:       # staged for the reduction: one counted transfer on a device
        loss_sum = ctx.loss_everywhere(float(backend.to_host(loss_sum)))   # last stages first
    if ctx.engine.reduces:
        events.append((ctx.rank, "allreduce_wait", -1, tw - t_start, time.perf_counter() - t_start))
    if not lazy:
        loss_sum = check_loss(float(ctx.dp.allreduce_scalars([loss_sum])[0]), step, ctx.dp.rank)
    ctx.balancer.step(step, len(mine), ctx.replica_seconds(compute))
    row = {"loss": loss_sum / cfg.batch_size, "lr": lr}
    td = _update(ctx, task, opt, lr, scale, row)
    t3 = time.perf_counter()
    events.append((ctx.rank, "optimizer", -1, td - t_start, t3 - t_start))
    dt = t3 - t0
    row.update(step_time=dt, samples=cfg.batch_size, samples_per_s=cfg.batch_size / dt)
    comm_s = ctx.stats.comm_seconds - comm_before
    rank_row = {"step": step, "rank": ctx.rank, "compute_s": compute, "comm_s": comm_s,
                "idle_s": max(0.0, dt - compute - comm_s - (t3 - td)),
                "bytes_sent": ctx.stats.bytes_sent - bytes_before,
                "peak_mem_bytes": _peak_rss_bytes()}
    return row, rank_row, events
