"""What a training run records about itself: the header line it prints, and rank 0's run log
(its attributes, config and plan, every rank's per-step rows and timeline events, the measured
memory of every rank and the remat plans), and a loss that diverges (:class:`Divergence`), for
:mod:`hpcnn.train`. Rank 0 alone writes the log (:class:`hpcnn.log.RunLog`); the other ranks send
it what it writes."""
from __future__ import annotations

import math
import os
import sys

from hpcnn import backend, to_stderr
from hpcnn.config import ConfigError, TrainConfig
from hpcnn.nn.core import is_placeholder
from hpcnn.nn.precision import storage_dtype


def whole_model_params(model, tp: int = 1) -> int:
    """Parameters of the whole model, whatever this rank stores: a tensor-parallel shard (one of
    ``tp``) counts for all of them, a laid-out block (``full_shape``) for its whole array, a
    pipeline rank's placeholders for the stages they stand for."""
    return sum(math.prod(p.full_shape) if hasattr(p, "full_shape") else
               p.size * (tp if getattr(p, "tp_axis", None) is not None else 1)
               for p in model.params)


def run_header(cfg: TrainConfig, model, task, world_size: int, start: int = 0,
               nodes=(0,), spanning=None) -> str:
    """The first line a run prints: model and its whole parameter count, data, steps, layout
    (dp x tp x pp on its ranks and, over several nodes or emulated ones, the nodes: ``nodes``
    each rank's node, ``spanning`` the groups per axis that span nodes; the schedule and
    micro-batches when pipelined), and where it resumed from."""
    from hpcnn.parallel.collectives import topology
    layout = f"dp={cfg.dp} x tp={cfg.tp} x pp={cfg.pp} on {world_size} rank(s)"
    if len(set(nodes)) > 1 or topology.emulated():
        layout += f" on {topology.describe(list(nodes))}, tp groups inside nodes first"
        if topology.emulated_link():
            layout += f", over an emulated link ({topology.emulated_link()})"
        if (spanning or {}).get("tp"):
            layout += (f" (warning: {spanning['tp']} tp group(s) span nodes: their collectives "
                       f"cross the network in every layer)")
    if cfg.pp > 1:
        layout += f", {cfg.schedule} with {cfg.microbatches} micro-batches"
        layout += f" and {cfg.virtual} stages per rank" if cfg.virtual > 1 else ""
    if cfg.tp > 1 and cfg.sequence_parallel:
        layout += ", sequence parallel"
    planned = getattr(task, "hybrid", None)            # GPT --plan=auto: who chose it
    if planned:
        layout += f" (planned: {planned['chosen_by']})"
    n = whole_model_params(model, cfg.tp)
    numbers = cfg.dtype if cfg.precision == "fp32" else (
        f"{cfg.precision} ({n * storage_dtype(cfg).itemsize / 2**20:.2f} MiB of 16-bit "
        f"parameters and 16-bit activations; fp32 compute, gradients, master copy and "
        f"optimizer state)")
    line = (f"hpcnn: {model.name} ({n:,} parameters) on "
            f"{task.data.name}, {task.steps} steps of {cfg.batch_size}, {numbers}, {layout}")
    if cfg.remat != "none":
        line += f", remat={cfg.remat}" + (f" within {cfg.memory_budget:g} MiB"
                                          if cfg.remat == "optimal" else "")
    if cfg.resume:
        line += f", resumed from {cfg.resume} at step {start}"
    return line + f", log {cfg.log}"


def thread_warning(world) -> str:
    """Collective on ``world``: on rank 0, a warning line when the ranks on some node, times
    the BLAS/OpenMP threads each uses (:func:`hpcnn.backend.blas_threads`), exceed the cores
    they may run on (the union of their CPU affinities); "" otherwise, and on the other ranks.
    Oversubscribed cores make every step many times slower, and nothing else says so."""
    mine = (os.uname().nodename, frozenset(os.sched_getaffinity(0)), backend.blas_threads())
    everyone = world.gather_objects(mine, root=0)
    if not everyone:
        return ""
    nodes: dict = {}
    for node, cpus, threads in everyone:
        ranks, cores, total = nodes.get(node, (0, frozenset(), 0))
        nodes[node] = (ranks + 1, cores | cpus, total + threads)
    node, (ranks, cores, total) = max(nodes.items(), key=lambda kv: kv[1][2] / len(kv[1][1]))
    if total <= len(cores):
        return ""
    where = f" on node {node}" if len(nodes) > 1 else ""
    return (f"hpcnn: warning: {ranks} rank(s) x {total // ranks} BLAS/OpenMP thread(s) = {total} "
            f"threads on {len(cores)} core(s){where}: the cores are oversubscribed and steps "
            f"can run many times slower; set OMP_NUM_THREADS=1 (or cores / ranks per node)")


def open_log(cfg, ctx, task, start: int, command_line):
    """Rank 0's run log: the run's attributes, its config and its plan (layout, schedule,
    memory, allreduce, where it resumed from)."""
    from hpcnn.log import RunLog
    from hpcnn.parallel.collectives import library_version, topology
    os.makedirs(os.path.dirname(os.path.abspath(cfg.log)), exist_ok=True)
    extra = {"model_params": whole_model_params(task.model, cfg.tp), "dataset_name": task.data.name}
    if task.is_text:
        extra["unigram_entropy_nats"] = task.data.unigram_entropy()
    if any(f != 1.0 for f in ctx.factors):
        extra["emulated_slowdown"] = ",".join(f"{f:g}" for f in ctx.factors)
        extra["emulated_slowdown_mode"] = cfg.slowdown_mode
    if topology.emulated_link():
        extra["emulated_link"] = topology.emulated_link()
    log = RunLog(cfg.log, cfg.to_dict(), command_line=command_line or " ".join(sys.argv),
                 world_size=ctx.world.size, backend=backend.device,
                 mpi_library=library_version() if ctx.grid is not None else "",
                 extra_attrs=extra, flush_every=cfg.log_interval, overwrite=cfg.overwrite,
                 durable=cfg.log_durable)
    log.set_plan({"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
                  "zero": cfg.zero if ctx.dp.size > 1 else 0,
                  "schedule": cfg.schedule if cfg.pp > 1 else "none",
                  "microbatches": cfg.microbatches, "virtual": cfg.virtual,
                  "stages": [list(r) for r in ctx.ranges] if ctx.pipelined else [],
                  "sequence_parallel": cfg.sequence_parallel,
                  "remat": cfg.remat, "memory_budget_bytes": cfg.memory_budget * 2**20,
                  "offload_gbps": cfg.offload_gbps, "grad_accum": cfg.grad_accum, "balance": cfg.balance,
                  "combine": cfg.combine, "allreduce": cfg.allreduce, "bucket_mb": cfg.bucket_mb,
                  # overlap as run: off with rd, cma and pipelines, whatever --overlap says
                  "overlap": ctx.engine.overlap if ctx.grid is not None else cfg.overlap,
                  "allreduce_calibration": ctx.calibration,
                  "operator_layout": task.layout or {}, "hybrid_layout": task.hybrid or {},
                  "resumed_from": cfg.resume, "start_step": start,
                  "node_of_rank": list(ctx.nodes), "emulated_nodes": topology.emulated() or 0,
                  "groups_spanning_nodes": dict(ctx.spanning)})
    return log


def flush_ranks(ctx, log, rows, events) -> None:
    """Every rank's per-step rows and timeline events to rank 0's log (one pickled gather)."""
    gathered = ctx.world.gather_objects((rows, events), root=0)
    if log is not None:
        by_step: dict = {}
        for r in (dict(r) for part, _ in gathered for r in part):
            by_step.setdefault(r.pop("step"), []).append(r)
        for s in sorted(by_step):
            log.log_ranks(s, sorted(by_step[s], key=lambda r: r["rank"]))
        log.log_events([e for _, evs in gathered for e in evs])


def held_state_bytes(params, opt, grad_parts=(), param_parts=()) -> tuple[int, int, int, int]:
    """(parameters, gradients, optimizer) bytes this rank holds: the distinct bytes of the
    arrays (:func:`hpcnn.memory.executor.live_bytes`: a gradient that is a view of a flat bucket
    counts once), placeholders left out; the gradients' storage as it is (ZeRO-2: none between
    steps) and ``grad_parts`` (ZeRO-2: this rank's part of the reduced gradient); the
    parameters' with ``param_parts`` (ZeRO-3: this rank's shards, its parameters then being
    placeholders between uses); the optimizer's are its state arrays (moments) and its scratch
    buffer; last, the float32 master copies of 16-bit parameters (this rank's part under ZeRO)."""
    from hpcnn.memory.executor import live_bytes
    mine = [q for q in params if not is_placeholder(q.data)]
    grads = [g for g in (q.grad_storage() for q in mine) if g is not None] + list(grad_parts)
    return (live_bytes([q.data for q in mine] + list(param_parts)), live_bytes(grads),
            live_bytes(opt.held_arrays()), live_bytes(opt.master_arrays()))


def record_memory(ctx, task, opt, log) -> None:
    """At the end of a run: every rank's peak activation bytes (the step engine's account of
    what its micro-batches hold between F and B, from the blocks' ``spec``, which
    tests/test_block_contract.py checks equal to the live caches), its parameter, gradient and
    optimizer bytes (:func:`held_state_bytes`), and the remat plans with their predicted and
    measured peaks and recompute time, into the log."""
    e = ctx.engine
    sharded, zero3 = e.shards_gradients, e.shards_parameters
    held = held_state_bytes(task.model.params, opt, e.flats if sharded else (),
                            e.shards if zero3 else ())
    buffers = e.peak_bytes if sharded else 0             # ZeRO-2: buckets bound at once
    gathers = e.gather_peak if zero3 else 0              # ZeRO-3: blocks gathered at once
    peaks = ctx.world.gather_objects((ctx.peak_stage_bytes, *held, buffers, gathers), root=0)
    if log is not None:
        log.set_plan({"peak_activation_bytes_per_rank": [p[0] for p in peaks],
                      "param_bytes_per_rank": [p[1] for p in peaks],
                      "grad_bytes_per_rank": [p[2] for p in peaks],
                      "optimizer_bytes_per_rank": [p[3] for p in peaks],
                      "master_bytes_per_rank": [p[4] for p in peaks],
                      "grad_buffer_peak_bytes_per_rank": [p[5] for p in peaks],
                      "param_gather_peak_bytes_per_rank": [p[6] for p in peaks]})
    if ctx.remat is not None:
        rm = ctx.remat
        recs = ctx.world.gather_objects((rm.records, rm.measured_peak, rm.recompute_seconds), 0)
        if log is not None:
            log.set_plan({"remat_plans": [dict(r, rank=k) for k, (rs, _, _) in enumerate(recs)
                                          for r in rs],
                          "remat_measured_peak_bytes_per_rank": [m for _, m, _ in recs],
                          "remat_recompute_s_per_rank": [t for _, _, t in recs]})


def claim_log(cfg, ctx, task, start, command_line):
    """Rank 0 takes the checkpoint path's lock (``--checkpoint``: one run saves there at a
    time; :func:`release_claims` gives it back) and opens the run log (None on the other
    ranks); if another run took either lock since the checks, every rank stops alike with the
    same ConfigError, before any step."""
    from hpcnn.log import lock
    log, err = None, ""
    if ctx.rank == 0:
        try:
            if cfg.checkpoint:               # (its folder made now: the save would make it)
                os.makedirs(os.path.dirname(os.path.abspath(cfg.checkpoint)), exist_ok=True)
                note = lock.acquire(cfg.checkpoint, "checkpoint", "--checkpoint")
                if note:
                    to_stderr(f"hpcnn: {note}")
            log = open_log(cfg, ctx, task, start, command_line)
        except FileExistsError as e:
            release_claims(cfg, ctx)
            err = str(e)
    err = ctx.world.allgather_objects(err)[0]
    if err:
        ctx.free()
        raise ConfigError(err)
    return log


def release_claims(cfg, ctx) -> None:
    """Rank 0 gives back the checkpoint path's lock (if it holds it)."""
    from hpcnn.log import lock
    if ctx.rank == 0 and cfg.checkpoint:
        lock.release(cfg.checkpoint)


class Divergence:
    """Watch the loss for divergence: a finite loss above ``factor`` times the run's first
    (0: off; a first loss of 0 or less gives no ratio to watch). The same on every rank: the
    loss is the reduced one."""

    def __init__(self, factor: float):
        self.factor, self.first, self.note = float(factor), None, ""

    def see(self, step: int, loss: float) -> str:
        """The note when ``loss`` after step ``step`` first passes the bound, else ""."""
        if self.first is None:
            self.first = loss
            return ""
        if self.note or not self.factor or self.first <= 0 or loss <= self.factor * self.first:
            return ""
        self.note = (f"diverged at step {step + 1}: loss {loss:.4g} > {self.factor:g} x the "
                     f"first step's {self.first:.4g}")
        return self.note


def watch_divergence(divergence: Divergence, step: int, loss: float, log, rank0: bool) -> None:
    """Name a divergence once: under ``/plan`` ``divergence`` in the log, and a warning."""
    note = divergence.see(step, loss)
    if note and log is not None:
        log.set_plan({"divergence": note})
    if note and rank0:
        to_stderr(f"hpcnn: warning: {note}; the run goes on (--divergence=0: no watch)")


def check_loss(loss: float, step: int, rank: int) -> float:
    """``loss`` (a host number), once checked finite; else FloatingPointError."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step} (rank {rank})")
    return loss


def host_metrics(pending: list, rank: int) -> list:
    """The (step, row) pairs of ``pending`` with every value a host number: the device scalars
    a device's step leaves in its rows (:func:`hpcnn.backend.lazy`) read in one counted
    transfer, at the log flush; each loss then checked finite (FloatingPointError naming the
    step, as :func:`check_loss` does where the step reads the loss)."""
    xp = backend.xp
    keys = [(i, k) for i, (_, row) in enumerate(pending) for k, v in row.items()
            if not isinstance(v, (int, float))]
    if not keys:
        return pending
    values = backend.to_host(xp.stack([xp.asarray(pending[i][1][k], dtype="float64")
                                       for i, k in keys]))
    out = [(step, dict(row)) for step, row in pending]
    for (i, k), v in zip(keys, values):
        out[i][1][k] = float(v)
    for step, row in out:
        check_loss(row["loss"], step, rank)
    return out


def log_metrics(divergence: Divergence, ctx, log, pending: list) -> dict:
    """Log the pending (step, metrics row) pairs, read on the host (:func:`host_metrics`),
    each loss watched for a divergence (:func:`watch_divergence`); returns the last row, with
    its step. The loop calls it each step on the CPU, at the log flush on a device."""
    for step, row in host_metrics(pending, ctx.dp.rank):
        watch_divergence(divergence, step, row["loss"], log, ctx.rank == 0)
        if log is not None:
            log.log_metrics(step, **row)
    return dict(row, step=step)
