"""Checkpoints: the whole training state in one HDF5 file, independent of the parallel layout.

::

    /          attrs: format, step (steps done), hpcnn version, optimizer, layout "dp,tp,pp",
                      the saving run's config (JSON)
    /params    one dataset per parameter, by name: the full (unsharded) array (16-bit
               parameters, --precision=bf16|fp16: their float32 master copy)
    /optim     attrs: the optimizer's scalar state (e.g. its step count; fp16: the loss scale
               and its count of good steps);
               <name>/<slot>: the full array of each per-parameter slot (momentum, m, v)
    /balancer  shares, speeds (heterogeneous data parallelism), when the run had them

    every dataset: attr crc32, the CRC-32 of its array's bytes (C order, as stored)

Saving is collective: the data-parallel replica 0 unshards its tensor-parallel parameters and
optimizer slots, the pipeline ranks send their stages' arrays (pickled point-to-point messages)
to world rank 0, which builds the HDF5 file in memory and writes its bytes to a temporary file
with plain ``os.write`` calls, fsyncs it and renames it over the target. HDF5 never touches the
disk when saving (why: docs/results/runlog.md); any failure to write removes the temporary file,
leaves the previous checkpoint as it was and raises one :class:`CheckpointError` on every rank.
The price: world rank 0 holds the whole file's bytes while it writes them. A save killed before
its rename leaves ``<path>.tmp<pid>``: the next run's rank 0 removes it (:func:`remove_stale`);
what a save may replace is checked before step 0 (:func:`hpcnn.preflight.check`).

Resuming checks, on every rank, before anything is communicated: the format, the optimizer, every
model-defining option (:data:`MODEL_OPTIONS`), every parameter's name and shape, the steps left;
then each rank verifies the CRC-32 of every array it reads and names the dataset that does not
match; a file HDF5 cannot read is refused with one line; format 1 files (before checksums) are
read unverified, with a note. Every rank reads the file itself and takes its own shard of its own
stages, so a run may resume under another layout (dp, tp, pp). Batches, learning rates and
dropout masks are functions of the step, so a resumed run continues exactly where the saved one
was; only an online speed measurement window (``--balance=proportional`` without ``--speeds``)
starts afresh.
"""
from __future__ import annotations

import io
import contextlib
import json
import os
import zlib

import h5py
import numpy

from hpcnn import backend, to_stderr

FORMAT = 2              # 2: every array carries its CRC-32 (1: without; still read, unverified)
READABLE = (1, 2)
WRITE_CHUNK = 64 << 20  # bytes per os.write call when the image goes to disk

# The options that decide what the saved arrays mean: a resume under another value is refused,
# even where the shapes agree (n_heads splits the same matrices otherwise; dtype would round).
# The layout (dp, tp, pp, --pad_vocab) may change: the parameters' shapes are compared (the GPT's
# padded vocabulary with a hint), and --half_layers only cuts the same parameters differently.
MODEL_OPTIONS = {"mlp": ("hidden",), "cnn": ("channels",),
                 "gpt": ("n_layers", "dim", "n_heads", "block_size")}
COMMON_OPTIONS = ("model", "dataset", "dtype")


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


def _local_state(params, state, tp) -> dict:
    """name -> full host array of each parameter and '<name>/<slot>' of its optimizer slots
    (``state``: the optimizer's whole state; collective over ``tp``, the tensor-parallel
    Communicator, when it has several ranks)."""
    from hpcnn.parallel.tensor.linear import unshard
    out = {}
    for p in params:
        arrays = {p.name: p.data}
        arrays.update({k: v for k, v in state.items() if k.startswith(p.name + "/")})
        for key, a in arrays.items():
            cut = _shard_of(p)
            if cut is not None and tp is not None and tp.size > 1:
                a = unshard(tp, a, *cut)
            out[key] = numpy.array(backend.to_host(a))
    return out


class Abandoned(Exception):
    """A checkpoint being written was given up (``save``'s ``abandon`` said so)."""


def save(path: str, step: int, cfg, params, opt, ctx=None, abandon=None) -> bool:
    """Write the state after ``step`` steps to ``path``: collective over the ranks of ``ctx``,
    the run's :class:`hpcnn.engine.context.ParallelContext` (None: one process on its own).
    ``params``: this rank's parameters. If the file cannot be written, every rank raises the
    same :class:`CheckpointError`; no temporary file is left and a previous ``path`` is intact.
    ``abandon``: a callable the writing rank (world rank 0) asks between arrays and between
    chunks written; when it says True the save is given up the same way (an interrupt: the
    run stops). True on every rank when the file was written, False when it was given up."""
    arrays, state = None, opt.full_state()              # (sharded: collective over dp)
    params = opt.saved_params(params)                   # (16-bit: the fp32 masters)
    if ctx is None:
        arrays = _local_state(params, state, None).items()
    else:
        with ctx.whole_parameters():                      # (ZeRO-3: gathered, over dp)
            mine = _local_state(params, state, ctx.tp) if ctx.dp.rank == 0 else None
    if ctx is not None and ctx.dp.rank == 0:              # replicas are identical: one writes
        if ctx.tp.rank == 0:                              # the stages' owners -> world rank 0,
            if ctx.pp.rank > 0:                           # one pipeline rank at a time
                ctx.pp.send_object(mine, dest=0, tag=7).wait()
            else:
                arrays = _streamed(mine, ctx.pp)
    err = ""
    if ctx is None or ctx.rank == 0:
        try:
            image = _image(step, cfg, arrays, opt, ctx, abandon or _never)
            _write_atomically(path, image, abandon or _never)
        except (OSError, ValueError, Abandoned) as e:     # disk full, no permission, ...
            for _ in arrays:                              # still receive what others send
                pass
            err = "abandoned" if isinstance(e, Abandoned) else f"checkpoint {path}: {_one_line(e)}"
    if ctx is not None:                                   # the file exists when save returns,
        err = ctx.world.bcast_object(err, root=0)         # or every rank raises
    if err and err != "abandoned":
        raise CheckpointError(err)
    return not err


def _never() -> bool:
    return False


def _one_line(e: BaseException) -> str:
    """An exception as one line (HDF5's messages embed a newline after a time stamp)."""
    return " ".join(str(e).split())


def _streamed(mine, pp):
    """My arrays, then each pipeline rank's as it arrives (received while the previous ones are
    added to the file image)."""
    yield from mine.items()
    del mine
    for q in range(1, pp.size):
        yield from pp.recv_object(source=q, tag=7).items()


def checksum(a) -> int:
    """CRC-32 of an array's bytes in C order: 2.3 GB/s here (zlib), against 0.8 GB/s for
    BLAKE2b; it catches every burst of up to 32 flipped bits, all a checkpoint needs (it guards
    against corruption, not against forgery)."""
    return zlib.crc32(numpy.ascontiguousarray(a).view(numpy.uint8).reshape(-1))


def _dataset(group, name, a) -> None:
    a = numpy.ascontiguousarray(a)
    group.create_dataset(name, data=a).attrs["crc32"] = checksum(a)


def _image(step, cfg, arrays, opt, ctx, abandon) -> memoryview:
    """The whole checkpoint file, built in memory (HDF5 writes into a BytesIO, never to disk);
    :class:`Abandoned` raised between two arrays when ``abandon()`` says so."""
    import hpcnn
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f.attrs.update({"format": FORMAT, "step": int(step), "hpcnn_version": hpcnn.__version__,
                        "optimizer": cfg.optimizer, "layout": f"{cfg.dp},{cfg.tp},{cfg.pp}",
                        "config": cfg.to_json()})
        params, optim = f.create_group("params"), f.create_group("optim")
        for key, a in arrays:                             # (name, array) pairs
            if abandon():
                raise Abandoned()
            _dataset(optim if "/" in key else params, key, a)
        for k, v in opt.state.items():
            if numpy.isscalar(v):
                optim.attrs[k] = v
        if ctx is not None and ctx.balancer.speeds is not None:
            g = f.create_group("balancer")
            _dataset(g, "shares", ctx.balancer.shares)
            _dataset(g, "speeds", ctx.balancer.speeds)
    return buf.getbuffer()


def _write_atomically(path: str, data, abandon=_never) -> None:
    """``data`` to ``path`` through ``path.tmp<pid>``: written, fsynced, renamed over ``path``.
    On any error the temporary file is removed (``path`` keeps its previous content) and the
    error is raised, naming the temporary file and saying the previous checkpoint is kept;
    :class:`Abandoned` likewise when ``abandon()`` says so between two chunks."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    had = os.path.exists(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data).cast("B")
            while len(view):                               # os.write may write less than asked
                if abandon():
                    raise Abandoned()
                view = view[os.write(fd, view[:WRITE_CHUNK]):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except Abandoned:
        _remove(tmp)
        raise
    except OSError as e:
        _remove(tmp)
        kept = "the previous checkpoint is unchanged" if had else "nothing was written"
        raise OSError(e.errno, f"{e.strerror or e} writing {tmp} ({kept})") from e
    _sync_folder(folder)


def _remove(name: str) -> bool:
    """Remove file ``name``; False if it was already gone."""
    try:
        os.remove(name)
        return True
    except FileNotFoundError:
        return False


def _sync_folder(folder: str) -> None:
    """fsync a folder so that a rename in it survives a power loss (where the OS allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def restore(path: str, cfg, model, params, opt, ctx=None, steps: int = 0) -> int:
    """Load ``path`` into this rank's ``params`` (its stages, its tensor-parallel shards) and
    ``opt``; returns the number of steps done. Every rank checks the whole model against the file
    (model-defining options, names, shapes, optimizer, ``steps`` the run's total), so a mismatch
    raises the same ``ValueError`` everywhere, before anything is communicated; then it verifies
    the checksum of each array it reads. A file HDF5 cannot read is a ``ValueError`` too."""
    if not os.path.isfile(path):
        raise ValueError(f"--resume={path}: no such checkpoint file")
    try:
        with h5py.File(path, "r") as f:
            return _restore(f, path, cfg, model, params, opt, ctx, steps)
    except (OSError, KeyError, RuntimeError, TypeError) as e:   # truncated, not HDF5, damaged
        raise ValueError(f"--resume={path}: cannot read the checkpoint: {_one_line(e)}") from e


def _restore(f, path, cfg, model, params, opt, ctx, steps) -> int:
    from hpcnn.parallel.tensor.linear import shard_array
    tp_rank, tp_size = (ctx.tp.rank, ctx.tp.size) if ctx is not None else (0, 1)
    fmt = f.attrs.get("format")
    if fmt not in READABLE:
        raise ValueError(f"--resume={path}: checkpoint format {fmt}, this hpcnn reads "
                         f"formats {', '.join(map(str, READABLE))}")
    step, saved_opt = int(f.attrs["step"]), str(f.attrs["optimizer"])
    if saved_opt != cfg.optimizer:
        raise ValueError(f"--resume={path}: saved with optimizer {saved_opt!r}, this run "
                         f"uses {cfg.optimizer!r}")
    _same_model(path, json.loads(f.attrs["config"]), cfg)
    if step >= steps > 0:
        raise ValueError(f"--resume={path}: the checkpoint is at step {step}, nothing is "
                         f"left of the run's {steps} steps")
    saved = f["params"]
    _same_params(path, f, {p.name: _full_shape(p, tp_size) for p in model.params}, cfg)
    if fmt == 1 and (ctx is None or ctx.rank == 0):
        to_stderr(f"hpcnn: note: --resume={path} is a format 1 checkpoint, without checksums: "
                  f"its arrays are not verified")
    optim = f["optim"]

    def read(ds):
        return _verified(ds, path) if fmt >= 2 else ds[...]

    def local(p, full, dtype=None):
        cut = _shard_of(p)
        a = full if cut is None or tp_size == 1 else shard_array(full, cut[0], tp_rank,
                                                                 tp_size, cut[1])
        return backend.asarray(numpy.ascontiguousarray(a).astype(dtype or p.data.dtype,
                                                                 copy=False))

    whole = ctx.whole_parameters(gather=False, write_back=True) if ctx is not None \
        else contextlib.nullcontext()                     # (ZeRO-3: this rank's part kept)
    with whole:
        for p in params:
            wide = backend.compute_dtype(p.data.dtype)   # slots' and master copies' dtype
            value = read(saved[p.name])
            p.data[...] = local(p, value)
            opt.set_master(p.name, local(p, value, wide))   # (sharded, 16-bit: its part)
            if p.name in optim:
                for slot, ds in optim[p.name].items():
                    opt.set_slot(p.name, slot, local(p, read(ds), wide))
    for k, v in optim.attrs.items():
        opt.state[k] = v.item() if hasattr(v, "item") else v
    if ctx is not None and "balancer" in f and len(f["balancer/shares"]) == ctx.dp.size:
        ctx.balancer.shares = numpy.array(read(f["balancer/shares"]))
        ctx.balancer.speeds = numpy.array(read(f["balancer/speeds"]))
    return step


def _same_params(path: str, f, want: dict, cfg) -> None:
    """The checkpoint ``f`` holds exactly the parameters ``want`` names, at those full shapes
    (else the ValueError of the first difference)."""
    saved = f["params"]
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


def _verified(ds, path: str) -> numpy.ndarray:
    """The dataset's array, after checking it against its stored CRC-32."""
    a = ds[...]
    if "crc32" not in ds.attrs:
        raise ValueError(f"--resume={path}: dataset {ds.name} has no checksum (crc32)")
    want, got = int(ds.attrs["crc32"]), checksum(a)
    if got != want:
        raise ValueError(f"--resume={path}: dataset {ds.name} is corrupt: its CRC-32 is "
                         f"{got:08x}, the checkpoint recorded {want:08x}")
    return a


def model_differences(saved: dict, cfg) -> list[str]:
    """The model-defining options (:data:`COMMON_OPTIONS` and the model's
    :data:`MODEL_OPTIONS`) whose value in ``saved``, a checkpoint's config, is not ``cfg``'s, one
    phrase each (options absent from an older file's config are not compared)."""
    names = COMMON_OPTIONS + MODEL_OPTIONS.get(saved.get("model", cfg.model), ())
    now = cfg.to_dict()
    return [f"--{k}={_shown(saved[k])} in the checkpoint, {_shown(now[k])} here"
            for k in names if k in saved and saved[k] != now[k]]


def _same_model(path: str, saved: dict, cfg) -> None:
    """Refuse a checkpoint of another model (:func:`model_differences`)."""
    diff = model_differences(saved, cfg)
    if diff:
        raise ValueError(f"--resume={path}: a checkpoint of another model: " + "; ".join(diff))


def saved_config(path: str) -> dict | None:
    """The config a checkpoint at ``path`` was saved with, or None if the file is no
    checkpoint (not HDF5, or without the format and config attributes)."""
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") not in READABLE or "config" not in f.attrs:
                return None
            return json.loads(f.attrs["config"])
    except (OSError, ValueError, KeyError, RuntimeError, TypeError):
        return None


def stale_temporaries(path: str) -> list[str]:
    """The temporary files a killed save of ``path`` left (``<path>.tmp<pid>``, with ``{step}``
    standing for any step), whose process no longer runs on this host."""
    import glob
    import re
    from hpcnn.log.lock import alive
    pattern = re.escape(path).replace(re.escape("{step}"), r"\d+") + r"\.tmp(\d+)"
    found = []
    for name in glob.glob(glob.escape(path).replace(glob.escape("{step}"), "*") + ".tmp*"):
        m = re.fullmatch(pattern, name)
        if m and int(m.group(1)) != os.getpid() and not alive(int(m.group(1))):
            found.append(name)
    return sorted(found)


def remove_stale(path: str) -> str | None:
    """Remove :func:`stale_temporaries` of ``path``; the line saying so, or None if none."""
    gone = [name for name in stale_temporaries(path) if _remove(name)]
    return (f"hpcnn: removed {len(gone)} temporary file(s) of an interrupted checkpoint save: "
            f"{', '.join(gone)}") if gone else None


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def _padding_hint(saved_json: str, cfg) -> str:
    """Why a GPT's vocabulary-sized tensors may differ: the padding multiple (--pad_vocab, by
    default tp) of the saving run and of this one."""
    saved = json.loads(saved_json)
    was, now = saved.get("pad_vocab") or saved.get("tp", 1), cfg.pad_vocab or cfg.tp
    if cfg.model != "gpt" or was == now:
        return ""
    return (f" (the vocabulary was padded to a multiple of {was}, here of {now}: give both runs "
            f"the same --pad_vocab, e.g. --pad_vocab={max(was, now)})")


def describe(path: str) -> str:
    """A checkpoint in a few lines (``hpcnn report CKPT.h5``): its step, the layout it was saved
    under, the optimizer and the model-defining options (:data:`MODEL_OPTIONS`), what it holds."""
    s = summary(path)
    cfg = s["config"]
    dp, tp, pp = (str(s.get("layout", "?,?,?")).split(",") + ["?"] * 3)[:3]
    names = COMMON_OPTIONS + MODEL_OPTIONS.get(cfg.get("model"), ())
    with h5py.File(path, "r") as f:
        n_params = len(f["params"]) if "params" in f else 0
        values = sum(f["params"][k].size for k in f["params"]) if "params" in f else 0
    return "\n".join([
        f"checkpoint {path} (format {s.get('format')}, hpcnn {s.get('hpcnn_version', '?')})",
        f"step     {s.get('step')} (steps done; --resume continues from here)",
        f"layout   saved at dp={dp} x tp={tp} x pp={pp} (a resume may use another)",
        "options  " + ", ".join(f"{k}={_shown(cfg[k])}" for k in names if k in cfg)
        + f"; optimizer {s.get('optimizer', '?')}",
        f"holds    {n_params} parameter arrays, {values:,} values, with their optimizer slots"])


def summary(path: str) -> dict:
    """The checkpoint's attributes (step, layout, optimizer, config as a dict)."""
    with h5py.File(path, "r") as f:
        out = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
    out["config"] = json.loads(out["config"])
    return out
