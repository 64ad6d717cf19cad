"""The memory one rank needs against the memory its node has for it, before anything is allocated.

:func:`check` (run by :func:`hpcnn.preflight.check`, so before MPI starts in ``hpcnn train``)
refuses a run whose rank would not fit, in one line that names the figures, rather than letting
NumPy die in a MemoryError traceback, or the kernel kill the run, once the model is being built:

- **what a rank needs** (:func:`rank_need`): its parameters, gradients and optimizer state, and
  where the planner prices them its activations. The GPT as :func:`hpcnn.plan.hybrid.rank_memory`
  prices it (its scratch and one micro-batch's held activations included, at ZeRO-2 and 3 the
  one block's gradient buckets a backward binds at least); the MLP as
  :func:`hpcnn.plan.cost.strategy_memory` prices it on one device (cached inputs, ReLU outputs,
  the loss's probabilities), divided by tp x pp; the CNN and the GCN their parameters
  (:func:`param_count`, from the configuration alone) only. The figure is meant as a floor of
  what the run holds, so that a refusal is certain: a rematerialized GPT (``--remat`` sqrt or
  optimal) or MLP counts no activations, a split model the mean share of its ranks.
- **what the node has** (:func:`node_memory`): ``MemAvailable`` of ``/proc/meminfo``, lowered
  by a cgroup's limit where one is set (v2 ``memory.max`` minus ``memory.current``, v1
  ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``, at the process's cgroup and each one
  above it, page cache counted as free). ``HPCNN_MEMORY_BYTES=<bytes>`` pretends the node has
  that much (tests). Where ``/proc/meminfo`` cannot be read (not Linux), nothing is checked; nor
  for ``--device=gpu``, whose model lives in the device's memory.
- **the ranks sharing it** (:func:`ranks_on_node`), without a collective: what the launcher
  announces (MPICH's and Intel MPI's ``MPI_LOCALNRANKS``, Open MPI's
  ``OMPI_COMM_WORLD_LOCAL_SIZE``, or srun's ``SLURM_STEP_TASKS_PER_NODE`` when its step is this
  job). Where none says, the rank is checked alone against the node: assuming that every rank
  of the world shares it would refuse a job spread over nodes for memory it has, so this is
  the answer that never refuses a run that fits.

Unlike the other checks, each node decides from its own memory, so ranks on different nodes may
decide differently: :class:`MemoryRefusal` is printed by every rank that raises it (``hpcnn
train``, :mod:`hpcnn.cli`), and under MPI the job ends once every rank has refused, or is
aborted if some rank's node had the memory: never a rank left waiting.
"""
from __future__ import annotations

import os
import platform

from hpcnn.config import ConfigError, padded_vocab

ENV = "HPCNN_MEMORY_BYTES"      # pretend the node has this many bytes (tests)
GIB = 2**30
SHRINK = {"gpt": "--dim, --n_layers or --batch_size", "mlp": "--hidden or --batch_size",
          "cnn": "--channels", "gcn": "--hidden"}         # the options that make a model smaller
SPLIT = {"gpt": "--tp, --pp", "mlp": "--pp; --tp with --plan", "cnn": "--tp, --pp"}


class MemoryRefusal(ConfigError):
    """A run refused because its rank would not fit in its node's memory. Each node decides from
    its own memory, so the ranks need not agree: every rank that raises it prints it."""


def param_count(cfg, data) -> int:
    """Parameters of the whole model ``cfg`` builds on ``data`` (:func:`hpcnn.task.build_task`),
    from the configuration and the data's sizes alone: nothing is built."""
    def dense(dims):                      # Linear layers (weight and bias) through ``dims``
        return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))
    if cfg.model == "mlp":
        return dense([data.x_train.shape[1], *cfg.hidden, data.n_classes])
    if cfg.model == "gcn":
        return dense([data.features.shape[1] + cfg.spectral_features, *cfg.hidden,
                      data.n_classes])
    if cfg.model == "cnn":                # as build_task: 1 channel, 8 x 8 images, hidden 64
        chans = [1, *cfg.channels]
        convs = sum(9 * a * b + b for a, b in zip(chans[:-1], chans[1:]))
        side = 8 // 2 ** len(cfg.channels)
        return convs + dense([chans[-1] * side * side, 64, data.n_classes])
    d, vocab = cfg.dim, padded_vocab(data.vocab, cfg)
    return (vocab + cfg.block_size) * d + cfg.n_layers * (12 * d * d + 13 * d) + 2 * d + d * vocab


def optimizer_slots(cfg) -> int:
    """Arrays the optimizer keeps per parameter: AdamW's m and v, SGD's momentum (none
    without momentum)."""
    from hpcnn.plan.hybrid import STATE_WORDS
    return 0 if cfg.optimizer == "sgd" and cfg.momentum == 0 else STATE_WORDS[cfg.optimizer] - 2


def rank_need(cfg, data) -> tuple[float, str]:
    """(bytes one rank of ``cfg`` needs at least, what they count): module docstring."""
    from hpcnn.plan import cost, hybrid
    from hpcnn.schedule.placement import Cut
    from hpcnn.nn.precision import storage_dtype
    dtype = storage_dtype(cfg).name                    # (--precision: 16 bits)
    word, slots = hybrid.DTYPE_BYTES[dtype], optimizer_slots(cfg)
    zero = cfg.zero if cfg.dp > 1 else 0
    layout = hybrid.Layout(cfg.dp, cfg.tp, cfg.pp, 1, zero=zero,
                           remat="full" if cfg.remat == "full" else "none")
    per_param = hybrid.state_bytes(cfg.optimizer, layout, word, slots)
    micro = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    state = f"parameters, gradients and {cfg.optimizer} state"
    if cfg.model == "gpt":
        model = hybrid.Transformer(cfg.n_layers, cfg.dim, cfg.n_heads, seq=cfg.block_size,
                                   vocab=padded_vocab(data.vocab, cfg), dtype=dtype,
                                   batch=max(1, cfg.batch_size // micro))
        held = cfg.remat in ("none", "full")
        return (hybrid.rank_memory(model, layout, cfg.optimizer, slots, held, least=True),
                state + (", one micro-batch's activations" if held else ""))
    params, split = param_count(cfg, data), (1 if cfg.model == "gcn" else cfg.tp * cfg.pp)
    if cfg.model == "mlp" and cfg.remat == "none":
        rows = max(1, cfg.batch_size // (cfg.dp * micro))
        graph = cost.mlp_graph([data.x_train.shape[1], *cfg.hidden, data.n_classes], rows)
        one = cost.strategy_memory(graph, [Cut(1, 1, 1)] * len(graph.ops), dtype,
                                   cfg.optimizer)
        extra = hybrid.STATE_WORDS[cfg.optimizer] * word - per_param   # (its state, ours)
        return (one - extra * params) / split, state + ", one micro-batch's activations"
    return per_param * params / split, state


def _meminfo(proc: str) -> float | None:
    """MemAvailable of ``proc``/meminfo in bytes (None: not readable)."""
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _file_cache(text: str | None, names) -> float:
    """The page cache (reclaimable) in a cgroup's memory.stat ``text``: the sum of ``names``."""
    fields = dict(line.split()[:2] for line in (text or "").splitlines() if len(line.split()) >= 2)
    return float(sum(int(fields.get(n, 0)) for n in names))


def _cgroup_levels(root: str, path: str):
    """The directories of cgroup ``path`` under the mount ``root``, it and each one above it
    (the mount's root alone when the path is not there: a cgroup namespace)."""
    here = os.path.join(root, path.strip("/"))
    if not os.path.isdir(here):
        here = root
    out = [here]
    while os.path.normpath(here) != os.path.normpath(root):
        here = os.path.dirname(here)
        out.append(here)
    return out


V2 = ("memory.max", "memory.current", ("active_file", "inactive_file"))
V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file",
                                                        "total_inactive_file"))


def _cgroup_room(proc: str, cgroup_root: str) -> tuple[float, str] | None:
    """(the least room under a cgroup memory limit of this process, its limit file), or None
    where no limit is set: limit minus usage, plus the page cache the kernel reclaims."""
    best = None
    for line in (_read(os.path.join(proc, "self", "cgroup")) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            mounts, (limit_f, usage_f, cache) = (cgroup_root, os.path.join(cgroup_root,
                                                                            "unified")), V2
        elif "memory" in controllers.split(","):
            mounts, (limit_f, usage_f, cache) = (os.path.join(cgroup_root, "memory"),), V1
        else:
            continue
        for mount in (m for m in mounts if os.path.isdir(m)):
            for level in _cgroup_levels(mount, path):
                limit, usage = _read(os.path.join(level, limit_f)), _read(
                    os.path.join(level, usage_f))
                if limit is None or usage is None or not limit.strip().isdigit() \
                        or int(limit) >= 2**60:        # "max" (v2), or v1's "unlimited"
                    continue
                room = int(limit) - int(usage) + _file_cache(
                    _read(os.path.join(level, "memory.stat")), cache)
                if best is None or room < best[0]:
                    best = (float(max(room, 0)), os.path.join(level, limit_f))
    return best


def node_memory(environ=os.environ, proc: str = "/proc",
                cgroup_root: str = "/sys/fs/cgroup") -> tuple[float, str] | None:
    """(bytes this node has for the run, where the figure comes from), None where it cannot be
    read: :data:`ENV` if set, else MemAvailable lowered by a cgroup's limit (module docstring).
    ConfigError when :data:`ENV` is no number of bytes."""
    if environ.get(ENV):
        try:
            return float(int(environ[ENV])), f"{ENV}={environ[ENV]}"
        except ValueError:
            raise ConfigError(f"invalid configuration: {ENV}={environ[ENV]!r}: expected a "
                              f"number of bytes") from None
    avail = _meminfo(proc)
    if avail is None:
        return None
    room = _cgroup_room(proc, cgroup_root)
    if room is not None and room[0] < avail:
        return room[0], f"the cgroup limit {room[1]}, less its usage"
    return avail, f"MemAvailable in {os.path.join(proc, 'meminfo')}"


def _slurm_tasks(environ, world_size: int | None) -> int | None:
    """The least ranks srun puts on a node of its step (``2(x3),1``: 1), when the step is this
    job (``SLURM_STEP_NUM_TASKS`` = the world size); else None."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE", "")
    if not spec or environ.get("SLURM_STEP_NUM_TASKS") != str(world_size):
        return None
    try:
        return min(int(part.split("(")[0]) for part in spec.split(","))
    except ValueError:
        return None


def ranks_on_node(environ=os.environ, world_size: int | None = None) -> tuple[int, str]:
    """(the ranks of this job on this rank's node, who says so): module docstring."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        v = environ.get(name, "")
        if v.isdigit() and int(v) >= 1:
            return int(v), name
    n = _slurm_tasks(environ, world_size) if world_size and world_size > 1 else None
    if n:
        return n, "SLURM_STEP_TASKS_PER_NODE"
    if world_size is None or world_size > 1:
        return 1, "the launcher does not say: this rank alone"
    return 1, "one process"


def _gib(nbytes: float) -> str:
    g = nbytes / GIB
    return f"{g:.0f}" if g >= 100 else f"{g:.3g}"


def check(cfg, data, world_size: int | None = None, environ=os.environ) -> None:
    """Raise :class:`MemoryRefusal` (one line) when one rank of ``cfg`` needs more than its
    share of its node's memory (module docstring); nothing where that memory cannot be read or
    on ``--device=gpu``. ``data``: the data set ``cfg`` names; ``world_size``: the ranks."""
    node = node_memory(environ) if cfg.device == "cpu" else None
    if node is None:
        return
    need, what = rank_need(cfg, data)
    ranks, who = ranks_on_node(environ, world_size)
    avail, source = node
    if need * ranks <= avail:
        return
    shape = {"gpt": f"n_layers={cfg.n_layers}, dim={cfg.dim}, batch_size={cfg.batch_size}",
             "cnn": f"channels={','.join(map(str, cfg.channels))}"}.get(
        cfg.model, f"hidden={','.join(map(str, cfg.hidden))}")
    split = f", split it over more ranks ({SPLIT[cfg.model]})" if cfg.model in SPLIT else ""
    raise MemoryRefusal(
        f"invalid configuration: the {cfg.model} ({shape}) needs {_gib(need)} GiB per rank "
        f"({what}), and its node ({platform.node()}) has {_gib(avail)} GiB available "
        f"({source}) for {ranks} rank{'s' if ranks > 1 else ''} ({who}): {_gib(avail / ranks)} "
        f"GiB each; pass a smaller {SHRINK[cfg.model]}{split}"
        + (" or run fewer ranks per node" if ranks > 1 else ""))
