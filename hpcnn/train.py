"""The training loop: config -> data, model, optimizer -> steps -> HDF5 run log.

Serial for now; every rank of an MPI job may call :func:`train`, only rank 0 writes the log and
prints. Run it from the command line::

    hpcnn train --model=mlp --epochs=20
    mpiexec -n 1 python -m mpi4py -m hpcnn train --model=gpt --steps=300
"""
from __future__ import annotations

import math
import os
import resource
import sys
import time
from dataclasses import dataclass

import numpy

from hpcnn import backend as B
from hpcnn import data as D
from hpcnn.config import TrainConfig
from hpcnn.nn import models
from hpcnn.nn.optim import clip_grad_norm, lr_at, make_optimizer

TEXT_DEFAULT_STEPS = 1000
VAL_SEED = 2**31 - 1          # validation windows are the same for every run


@dataclass
class Task:
    """What a run trains on: the data, the model, and how to draw and score batches."""

    cfg: TrainConfig
    data: object
    model: object
    steps: int
    samples_per_step: int

    @property
    def is_text(self) -> bool:
        return isinstance(self.data, D.TextData)

    def batch(self, step: int):
        """Global batch (x, y) of ``step`` as backend arrays."""
        c = self.cfg
        if self.is_text:
            x, y = D.text_batch(self.data.train, c.batch_size, c.block_size, step, c.seed)
            return B.asarray(x), B.asarray(y)
        idx = D.batch_indices(len(self.data.y_train), c.batch_size, step, c.seed)
        return (B.asarray(self.data.x_train[idx], dtype=c.dtype), B.asarray(self.data.y_train[idx]))

    def evaluate(self) -> dict:
        """Test loss and accuracy (classification) or validation loss (text), in eval mode."""
        m, c = self.model, self.cfg
        if self.is_text:
            losses = []
            for i in range(c.eval_batches):
                x, y = D.text_batch(self.data.val, c.batch_size, c.block_size, i, VAL_SEED)
                logits = m.predict(B.asarray(x))
                losses.append(m.loss.forward(logits, B.asarray(y))[0])
            return {"val_loss": float(numpy.mean(losses))}
        x = B.asarray(self.data.x_test, dtype=c.dtype)
        y = B.asarray(self.data.y_test)
        logits = m.predict(x, batch_size=512)
        loss = m.loss.forward(logits, y)[0]
        acc = float(B.to_host((logits.argmax(axis=-1) == y).mean()))
        return {"test_loss": float(loss), "test_acc": acc}


def build_task(cfg: TrainConfig) -> Task:
    """Load the data and build the model named by a resolved config."""
    dtype = B.dtype_of(cfg.dtype)
    if cfg.dataset == "digits":
        data = D.digits(image=cfg.model == "cnn")
        if cfg.model == "mlp":
            model = models.mlp(data.x_train.shape[1], cfg.hidden, data.n_classes, seed=cfg.seed, dtype=dtype)
        else:
            model = models.cnn(1, 8, cfg.channels, n_out=data.n_classes, seed=cfg.seed, dtype=dtype)
        spe = D.steps_per_epoch(len(data.y_train), cfg.batch_size)
        steps = cfg.steps or max(1, math.ceil(cfg.epochs * spe))
        return Task(cfg, data, model, steps, cfg.batch_size)
    data = D.shakespeare(max_plays=cfg.max_plays or None, fallback=cfg.dataset == "sonnet")
    model = models.gpt(data.vocab, cfg.block_size, cfg.n_layers, cfg.dim, cfg.n_heads,
                       dropout=cfg.dropout, seed=cfg.seed, dtype=dtype)
    return Task(cfg, data, model, cfg.steps or TEXT_DEFAULT_STEPS, cfg.batch_size)


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _progress(step, steps, loss, sps, elapsed):
    eta = (steps - step) * elapsed / max(step, 1)
    return (f"step {step:>6}/{steps} | loss {loss:.4f} | {sps:,.0f} samples/s | "
            f"elapsed {elapsed:6.1f}s | ETA {eta:6.1f}s")


def _mpi_info(comm):
    if comm is None:
        return 0, 1, ""
    from mpi4py import MPI
    return comm.Get_rank(), comm.Get_size(), MPI.Get_library_version().splitlines()[0].strip()


def train(cfg: TrainConfig, comm=None, command_line: str | None = None) -> dict:
    """Train as ``cfg`` says; returns a summary dict (final metrics, steps, log path)."""
    from hpcnn.log import RunLog
    cfg = cfg.resolved()
    B.set_device(cfg.device)
    rank, size, mpi_lib = _mpi_info(comm)
    task = build_task(cfg)
    model = task.model
    opt = make_optimizer(cfg.optimizer, model.params, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay)
    log = None
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.log)), exist_ok=True)
        extra = {"model_params": model.num_params(), "dataset_name": task.data.name}
        if task.is_text:
            extra["unigram_entropy_nats"] = task.data.unigram_entropy()
        log = RunLog(cfg.log, cfg.to_dict(), command_line=command_line or " ".join(sys.argv),
                     world_size=size, mpi_library=mpi_lib, backend=B.device,
                     extra_attrs=extra, flush_every=cfg.log_interval, overwrite=cfg.overwrite)
        log.set_plan({"dp": 1, "tp": 1, "pp": 1, "schedule": "serial", "remat": "none"})
    say = (lambda s: print(s, flush=True)) if (rank == 0 and cfg.progress) else (lambda s: None)
    say(f"hpcnn: {model.name} ({model.num_params():,} parameters) on {task.data.name}, "
        f"{task.steps} steps of {cfg.batch_size}, {cfg.dtype}, log {cfg.log}")
    t_start = time.perf_counter()
    status, last = "failed", {}
    try:
        model.train()
        for step in range(task.steps):
            lr = lr_at(step, cfg.lr, task.steps, cfg.warmup, cfg.min_lr, cfg.schedule)
            x, y = task.batch(step)
            t0 = time.perf_counter()
            model.zero_grad()
            loss, caches = model.forward(x, y)
            t1 = time.perf_counter()
            model.backward(caches, need_dx=False)
            del caches
            t2 = time.perf_counter()
            gnorm = clip_grad_norm(model.params, cfg.clip) if cfg.clip > 0 else float("nan")
            opt.step(lr)
            B.sync()
            t3 = time.perf_counter()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step} (rank {rank})")
            dt = t3 - t0
            row = {"loss": loss, "lr": lr, "step_time": dt, "samples": task.samples_per_step,
                   "samples_per_s": task.samples_per_step / dt}
            if cfg.clip > 0:
                row["grad_norm"] = gnorm
            done = step + 1
            if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == task.steps:
                row.update(task.evaluate())
                model.train()
            last = dict(row, step=step)
            if log is not None:
                log.log_events([(rank, "forward", -1, t0 - t_start, t1 - t_start),
                                (rank, "backward", -1, t1 - t_start, t2 - t_start),
                                (rank, "optimizer", -1, t2 - t_start, t3 - t_start)])
                log.log_ranks(step, [{"rank": rank, "compute_s": dt, "comm_s": 0.0, "idle_s": 0.0,
                                      "bytes_sent": 0, "peak_mem_bytes": _peak_rss_bytes()}])
                log.log_metrics(step, **row)
            if done % cfg.log_interval == 0 or done == task.steps:
                extra = "".join(f" | {k} {v:.4f}" for k, v in row.items()
                                if k in ("test_acc", "test_loss", "val_loss"))
                say(_progress(done, task.steps, loss, row["samples_per_s"],
                              time.perf_counter() - t_start) + extra)
        status = "finished"
    finally:
        if log is not None:
            log.close(status=status)
    out = {k: v for k, v in last.items()}
    out.update(steps=task.steps, log=cfg.log, wall_s=time.perf_counter() - t_start,
               params=model.num_params())
    if task.is_text:
        out["unigram_entropy"] = task.data.unigram_entropy()
    return out
