"""The training loop: config -> grid, data, model, optimizer -> steps -> HDF5 run log.

Serial, or data-parallel over ``dp`` MPI ranks (each rank reads a disjoint shard of every global
batch; see :mod:`hpcnn.parallel.data` and, for unequal shares, :mod:`hpcnn.parallel.hetero`).
Only rank 0 writes the log and prints::

    hpcnn train --model=mlp
    mpiexec -n 4 python -m mpi4py -m hpcnn train --model=mlp --dp=4
    mpiexec -n 2 python -m mpi4py -m hpcnn train --dp=2 --balance=proportional --slowdown=1:2
"""
from __future__ import annotations

import math
import os
import resource
import sys
import time

import numpy

from hpcnn import backend
from hpcnn.config import ConfigError, TrainConfig
from hpcnn import checkpoint
from hpcnn.nn.core import is_placeholder
from hpcnn.nn.layers import place_draws
from hpcnn.nn.optim import clip_grad_norm, grad_norm_sq, lr_at, make_optimizer
from hpcnn.parallel.comm import library_version
from hpcnn.parallel.data import NONBLOCKING, dloss_for, shard
from hpcnn.task import Task, build_task, metrics_from_sums

def whole_model_params(model, tp: int = 1) -> int:
    """Parameters of the whole model, whatever this rank stores: a tensor-parallel shard (one of
    ``tp``) counts for all of them, a pipeline rank's placeholders for the stages they stand for."""
    return sum(p.size * (tp if getattr(p, "tp_axis", None) is not None else 1)
               for p in model.params)


def run_header(cfg: TrainConfig, model, task, world_size: int, start: int = 0) -> str:
    """The first line a run prints: model and its whole parameter count, data, steps, layout
    (dp x tp x pp, the schedule and micro-batches when pipelined), and where it resumed from."""
    layout = f"dp={cfg.dp} x tp={cfg.tp} x pp={cfg.pp} on {world_size} rank(s)"
    if cfg.pp > 1:
        layout += f", {cfg.schedule} with {cfg.microbatches} micro-batches"
        layout += f" and {cfg.virtual} stages per rank" if cfg.virtual > 1 else ""
    if cfg.tp > 1 and cfg.sequence_parallel:
        layout += ", sequence parallel"
    line = (f"hpcnn: {model.name} ({whole_model_params(model, cfg.tp):,} parameters) on "
            f"{task.data.name}, {task.steps} steps of {cfg.batch_size}, {cfg.dtype}, {layout}")
    if cfg.remat != "none":
        line += f", remat={cfg.remat}" + (f" within {cfg.memory_budget:g} MiB"
                                          if cfg.remat == "optimal" else "")
    if cfg.resume:
        line += f", resumed from {cfg.resume} at step {start}"
    return line + f", log {cfg.log}"


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _progress(step, steps, loss, sps, elapsed):
    eta = (steps - step) * elapsed / max(step, 1)
    return (f"step {step:>6}/{steps} | loss {loss:.4f} | {sps:,.0f} samples/s | "
            f"elapsed {elapsed:6.1f}s | ETA {eta:6.1f}s")


class _Parallel:
    """The parallel side of a run: grid, communicators, data-parallel engine, balancer, emulated
    slowdown. ``comm`` is the data-parallel communicator, ``tp`` the tensor-parallel one."""

    def __init__(self, cfg: TrainConfig, world):
        from hpcnn.parallel.comm import CommStats, Communicator
        from hpcnn.parallel.grid import ProcessGrid
        self.cfg = cfg
        self.grid = ProcessGrid(world, cfg.dp, cfg.tp, cfg.pp)
        self.stats = CommStats()
        self.comm = Communicator(self.grid.dp_comm, self.stats, "dp")
        self.tp = Communicator(self.grid.tp_comm, self.stats, "tp")
        self.pp = Communicator(self.grid.pp_comm, self.stats, "pp")
        self.rank, self.size = self.comm.rank, self.comm.size
        self.local = None          # with pp > 1: the chain of this rank's stage blocks
        self.ranges = None         # with pp > 1: the stages' block ranges
        self.owner = None          # with pp > 1: the rank of each stage (round robin, or zb_v's V)

    def plan_stages(self, model, micro_shape) -> set:
        """pp > 1: cut ``model`` (its shapes suffice) into stages (``--layout``, else by cost);
        returns the names of this rank's stages' parameters."""
        from hpcnn.parallel import partition, schedules
        from hpcnn.parallel.pipeline import build_stages
        cfg = self.cfg
        self.ranges = (partition.parse_layout(cfg.layout, len(model)) if cfg.layout
                       else partition.by_spec(model, micro_shape, cfg.pp * cfg.virtual))
        self.owner = schedules.placement(cfg.schedule, len(self.ranges), self.pp.size)
        stages = build_stages(model, self.ranges, self.pp.rank, self.pp.size, self.owner)
        return {q.name for st in stages for q in st.chain.params}

    def attach(self, model, micro_shape) -> None:
        """Set up stages, balancing and the data-parallel engine for ``model``'s (sharded)
        parameters; with pp > 1 only this rank's stages' parameters are its own."""
        from hpcnn.parallel import hetero
        from hpcnn.parallel.data import DataParallel
        cfg = self.cfg
        if cfg.pp > 1:
            from hpcnn.nn.chain import Chain
            from hpcnn.parallel.pipeline import build_stages
            if self.ranges is None:
                self.plan_stages(model, micro_shape)
            stages = build_stages(model, self.ranges, self.pp.rank, self.pp.size, self.owner)
            self.local = Chain([b for st in stages for b in st.chain.blocks], None, name="stages")
        factors = hetero.slowdowns_from_config(cfg.slowdown, self.size)
        self.slowdown = hetero.Slowdown(factors[self.rank], cfg.slowdown_mode)
        speeds = hetero.parse_speeds(cfg.speeds, self.size) if cfg.speeds else None
        self.balancer = hetero.Balancer(self.comm, cfg.batch_size, cfg.balance, speeds=speeds,
                                        rebalance_every=cfg.rebalance_every,
                                        min_share=cfg.grad_accum if cfg.pp == 1 else cfg.microbatches)
        self._check_single_copy()
        self.engine = DataParallel(self.local or model, self.comm, bucket_mb=cfg.bucket_mb,
                                   algorithm=cfg.allreduce,   # rd and cma block: no overlap
                                   overlap=cfg.overlap and self.local is None
                                   and cfg.allreduce in NONBLOCKING)
        self.calibration = None       # auto: time (or load) only the sizes the engine sends
        if cfg.allreduce == "auto" and self.size > 1:
            from hpcnn.parallel import calibration
            self.calibration = calibration.for_run(self.comm, self.engine.auto_sizes(), cfg.dtype)
            if self.grid.rank == 0 and cfg.progress:
                print("".join(f"hpcnn: {x}\n" for x in calibration.describe(self.calibration)),
                      end="", flush=True)
        self.engine.broadcast_parameters()
        self.factors = factors

    def _check_single_copy(self) -> None:
        """--allreduce=shm or cma: refuse on every rank, before training, replicas that cannot
        use it (spread over nodes; cma also needs the kernel's permission to read the peers'
        memory). Both probes are collective and give every rank the same answer."""
        algo = self.cfg.allreduce
        if algo not in ("shm", "cma") or self.size == 1:
            return
        from hpcnn.parallel import cma, shm
        if shm.node_of(self.comm) is None:
            raise ConfigError(f"allreduce={algo!r} needs every data-parallel rank on one node "
                              f"(and HPCNN_SHM not 0); use --allreduce=auto")
        if algo == "cma" and not cma.available(self.comm):
            raise ConfigError("allreduce='cma': the kernel does not let these ranks read each "
                              "other's memory (process_vm_readv; see hpcnn info); use "
                              "--allreduce=shm or auto")

    def replica_seconds(self, compute: float) -> float:
        """The compute time of this rank's data-parallel replica: its slowest tensor- or
        pipeline-parallel member's (the same float on all of them, so that the balancers of the
        replica's ranks, one per (tp, pp) position, measure alike and choose the same shares)."""
        if self.balancer.measured and self.tp.size * self.pp.size > 1:
            compute = float(self.tp.allreduce_scalars([compute], "max")[0])
            compute = float(self.pp.allreduce_scalars([compute], "max")[0])
        return compute

    def sync_replicated(self, model) -> None:
        """Sequence parallelism leaves partial gradients on replicated parameters: sum over tp."""
        if self.tp.size > 1 and self.cfg.sequence_parallel:
            from hpcnn.parallel.tensor import sync_replicated_grads
            sync_replicated_grads(model.params, self.tp)

    def grad_norm_sq(self, params) -> float:
        """Squared global gradient norm: tp shards summed over tp, replicated tensors once."""
        if self.tp.size == 1:
            return float(self.pp.allreduce_scalars([grad_norm_sq(params)])[0])
        sharded = [p for p in params if getattr(p, "tp_axis", None) is not None]
        replicated = [p for p in params if getattr(p, "tp_axis", None) is None]
        local = grad_norm_sq(sharded) + (grad_norm_sq(replicated) if self.tp.rank == 0 else 0.0)
        total = float(self.tp.allreduce_scalars([local])[0])
        return float(self.pp.allreduce_scalars([total])[0])

    def free(self):
        if getattr(self, "engine", None) is not None:
            self.engine.release()
        self.grid.free()


def _log_ranks_events(log, rows, events) -> None:
    by_step: dict = {}
    for r in rows:
        r = dict(r)
        by_step.setdefault(r.pop("step"), []).append(r)
    for s in sorted(by_step):
        log.log_ranks(s, sorted(by_step[s], key=lambda r: r["rank"]))
    log.log_events(events)


def _build_for(cfg: TrainConfig, par, data=None) -> Task:
    """The task; with pp > 1 the model holds storage for this rank's stages only: a first build
    without any (shapes, for the stage cut), then one keeping the local stages' parameters."""
    if par is None or cfg.pp == 1:
        return build_task(cfg, par.tp if par is not None else None, data=data)
    shapes = build_task(cfg, par.tp, data=data, keep=())
    local = par.plan_stages(shapes.model, shapes.micro_shape())
    return build_task(cfg, par.tp, data=shapes.data, keep=local)


def _resume(cfg, comm, par, task, params, opt) -> int:
    """Restore ``--resume`` on every rank; returns the step to start from. A rank that cannot
    read the file (a file system not shared) must not leave the others waiting: every rank
    learns every rank's error and all stop with the first, naming the ranks concerned."""
    err, start = "", 0
    try:
        start = checkpoint.restore(cfg.resume, cfg, task.model, params, opt, par,
                                   steps=task.steps)
    except ValueError as e:
        err = str(e)
    errs = comm.allgather(err) if comm is not None else [err]
    if any(errs):
        if par is not None:
            par.free()
        if task.remat is not None:
            task.remat.close()
        first = next(e for e in errs if e)
        where = [r for r, e in enumerate(errs) if e]
        raise ConfigError(first if len(where) == len(errs) else
                          f"{first} (on rank(s) {where} of {len(errs)})")
    return start


def _open_log(cfg, comm, par, task, start: int, command_line):
    """Rank 0's run log: the run's attributes, its config and its plan (layout, schedule,
    memory, allreduce, where it resumed from)."""
    from hpcnn.log import RunLog
    os.makedirs(os.path.dirname(os.path.abspath(cfg.log)), exist_ok=True)
    extra = {"model_params": whole_model_params(task.model, cfg.tp), "dataset_name": task.data.name}
    if task.is_text:
        extra["unigram_entropy_nats"] = task.data.unigram_entropy()
    if par is not None and any(f != 1.0 for f in par.factors):
        extra["emulated_slowdown"] = ",".join(f"{f:g}" for f in par.factors)
        extra["emulated_slowdown_mode"] = cfg.slowdown_mode
    log = RunLog(cfg.log, cfg.to_dict(), command_line=command_line or " ".join(sys.argv),
                 world_size=comm.Get_size() if comm is not None else 1, backend=backend.device,
                 mpi_library=library_version() if comm is not None else "",
                 extra_attrs=extra, flush_every=cfg.log_interval, overwrite=cfg.overwrite)
    log.set_plan({"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp,
                  "schedule": cfg.schedule if cfg.pp > 1 else "none",
                  "microbatches": cfg.microbatches, "virtual": cfg.virtual,
                  "stages": [list(r) for r in par.ranges] if par is not None and par.local is not None else [],
                  "sequence_parallel": cfg.sequence_parallel,
                  "remat": cfg.remat, "memory_budget_bytes": cfg.memory_budget * 2**20,
                  "offload_gbps": cfg.offload_gbps, "grad_accum": cfg.grad_accum, "balance": cfg.balance,
                  "combine": cfg.combine, "allreduce": cfg.allreduce, "bucket_mb": cfg.bucket_mb,
                  # overlap as run: off with rd, cma and pipelines, whatever --overlap says
                  "overlap": par.engine.overlap if par else cfg.overlap,
                  "allreduce_calibration": par.calibration if par else None,
                  "resumed_from": cfg.resume, "start_step": start})
    return log


def _flush_ranks(comm, par, log, rows, events) -> None:
    """Every rank's per-step rows and timeline events to rank 0's log (small metadata: one
    pickled gather per log interval)."""
    if par is not None and par.size > 1:
        gathered = comm.gather((rows, events), root=0)
        if log is not None:
            rows = [r for part, _ in gathered for r in part]
            events = [e for _, evs in gathered for e in evs]
    if log is not None:
        _log_ranks_events(log, rows, events)


def _record_memory(comm, par, task, log) -> None:
    """At the end of a run: pipeline ranks' peak live activations and parameter bytes, and the
    remat plans with their predicted and measured peaks and recompute time, into the log."""
    if par is not None and par.local is not None:
        held = sum(int(q.data.nbytes) for q in task.model.params if not is_placeholder(q.data))
        peaks = comm.gather((int(getattr(par, "peak_stage_bytes", 0)), held), root=0)
        if log is not None:
            log.set_plan({"peak_activation_bytes_per_rank": [a for a, _ in peaks],
                          "param_bytes_per_rank": [b for _, b in peaks]})
    if task.remat is not None:
        rec = (task.remat.records, task.remat.measured_peak, task.remat.recompute_seconds)
        recs = comm.gather(rec, root=0) if comm is not None else [rec]
        if log is not None:
            log.set_plan({"remat_plans": [dict(r, rank=k) for k, (rs, _, _) in enumerate(recs)
                                          for r in rs],
                          "remat_measured_peak_bytes_per_rank": [m for _, m, _ in recs],
                          "remat_recompute_s_per_rank": [t for _, _, t in recs]})


def train(cfg: TrainConfig, comm=None, command_line: str | None = None, data=None) -> dict:
    """Train as ``cfg`` says; returns a summary dict (final metrics, steps, log path, the model).

    ``comm`` is the world communicator (None: a serial run without MPI). Every rank checks the
    configuration, the layout, the data and the stage cut identically before the first
    collective (:func:`hpcnn.preflight.check`); ``data``, if given, is the data set the config
    names, already loaded.
    """
    from hpcnn import preflight
    cfg = cfg.resolved()
    world_size = comm.Get_size() if comm is not None else 1
    data = preflight.check(cfg, world_size, data)    # options, ranks, data, model: no collective
    backend.set_device(cfg.device)
    backend.tune_allocator()
    par = _Parallel(cfg, comm) if comm is not None else None
    try:
        try:
            task = _build_for(cfg, par, data)
        except ValueError as e:     # dimensions the layout does not divide, and the like
            raise ConfigError(str(e)) from e
        if par is not None:
            par.attach(task.model, task.micro_shape())
    except Exception:
        if par is not None:
            par.free()
        raise
    model = task.model
    rank = comm.Get_rank() if comm is not None else 0
    if cfg.remat != "none":
        try:
            from hpcnn.memory.policy import for_training
            task.remat = for_training(cfg, task, par, comm)
        except Exception:
            if par is not None:
                par.free()
            raise
    own = par.local if par is not None and par.local is not None else model
    opt = make_optimizer(cfg.optimizer, own.params, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay)
    start = _resume(cfg, comm, par, task, own.params, opt) if cfg.resume else 0
    log = _open_log(cfg, comm, par, task, start, command_line) if rank == 0 else None
    say = (lambda s: print(s, flush=True)) if (rank == 0 and cfg.progress) else (lambda s: None)
    say(run_header(cfg, model, task, world_size, start))
    t_start = time.perf_counter()
    status, last = "failed", {}
    pending_rows, pending_events = [], []
    try:
        model.train()
        for step in range(start, task.steps):
            row, rank_row, events = _train_step(cfg, task, par, opt, step, t_start)
            pending_rows.append(rank_row)
            pending_events += events
            done = step + 1
            if cfg.checkpoint and (done == task.steps or (cfg.checkpoint_every and
                                                          done % cfg.checkpoint_every == 0)):
                checkpoint.save(cfg.checkpoint.replace("{step}", str(done)), done, cfg,
                                own.params, opt, par, comm)
            if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == task.steps:
                row.update(_evaluate(task, par))
            last = dict(row, step=step)
            flush = done % cfg.log_interval == 0 or done == task.steps
            if flush:          # per-rank rows and events reach rank 0 once per log interval
                _flush_ranks(comm, par, log, pending_rows, pending_events)
                pending_rows, pending_events = [], []
            if log is not None:
                log.log_metrics(step, **row)
            if flush:
                extra = "".join(f" | {k} {v:.4f}" for k, v in row.items()
                                if k in ("test_acc", "test_loss", "val_loss"))
                say(_progress(done, task.steps, row["loss"], row["samples_per_s"],
                              time.perf_counter() - t_start) + extra)
        _record_memory(comm, par, task, log)
        status = "finished"
    finally:
        if log is not None:
            if par is not None:
                log.set_plan({"shares_history": [[int(s), [int(v) for v in sh]]
                                                 for s, sh, _ in par.balancer.history]})
            log.close(status=status)
        if par is not None:
            par.free()
        if task.remat is not None:
            task.remat.close()
    return _summary(cfg, par, task, opt, last, time.perf_counter() - t_start)


def _evaluate(task, par) -> dict:
    """Held-out metrics, each data-parallel rank scoring its share; the model back in training
    mode after."""
    sums = task.eval_sums(par.rank, par.size, par) if par else task.eval_sums()
    if par is not None:
        sums = par.comm.allreduce_scalars(sums)
    task.model.train()
    return metrics_from_sums(sums, task.is_text)


def _summary(cfg, par, task, opt, last: dict, wall_s: float) -> dict:
    """What :func:`train` returns: the last step's metrics, the run's size and wall time, the
    model and this rank's parameter names, the final shares and the remat records."""
    out = dict(last)
    out.update(steps=task.steps, log=cfg.log, wall_s=wall_s,
               params=task.model.num_params(), model=task.model,
               local_params=[q.name for q in opt.params],   # this rank's (pipeline stages')
               shares=par.balancer.shares.tolist() if par is not None else [cfg.batch_size])
    if task.is_text:
        out["unigram_entropy"] = task.data.unigram_entropy()
    if task.remat is not None:
        out["remat_plans"] = task.remat.records
        out["remat_measured_peak"] = task.remat.measured_peak
    return out


def _local_step(cfg, task, par, xg, yg, mine, shares, rank, t_start, step):
    """Forward/backward of this rank's rows in ``grad_accum`` micro-batches (no pipeline)."""
    model = task.model
    model.zero_grad()
    loss_sum, events = 0.0, []
    chunks = [c for c in numpy.array_split(mine, cfg.grad_accum) if len(c)]
    for k, rows in enumerate(chunks):
        x, y = task.to_device(xg[rows], yg[rows])
        place_draws(model, step, int(rows[0]))       # the serial step's masks for these rows
        # weighted: m/B (the replicas' sum is the full-batch gradient); uniform: m/(P b_i)
        dloss = dloss_for(cfg.combine, len(rows), shares, local=len(mine))
        ta = time.perf_counter()
        run = None                     # rematerialized: the executor runs the backward it planned
        if task.remat is not None:
            ex = task.remat.executor(model, x.shape, need_dx=False)
            loss, caches = ex.forward(x, y)
            run = (lambda hook, ex=ex, st=caches: ex.backward(st, dloss, on_block_done=hook))
        else:
            loss, caches = model.forward(x, y)
        tb = time.perf_counter()
        if par is not None:
            par.engine.backward(caches, dloss, sync=k == len(chunks) - 1, run=run)
        elif run is not None:
            run(None)
        else:
            model.backward(caches, dloss, need_dx=False)
        if run is not None:
            task.remat.note_peak(caches.peak)
        del caches
        tc = time.perf_counter()
        loss_sum += loss * len(rows)
        events += [(rank, "forward", k, ta - t_start, tb - t_start),
                   (rank, "backward", k, tb - t_start, tc - t_start)]
    return loss_sum, events


def _pipeline_step(cfg, task, par, x, y, shares, t_start, step, row0):
    """This rank's part of the pipelined forward/backward of its data-parallel shard."""
    from hpcnn.parallel.pipeline import train_step
    x, y = task.to_device(x, y)
    scale = dloss_for(cfg.combine, len(x), shares)   # b_i/B (weighted) or 1/P (uniform)
    out = train_step(cfg.schedule, task.model, par.pp, x, y, cfg.microbatches,
                     ranges=par.ranges, virtual=cfg.virtual, clock=time.perf_counter,
                     t0=t_start, rank=par.grid.rank, dloss_scale=scale, broadcast_loss=False,
                     remat=task.remat, draw=step, row0=row0)
    par.peak_stage_bytes = max(getattr(par, "peak_stage_bytes", 0), int(out.get("peak_bytes", 0)))
    loss = out["loss"] / scale * len(x) if out["loss"] is not None else 0.0   # last stage only
    return loss, list(out["events"])


def _train_step(cfg, task, par, opt, step, t_start):
    """One optimizer step on this rank's shard: returns (metrics row, rank row, timeline events)."""
    model = task.model
    rank = par.rank if par else 0                     # data-parallel rank: which shard
    wrank = par.grid.rank if par else 0               # world rank: for the log
    lr = lr_at(step, cfg.lr, task.steps, cfg.warmup, cfg.min_lr, cfg.lr_schedule)
    shares = par.balancer.shares if par else numpy.array([cfg.batch_size])
    xg, yg = task.global_batch(step)
    mine = shard(numpy.arange(cfg.batch_size), shares, rank)
    comm_before = par.stats.comm_seconds if par else 0.0
    bytes_before = par.stats.bytes_sent if par else 0
    t0 = time.perf_counter()
    if par is not None and par.local is not None:
        loss_sum, events = _pipeline_step(cfg, task, par, xg[mine], yg[mine], shares, t_start,
                                          step, int(mine[0]) if len(mine) else 0)
    else:
        loss_sum, events = _local_step(cfg, task, par, xg, yg, mine, shares, wrank, t_start, step)
    compute = time.perf_counter() - t0
    if par is not None:
        pad = par.slowdown.pad(compute)
        if pad:
            events.append((wrank, "emulated_slowdown", -1, t0 + compute - t_start, t0 + compute + pad - t_start))
        compute += pad
        tw = time.perf_counter()
        par.engine.finish(step)      # each pipeline rank starts as soon as its stages are done
        par.sync_replicated(par.local or model)      # this rank's parameters only
        if par.local is not None:    # the loss, known on the last stage, after the reduction
            loss_sum = float(par.pp.bcast(numpy.array([loss_sum]), root=par.owner[-1])[0])
        events.append((wrank, "allreduce_wait", -1, tw - t_start, time.perf_counter() - t_start))
        loss_sum = float(par.comm.allreduce_scalars([loss_sum])[0])
        par.balancer.step(step, len(mine), par.replica_seconds(compute))
    if not math.isfinite(loss_sum):
        raise FloatingPointError(f"loss is {loss_sum} at step {step} (rank {rank})")
    gnorm = float("nan")
    if cfg.clip > 0:
        gnorm = clip_grad_norm(opt.params, cfg.clip,
                               norm_sq=par.grad_norm_sq(opt.params) if par else None)
    td = time.perf_counter()
    opt.step(lr)
    backend.sync()
    t3 = time.perf_counter()
    events.append((wrank, "optimizer", -1, td - t_start, t3 - t_start))
    dt = t3 - t0
    row = {"loss": loss_sum / cfg.batch_size, "lr": lr, "step_time": dt,
           "samples": cfg.batch_size, "samples_per_s": cfg.batch_size / dt}
    if cfg.clip > 0:
        row["grad_norm"] = gnorm
    comm_s = (par.stats.comm_seconds - comm_before) if par else 0.0
    rank_row = {"step": step, "rank": wrank, "compute_s": compute, "comm_s": comm_s,
                "idle_s": max(0.0, dt - compute - comm_s - (t3 - td)),
                "bytes_sent": (par.stats.bytes_sent - bytes_before) if par else 0,
                "peak_mem_bytes": _peak_rss_bytes()}
    return row, rank_row, events
