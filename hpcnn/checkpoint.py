"""Checkpoints: the whole training state in one HDF5 file, independent of the parallel layout.

::

    /          attrs: format, step (steps done), hpcnn version, optimizer, layout "dp,tp,pp",
                      the saving run's config (JSON)
    /params    one dataset per parameter, by name: the full (unsharded) array
    /optim     attrs: the optimizer's scalar state (e.g. its step count);
               <name>/<slot>: the full array of each per-parameter slot (momentum, m, v)
    /balancer  shares, speeds (heterogeneous data parallelism), when the run had them

Saving is collective: the data-parallel replica 0 unshards its tensor-parallel parameters and
optimizer slots, the pipeline ranks send their stages' arrays to world rank 0 one after the other
(it holds one other rank's at a time), which writes a temporary file and renames it over the
target (a crash never leaves a half-written checkpoint).
Every rank of a resumed run reads the file itself and takes its own shard of its own stages, so
a run may resume under another layout (dp, tp, pp). Batches, learning rates and dropout masks
are functions of the step, so a resumed run continues exactly where the saved one was; only an
online speed measurement window (``--balance=proportional`` without ``--speeds``) starts afresh.
Arrays travel as pickled point-to-point messages (mpi4py's lowercase send): fine for a few GB
per pipeline rank.
"""
from __future__ import annotations

import json
import os

import h5py
import numpy

from hpcnn import backend

FORMAT = 1


class CheckpointError(OSError):
    """A checkpoint could not be written (raised on every rank)."""


def _shard_of(p):
    """(axis, parts) of a tensor-parallel shard, or None for a full array."""
    axis = getattr(p, "tp_axis", None)
    return None if axis is None else (axis, getattr(p, "tp_parts", 1))


def _full_shape(p, tp_size: int) -> tuple:
    shape, cut = list(p.shape), _shard_of(p)
    if cut is not None:
        shape[cut[0]] *= tp_size
    return tuple(shape)


def _local_state(params, opt, tp) -> dict:
    """name -> full host array of each parameter and '<name>/<slot>' of its optimizer slots
    (collective over ``tp``, the tensor-parallel Communicator, when it has several ranks)."""
    from hpcnn.parallel.tensor import unshard
    out = {}
    for p in params:
        arrays = {p.name: p.data}
        arrays.update({k: v for k, v in opt.state.items() if k.startswith(p.name + "/")})
        for key, a in arrays.items():
            cut = _shard_of(p)
            if cut is not None and tp is not None and tp.size > 1:
                a = unshard(tp, a, *cut)
            out[key] = numpy.array(backend.to_host(a))
    return out


def save(path: str, step: int, cfg, params, opt, ctx=None) -> None:
    """Write the state after ``step`` steps to ``path``: collective over the ranks of ``ctx``,
    the run's :class:`hpcnn.engine.context.ParallelContext` (None: one process on its own).
    ``params``: this rank's parameters."""
    arrays = None
    if ctx is None:
        arrays = _local_state(params, opt, None).items()
    elif ctx.dp.rank == 0:                                # replicas are identical: one writes
        mine = _local_state(params, opt, ctx.tp)
        if ctx.tp.rank == 0:                              # the stages' owners -> world rank 0,
            if ctx.pp.rank > 0:                           # one pipeline rank at a time
                ctx.pp.send_object(mine, dest=0, tag=7).wait()
            else:
                arrays = _streamed(mine, ctx.pp)
    err = ""
    if ctx is None or ctx.rank == 0:
        try:
            _write(path, step, cfg, arrays, opt, ctx)
        except (OSError, ValueError) as e:                # disk full, no permission, ...
            for _ in arrays:                              # still receive what others send
                pass
            err = f"checkpoint {path}: {e}"
    if ctx is not None:                                   # the file exists when save returns,
        err = ctx.world.bcast_object(err, root=0)         # or every rank raises
    if err:
        raise CheckpointError(err)


def _streamed(mine, pp):
    """My arrays, then each pipeline rank's as it arrives (received while the previous ones are
    written: rank 0 holds one other rank's stages at a time)."""
    yield from mine.items()
    del mine
    for q in range(1, pp.size):
        yield from pp.recv_object(source=q, tag=7).items()


def _write(path, step, cfg, arrays, opt, ctx) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        _write_file(tmp, step, cfg, arrays, opt, ctx)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_file(tmp, step, cfg, arrays, opt, ctx) -> None:
    import hpcnn
    with h5py.File(tmp, "w") as f:
        f.attrs.update({"format": FORMAT, "step": int(step), "hpcnn_version": hpcnn.__version__,
                        "optimizer": cfg.optimizer, "layout": f"{cfg.dp},{cfg.tp},{cfg.pp}",
                        "config": cfg.to_json()})
        params, optim = f.create_group("params"), f.create_group("optim")
        for key, a in arrays:                             # (name, array) pairs
            (optim if "/" in key else params).create_dataset(key, data=a)
        for k, v in opt.state.items():
            if numpy.isscalar(v):
                optim.attrs[k] = v
        if ctx is not None and ctx.balancer.speeds is not None:
            g = f.create_group("balancer")
            g.create_dataset("shares", data=ctx.balancer.shares)
            g.create_dataset("speeds", data=ctx.balancer.speeds)


def restore(path: str, cfg, model, params, opt, ctx=None, steps: int = 0) -> int:
    """Load ``path`` into this rank's ``params`` (its stages, its tensor-parallel shards) and
    ``opt``; returns the number of steps done. Every rank checks the whole model against the file
    (names, shapes, optimizer, ``steps`` the run's total), so a mismatch raises the same
    ``ValueError`` everywhere, before anything is communicated."""
    from hpcnn.parallel.tensor import shard_array
    tp_rank, tp_size = (ctx.tp.rank, ctx.tp.size) if ctx is not None else (0, 1)
    if not os.path.isfile(path):
        raise ValueError(f"--resume={path}: no such checkpoint file")
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"--resume={path}: checkpoint format {f.attrs.get('format')}, "
                             f"this hpcnn reads format {FORMAT}")
        step, saved_opt = int(f.attrs["step"]), str(f.attrs["optimizer"])
        if saved_opt != cfg.optimizer:
            raise ValueError(f"--resume={path}: saved with optimizer {saved_opt!r}, this run "
                             f"uses {cfg.optimizer!r}")
        if step >= steps > 0:
            raise ValueError(f"--resume={path}: the checkpoint is at step {step}, nothing is "
                             f"left of the run's {steps} steps")
        saved = f["params"]
        want = {p.name: _full_shape(p, tp_size) for p in model.params}
        extra = sorted(set(saved) - set(want))
        for name, shape in want.items():
            if name not in saved:
                raise ValueError(f"--resume={path}: parameter {name} is not in the checkpoint"
                                 f"{' (it has ' + ', '.join(extra[:3]) + ')' if extra else ''}")
            if tuple(saved[name].shape) != shape:
                raise ValueError(f"--resume={path}: parameter {name} is "
                                 f"{tuple(saved[name].shape)} in the checkpoint, {shape} here"
                                 + _padding_hint(f.attrs["config"], cfg))
        if extra:
            raise ValueError(f"--resume={path}: the checkpoint has parameters this model has "
                             f"not: {', '.join(extra[:5])}")
        optim = f["optim"]

        def local(p, full):
            cut = _shard_of(p)
            a = full if cut is None or tp_size == 1 else shard_array(full, cut[0], tp_rank,
                                                                     tp_size, cut[1])
            return backend.asarray(numpy.ascontiguousarray(a).astype(p.data.dtype, copy=False))

        for p in params:
            p.data[...] = local(p, saved[p.name][...])
            if p.name in optim:
                for slot, ds in optim[p.name].items():
                    opt.state[f"{p.name}/{slot}"] = local(p, ds[...])
        for k, v in optim.attrs.items():
            opt.state[k] = v.item() if hasattr(v, "item") else v
        if ctx is not None and "balancer" in f and len(f["balancer/shares"]) == ctx.dp.size:
            ctx.balancer.shares = numpy.array(f["balancer/shares"][...])
            ctx.balancer.speeds = numpy.array(f["balancer/speeds"][...])
    return step


def _padding_hint(saved_json: str, cfg) -> str:
    """Why a GPT's vocabulary-sized tensors may differ: the padding multiple (--pad_vocab, by
    default tp) of the saving run and of this one."""
    saved = json.loads(saved_json)
    was, now = saved.get("pad_vocab") or saved.get("tp", 1), cfg.pad_vocab or cfg.tp
    if cfg.model != "gpt" or was == now:
        return ""
    return (f" (the vocabulary was padded to a multiple of {was}, here of {now}: give both runs "
            f"the same --pad_vocab, e.g. --pad_vocab={max(was, now)})")


def summary(path: str) -> dict:
    """The checkpoint's attributes (step, layout, optimizer, config as a dict)."""
    with h5py.File(path, "r") as f:
        out = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    out["config"] = json.loads(out["config"])
    return out
