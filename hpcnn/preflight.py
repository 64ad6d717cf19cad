"""The checks of a run that need more than its options: the number of ranks, the data, the model.

:meth:`hpcnn.config.TrainConfig.validate` checks each option's range and the combinations the
engine cannot run from the options alone. :func:`check` adds what needs the world size (dp·tp·pp
must equal it), the loaded data (a context window longer than the validation text, a batch larger
than the training set), the model's length (a ``--layout`` that does not sum to it, more pipeline
stages than blocks), the ``--log`` path (another live run writing it: its lock) and the paths of
the files a run writes (:func:`_path_errors`: the log, the checkpoint and the resumed file not
one another; the checkpoint's folder writable; no other model's checkpoint and no other file
replaced), and last the memory a rank needs against its node's (:mod:`hpcnn.memory_check`,
before anything of the model is allocated). It communicates
with no one: every rank loads the same data and builds the same shapes, so every rank takes the
same decision, before the first collective; but for the memory, which each node reads for itself
(:class:`~hpcnn.memory_check.MemoryRefusal`, printed by every rank that raises it).
``hpcnn train`` runs it before MPI is even initialised, with the world size the launcher announces
(:func:`world_size_from_env`), so that a refused run prints one line and starts no MPI at all.
"""
from __future__ import annotations

import os

from hpcnn.config import ConfigError, TrainConfig

# what MPI launchers put in each rank's environment: the number of ranks
# (MPICH, Intel MPI and Open MPI; not Slurm's, which a serial run inside an allocation also sees)
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")


def _from_env(names) -> int | None:
    for k in names:
        v = os.environ.get(k, "")
        if v.isdigit():
            return int(v)
    return None


def world_size_from_env() -> int | None:
    """The number of ranks as the MPI launcher announces it (None when not launched by one, or
    by one this does not know: then :func:`hpcnn.train.train` checks it after MPI starts)."""
    return _from_env(_SIZE_VARIABLES)


def rank_from_env() -> int:
    """This process's rank as the launcher announces it (0 when not launched by one)."""
    return _from_env(_RANK_VARIABLES) or 0


def _nodes_fit(cfg: TrainConfig, world_size: int) -> None:
    """--nodes: at most one emulated node a rank; HPCNN_NODES: a number (it counts the job's
    ranks, of which this run may use some)."""
    from hpcnn.parallel.collectives import topology
    try:
        if not cfg.nodes:                  # (the option wins over the variable)
            topology.from_env()
    except topology.TopologyError as e:
        raise ConfigError(f"invalid configuration: {e}") from None
    if cfg.nodes > world_size:
        raise ConfigError(f"invalid configuration: nodes={cfg.nodes} emulated nodes for "
                          f"{world_size} rank(s): at most one node a rank")


def check(cfg: TrainConfig, world_size: int | None = None, data=None):
    """Raise ConfigError naming every option the ranks, the data or the model cannot serve, then
    :class:`~hpcnn.memory_check.MemoryRefusal` if a rank would not fit in its node's memory;
    else return the data (loaded unless given), for the run to use.

    ``cfg`` is a resolved configuration (:meth:`TrainConfig.resolved`, which has validated it);
    ``world_size`` the number of ranks (None: not checked).
    """
    from hpcnn import datasets, memory_check
    from hpcnn.parallel.collectives.grid import GridError, check_layout
    if world_size is not None:     # --model=gpt --plan=auto: check the layout it chooses
        cfg, _, data = planned(cfg, world_size, data)
    if world_size is not None:     # refused without loading the data
        try:
            check_layout(world_size, cfg.dp, cfg.tp, cfg.pp)     # ProcessGrid's own check
        except GridError as e:
            raise ConfigError(f"invalid configuration: {e} (pass --dp/--tp/--pp that multiply "
                              f"to the number of ranks)") from None
        _nodes_fit(cfg, world_size)
    data = data if data is not None else datasets.for_config(cfg)
    errs = datasets.misfits(cfg, data)
    if not errs and cfg.pp > 1:
        errs += _stage_errors(cfg, data)
    if cfg.plan and cfg.plan != "auto":
        errs += _plan_errors(cfg)
    errs += _log_errors(cfg) + _path_errors(cfg)
    if not errs and cfg.checkpoint:
        errs += _space_errors(cfg, data)
    if errs:
        raise ConfigError("invalid configuration: " + "; ".join(errs))
    memory_check.check(cfg, data, world_size)       # this node's memory: MemoryRefusal
    return data


def planned(cfg: TrainConfig, world_size: int, data=None):
    """(the config with its layout chosen, the choice's record for the run log, the data):
    ``--model=gpt --plan=auto`` takes dp, tp, pp, schedule, micro-batches and a stage cut
    (``--layout``) from
    :func:`hpcnn.plan.auto.choose_gpt_layout` (a pure function of the config, the vocabulary, the
    machine file and ``world_size``: every rank takes the same, before any collective); any
    other run is returned as it is, with no record. ``--model=gcn`` takes ``batch_size`` = the
    graph's nodes: a step is one full-batch pass (another value than the default or the node
    count is refused). ConfigError when no layout can be chosen or that batch is refused."""
    if cfg.model != "gcn" and not (cfg.model == "gpt" and cfg.plan == "auto"):
        return cfg, None, data
    from hpcnn import datasets
    data = data if data is not None else datasets.for_config(cfg)
    if cfg.model == "gcn":
        from dataclasses import replace
        if cfg.batch_size not in (TrainConfig.batch_size, data.n_nodes):
            raise ConfigError(f"invalid configuration: batch_size={cfg.batch_size}: model='gcn' "
                              f"runs full-batch steps, {data.n_nodes} nodes of {cfg.dataset}; "
                              f"leave --batch_size unset or pass {data.n_nodes}")
        return replace(cfg, batch_size=data.n_nodes), None, data
    from hpcnn.plan.auto import choose_gpt_layout
    chosen, record = choose_gpt_layout(cfg, world_size, data.vocab)
    return chosen, record, data


def _log_errors(cfg: TrainConfig) -> list[str]:
    """--log: not a folder; a file can be created there (:func:`hpcnn.log.paths.
    creation_problem`; before the lock, which an unreadable folder would make look held); no
    live run holds its lock (:mod:`hpcnn.log.lock`; rank 0 takes it
    after these checks, when it creates the file) and, with --overwrite=false, no file is
    there yet."""
    from hpcnn.log.lock import refusal
    from hpcnn.log.paths import creation_problem
    if os.path.isdir(cfg.log):
        return [f"log={cfg.log!r} is a directory: pass a file name, e.g. "
                f"--log={os.path.join(cfg.log, 'run.h5')}"]
    if os.path.exists(cfg.log) and not cfg.overwrite:
        return [f"log={cfg.log!r} already exists (pass --overwrite=true to replace it)"]
    why = creation_problem(cfg.log)
    if why:
        return [f"log={cfg.log!r} cannot be written: {why}"]
    locked = refusal(cfg.log)
    return [locked] if locked else []


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (symbolic links resolved); ``{step}`` in ``a``
    (a checkpoint's) stands for any step."""
    import re
    if "{step}" not in a:
        return os.path.realpath(a) == os.path.realpath(b)
    pattern = re.escape(os.path.realpath(a)).replace(re.escape("{step}"), r"\d+")
    return re.fullmatch(pattern, os.path.realpath(b)) is not None


def _path_errors(cfg: TrainConfig) -> list[str]:
    """The files the run writes: the log is neither the checkpoint nor the resumed file (the run
    log would replace it; --resume=P --checkpoint=P, a run that resumes and keeps saving to one
    file, is the resumable job's pattern); the checkpoint's destination
    (:func:`_destination_errors`)."""
    errs = [f"log={cfg.log!r} and {role}={getattr(cfg, role)!r} are the same file: the run log "
            f"would replace the checkpoint; pass another --log"
            for role in ("checkpoint", "resume")
            if getattr(cfg, role) and _same_file(getattr(cfg, role), cfg.log)]
    return errs or (_destination_errors(cfg) if cfg.checkpoint else [])


def _destination_errors(cfg: TrainConfig) -> list[str]:
    """--checkpoint, before step 0 rather than at the first save: not a folder; its folder (or
    the nearest existing one above, where the save creates the rest) a writable folder
    (:func:`hpcnn.log.paths.creation_problem`); no live run holds its lock; a file
    there, unless it is the resumed one, a checkpoint of the same model (another model's, or a
    file that is no checkpoint, is not replaced)."""
    import glob
    from hpcnn import checkpoint
    from hpcnn.log.paths import creation_problem
    from hpcnn.log.lock import refusal
    path = cfg.checkpoint
    first = path.replace("{step}", "1")
    if os.path.isdir(first):
        return [f"checkpoint={path!r} is a directory: pass a file name, e.g. "
                f"--checkpoint={os.path.join(path, 'run.ckpt.h5')}"]
    why = creation_problem(first)
    if why:
        return [f"checkpoint={path!r} cannot be written: {why}"]
    locked = refusal(path, "checkpoint", "--checkpoint")
    if locked:
        return [locked]
    there = [n for n in glob.glob(glob.escape(path).replace("{step}", "[0-9]*"))
             if _same_file(path, n)]                      # {step}: the file of any step
    for old in sorted(there):
        if cfg.resume and os.path.realpath(old) == os.path.realpath(cfg.resume):
            continue
        saved = checkpoint.saved_config(old)
        if saved is None:
            return [f"checkpoint={path!r}: {old} exists and is not a checkpoint: it is not "
                    f"replaced (remove it or pass another --checkpoint)"]
        diff = checkpoint.model_differences(saved, cfg)
        if diff:
            return [f"checkpoint={path!r}: {old} holds a checkpoint of another model ("
                    + "; ".join(diff) + "): it is not replaced (remove it or pass another "
                    "--checkpoint)"]
    return []


def checkpoint_bytes(cfg: TrainConfig, data) -> int:
    """The size of one checkpoint of ``cfg`` on ``data``: every parameter and optimizer slot at
    the run's precision (the HDF5 headers' few KiB aside)."""
    from hpcnn.memory_check import optimizer_slots, param_count
    from hpcnn.plan.hybrid import DTYPE_BYTES
    return param_count(cfg, data) * (1 + optimizer_slots(cfg)) * DTYPE_BYTES[cfg.dtype]


def _space_errors(cfg: TrainConfig, data) -> list[str]:
    """--checkpoint: its file system has the room for the first checkpoint (written beside the
    previous one, then renamed over it)."""
    import shutil
    from hpcnn.log.paths import nearest_folder
    folder = nearest_folder(cfg.checkpoint)
    need, free = checkpoint_bytes(cfg, data), shutil.disk_usage(folder).free
    if free >= need:
        return []
    return [f"checkpoint={cfg.checkpoint!r}: a checkpoint of this model takes {need / 2**20:.1f} "
            f"MiB, {folder} has {free / 2**20:.1f} MiB free: free some, or pass a --checkpoint "
            f"on another file system"]


def _plan_errors(cfg: TrainConfig) -> list[str]:
    """--plan=FILE: the file reads and its layouts fit the --tp ranks (every rank reads it)."""
    from hpcnn.schedule.placement import read_plan
    try:
        cuts = read_plan(cfg.plan, devices=cfg.tp)
    except OSError as e:
        return [f"plan={cfg.plan!r}: cannot read the plan file ({e.strerror})"]
    except ValueError as e:
        return [str(e)]
    n_layers = len(cfg.hidden) + 1
    return [] if len(cuts) == n_layers else [
        f"plan={cfg.plan!r}: {len(cuts)} layouts for the MLP's {n_layers} Linear layers "
        f"(hidden={','.join(map(str, cfg.hidden))})"]


def _stage_errors(cfg: TrainConfig, data) -> list[str]:
    """pp > 1: the stages must cut the model's blocks (shapes only: no parameter is stored)."""
    from hpcnn.task import build_task
    try:
        model = build_task(cfg, None, data=data, keep=()).model
    except ValueError as e:      # what the options checks did not foresee: still one line
        return [f"the model cannot be built: {e}"]
    n, stages = len(model), cfg.pp * cfg.virtual
    if cfg.layout:
        sizes = [int(s) for s in cfg.layout.split("|")]
        if sum(sizes) != n or min(sizes) < 1:
            return [f"layout={cfg.layout!r}: the {cfg.model} has {n} blocks, the stage sizes "
                    f"{sizes} sum to {sum(sizes)} (each stage needs at least one)"]
    elif stages > n:
        return [f"pp*virtual = {cfg.pp}*{cfg.virtual} = {stages} stages, the {cfg.model} has "
                f"{n} blocks: every stage needs at least one"]
    return []
