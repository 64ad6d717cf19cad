"""The training loop: config -> run context, task, optimizer -> steps -> HDF5 run log.

Set-up builds the run's :class:`~hpcnn.engine.context.ParallelContext` (grid, communicators,
stages, data-parallel engine, balancer, remat policy; the 1 x 1 x 1 context for a serial run),
the task (:mod:`hpcnn.task`) and the optimizer; the loop runs :func:`hpcnn.engine.step.train_step`
per step, checkpoints, evaluates and logs; the finish records the plan's measured side and closes
the log (:mod:`hpcnn.engine.record`). Around the loop, a signal only sets a flag that every rank
agrees on at a step boundary (:mod:`hpcnn.signals`), and a watchdog reports a rank left waiting
in a communication call (:mod:`hpcnn.parallel.collectives.watchdog`). Only rank 0 writes the log
and prints::

    hpcnn train --model=mlp
    mpiexec -n 4 python -m mpi4py -m hpcnn train --model=mlp --dp=4
    mpiexec -n 2 python -m mpi4py -m hpcnn train --dp=2 --balance=proportional --slowdown=1:2
"""
from __future__ import annotations

import time

from hpcnn import backend, checkpoint, to_stderr
from hpcnn.config import ConfigError, TrainConfig
from hpcnn.engine.context import ParallelContext
from hpcnn.engine.record import (Divergence, claim_log, flush_ranks, log_metrics,
                                 record_memory, release_claims, run_header, thread_warning)
from hpcnn.engine.step import train_step
from hpcnn.schedule.expand import show as show_schedule
from hpcnn.nn import precision
from hpcnn.nn.optim import make_optimizer
from hpcnn.parallel.collectives import watchdog
from hpcnn.signals import StopSignals
from hpcnn.task import build_task, metrics_from_sums

EVERY_RANK_ALIKE = (ConfigError, checkpoint.CheckpointError, FloatingPointError)


def _progress(step, steps, loss, sps, elapsed):
    eta = (steps - step) * elapsed / max(step, 1)
    return (f"step {step:>6}/{steps} | loss {loss:.4f} | {sps:,.0f} samples/s | "
            f"elapsed {elapsed:6.1f}s | ETA {eta:6.1f}s")


def setup(cfg: TrainConfig, world, data):
    """(cfg, ctx, task, opt, start) of a run of ``cfg`` on ``world`` (an MPI communicator, or
    None: serial; ``data``: the data set ``cfg`` names, or None to load it): checks (no
    collective), then the context, the task, the optimizer and the resumed step; the context is
    freed if any of it fails. What :func:`train` runs its loop on, and what the calibration
    (:mod:`hpcnn.plan.calibrate`) trains its reference runs on; the caller frees the context."""
    from hpcnn import preflight
    size = world.Get_size() if world is not None else 1
    cfg, planned, data = preflight.planned(cfg, size, data)     # --model=gpt --plan=auto
    data = preflight.check(cfg, size, data)
    if cfg.checkpoint and (world is None or world.Get_rank() == 0):
        note = checkpoint.remove_stale(cfg.checkpoint)     # a save killed before its rename
        if note:
            to_stderr(note)
    backend.set_device(cfg.device)
    backend.tune_allocator()
    ctx = ParallelContext(cfg, world)
    try:
        try:
            task = ctx.build(build_task, data)
        except ValueError as e:     # dimensions the layout does not divide, and the like
            raise ConfigError(str(e)) from e
        task.hybrid = planned
        task.divergence = Divergence(cfg.divergence)
        ctx.attach(task)
        opt = ctx.optimizer(lambda params: precision.optimizer(cfg, params, lambda ps: (
            make_optimizer(cfg.optimizer, ps, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay))))
        task.scaler = precision.attach(cfg, ctx.engine, opt)     # fp16: the loss scale
        start = _resume(cfg, ctx, task, opt) if cfg.resume else 0
    except Exception:
        ctx.free()
        raise
    return cfg, ctx, task, opt, start


def _resume(cfg, ctx, task, opt) -> int:
    """Restore ``--resume`` on every rank; returns the step to start from. A rank that cannot
    read the file (a file system not shared) must not leave the others waiting: every rank
    learns every rank's error and all stop with the first, naming the ranks concerned."""
    err, start = "", 0
    try:
        start = checkpoint.restore(cfg.resume, cfg, task.model, opt.params, opt, ctx,
                                   steps=task.steps)
    except ValueError as e:
        err = str(e)
    errs = ctx.world.allgather_objects(err)
    if any(errs):
        first = next(e for e in errs if e)
        where = [r for r, e in enumerate(errs) if e]
        raise ConfigError(first if len(where) == len(errs) else
                          f"{first} (on rank(s) {where} of {len(errs)})")
    return start


def train(cfg: TrainConfig, comm=None, command_line: str | None = None, data=None) -> dict:
    """Train as ``cfg`` says; returns a summary dict (final metrics, steps planned, steps_done, log path, the model).

    ``comm`` is the world communicator (None: a serial run without MPI). Every rank checks the
    configuration, the layout, the data and the stage cut identically before the first
    collective (:func:`hpcnn.preflight.check`); ``data``, if given, is the data set the config
    names, already loaded.

    SIGINT, SIGTERM and ``cfg.stop_signal`` end the run at a step every rank agrees on
    (:mod:`hpcnn.signals`); the summary's ``status`` and ``exit_code`` say how it ended. The
    context (shared windows, communicators) is freed collectively only when every rank is known
    to be at the same point: the run ended normally, by a signal, or by an error raised on every
    rank alike (:data:`EVERY_RANK_ALIKE`); after another error it is left to the process's end.
    """
    cfg = cfg.resolved()
    signals = StopSignals(comm, cfg.stop_signal, first_grace=cfg.hang_timeout)  # sets a flag
    try:
        cfg, ctx, task, opt, start = setup(cfg, comm, data)
        log = claim_log(cfg, ctx, task, start, command_line)
    except BaseException as e:         # the context was freed collectively on an Exception
        signals.close(collective=isinstance(e, Exception))
        raise
    say = (lambda s: print(s, flush=True)) if (ctx.rank == 0 and cfg.progress) else (lambda s: None)
    if log is not None:          # a process ending on its own or killed still closes the log
        signals.first_words = lambda: log.mark("interrupted")
        signals.last_words = lambda why: log.close_at_exit(
            "interrupted", f"{why} (the other ranks' rows since the last log interval are lost)")
    warning = thread_warning(ctx.world)         # rank 0's, once: oversubscribed cores
    if warning:
        to_stderr(warning)
    say(run_header(cfg, task.model, task, ctx.world.size, start, ctx.nodes, ctx.spanning))
    t_start = time.perf_counter()
    status, last, together = "failed", {}, False
    watch = watchdog.for_run(cfg.hang_timeout, cfg.log, ctx.world, log)
    try:
        last = _loop(cfg, ctx, task, opt, start, log, say, t_start, signals)
        record_memory(ctx, task, opt, log)
        status, together = signals.status or "finished", True
    except BaseException as e:       # why the run failed, next to its status in the log
        together = isinstance(e, EVERY_RANK_ALIKE)     # raised on every rank at the same point
        if log is not None:
            log.set_plan({"failure": f"{type(e).__name__}: {' '.join(str(e).split())}"})
        raise
    finally:
        if log is not None:
            log.set_plan({"shares_history": [[int(s), [int(v) for v in sh]]
                                             for s, sh, _ in ctx.balancer.history]})
            log.close(status=status)
        release_claims(cfg, ctx)
        signals.close(collective=together)
        if together:        # collective cleanup only when every rank is known to be here too
            ctx.free()
        if watch is not None:
            watch.stop()
    out = _summary(cfg, ctx, task, opt, last, time.perf_counter() - t_start)
    out.update(status=status, exit_code=signals.exit_code(),
               steps_done=last["step"] + 1 if last else start)
    return out


def _loop(cfg, ctx, task, opt, start, log, say, t_start, signals) -> dict:
    """The steps from ``start``: train, checkpoint, evaluate, log; returns the last row. Ends
    early at a safe point where every rank agrees a signal came (:mod:`hpcnn.signals`): the
    pending rows flushed, and on the stop signal a checkpoint of the steps done."""
    pending_rows, pending_events, metrics, last, saved_at = [], [], [], {}, -1
    task.model.train()
    for step in range(start, task.steps):
        watchdog.at_step(step)          # HPCNN_FAULT, a test-only fault hook
        if signals.poll():
            flush_ranks(ctx, log, pending_rows, pending_events)
            last = log_metrics(task.divergence, ctx, log, metrics) if metrics else last
            _stopped_at(cfg, ctx, opt, step, signals, say, saved=saved_at == step)
            break
        row, rank_row, events = train_step(ctx, task, opt, step, t_start)
        if ctx.traced is not None:                   # --show_schedule, after the first step
            show_schedule(ctx, log, say)
        pending_rows.append(rank_row)
        pending_events += events
        done = step + 1
        if _checkpointed(cfg, ctx, opt, done, task.steps, signals, say):
            saved_at = done
        if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == task.steps:
            row.update(_evaluate(ctx, task, signals))
        metrics.append((step, row))
        flush = done % cfg.log_interval == 0 or done == task.steps
        if flush:          # per-rank rows and events reach rank 0 once per log interval
            flush_ranks(ctx, log, pending_rows, pending_events)
            pending_rows, pending_events = [], []
        if flush or backend.device == "cpu":     # a device's metrics: on the host at the flush
            last, metrics = log_metrics(task.divergence, ctx, log, metrics), []
        if flush:
            extra = "".join(f" | {k} {v:.4f}" for k, v in last.items()
                            if k in ("test_acc", "test_loss", "val_loss"))
            say(_progress(done, task.steps, last["loss"], last["samples_per_s"],
                          time.perf_counter() - t_start) + extra)
    return last


def _checkpointed(cfg, ctx, opt, done: int, steps: int, signals, say) -> bool:
    """The checkpoint after ``done`` steps, if one is due: True when written. An interrupt
    seen by the writing rank gives it up (the previous one kept), and a line says so."""
    if not cfg.checkpoint or not (done == steps or (cfg.checkpoint_every and
                                                    done % cfg.checkpoint_every == 0)):
        return False
    path = cfg.checkpoint.replace("{step}", str(done))
    saved = checkpoint.save(path, done, cfg, opt.params, opt, ctx, abandon=signals.interrupted)
    if not saved:
        say(f"checkpoint {path} of step {done} given up on an interrupt (any earlier file kept)")
    return saved


def _stopped_at(cfg, ctx, opt, done: int, signals, say, saved: bool) -> None:
    """A run stopped by a signal after ``done`` steps: on the stop signal, the checkpoint to
    resume from (unless this step's was just written); a line saying so."""
    path = cfg.checkpoint.replace("{step}", str(done))
    if signals.status == "stopped" and cfg.checkpoint and not saved:
        checkpoint.save(path, done, cfg, opt.params, opt, ctx)
    say(f"{signals.status} by a signal after step {done}"
        + (f", checkpoint {path}" if signals.status == "stopped" and cfg.checkpoint else ""))


def _evaluate(ctx, task, signals) -> dict:
    """Held-out metrics, each data-parallel rank scoring its share; the model back in training
    mode after. Given up ({}) at a round of batches where every rank agrees a signal came."""
    sums = task.eval_sums(ctx, stop=lambda: signals.poll() != 0)
    task.model.train()
    return {} if sums is None else metrics_from_sums(ctx.dp.allreduce_scalars(sums),
                                                     task.is_text)


def _summary(cfg, ctx, task, opt, last: dict, wall_s: float) -> dict:
    """What :func:`train` returns: the last step's metrics, the run's size and wall time, the
    model and this rank's parameter names, the final shares and the remat records."""
    out = dict(last)
    out.update(steps=task.steps, log=cfg.log, wall_s=wall_s, divergence=task.divergence.note,
               params=task.model.num_params(), model=task.model,
               local_params=[q.name for q in opt.params],   # this rank's (pipeline stages')
               shares=ctx.balancer.shares.tolist())
    if task.is_text:
        out["unigram_entropy"] = task.data.unigram_entropy()
    if task.scaler is not None:                  # fp16: the steps skipped on an inf/NaN
        out["skipped_steps"] = task.scaler.skipped
    if ctx.remat is not None:
        out["remat_plans"] = ctx.remat.records
        out["remat_measured_peak"] = ctx.remat.measured_peak
    return out
