"""Run configuration: one typed dataclass with commented defaults, and checked overrides.

``hpcnn train --model=gpt --lr=3e-4`` turns each ``--key=value`` into a field of
:class:`TrainConfig`: an unknown key or a value of the wrong type is an error that names it (with
the closest field names), raised identically on every rank before any communication.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass

MODELS = ("mlp", "cnn", "gpt")
DATASETS = ("digits", "shakespeare", "sonnet")
DEFAULT_DATASET = {"mlp": "digits", "cnn": "digits", "gpt": "shakespeare"}


class ConfigError(ValueError):
    """A bad key or value in the run configuration."""


@dataclass
class TrainConfig:
    # -- what to train ----------------------------------------------------------------------
    model: str = "mlp"                  # mlp | cnn | gpt
    dataset: str = ""                   # digits | shakespeare | sonnet (tiny built-in text); "" = model's default
    hidden: tuple[int, ...] = (256, 256)  # MLP hidden widths
    channels: tuple[int, ...] = (16, 32)  # CNN conv channels (one 3x3 conv + 2x2 pool each)
    n_layers: int = 2                   # GPT transformer blocks
    dim: int = 128                      # GPT width (embedding size)
    n_heads: int = 4                    # GPT attention heads (must divide dim)
    block_size: int = 64                # GPT context length in characters
    dropout: float = 0.0                # GPT dropout probability
    half_layers: bool = False           # GPT: each layer as two chain blocks (attention, MLP) for finer remat/pipeline cuts
    max_plays: int = 0                  # Shakespeare: number of plays to load, 0 = all 38
    # -- how long ---------------------------------------------------------------------------
    steps: int = 0                      # optimizer steps; 0 = from epochs (digits), 1000 (text)
    epochs: float = 30.0                # passes over the training set (digits) when steps = 0
    batch_size: int = 64                # global batch (samples, or sequences for the GPT)
    # -- optimizer --------------------------------------------------------------------------
    optimizer: str = "adamw"            # adamw | sgd
    lr: float = 3e-3                    # peak learning rate
    min_lr: float = 0.0                 # final learning rate of the cosine decay
    warmup: int = 0                     # linear warm-up steps
    lr_schedule: str = "cosine"         # cosine | constant (after warm-up)
    momentum: float = 0.9               # SGD momentum
    weight_decay: float = 0.0           # decoupled (AdamW) or L2 (SGD); matrices only
    clip: float = 0.0                   # global gradient-norm clip, 0 = off
    # -- parallelism ------------------------------------------------------------------------
    dp: int = 1                         # data-parallel replicas (world size = dp * tp * pp)
    tp: int = 1                         # tensor-parallel degree (operator parallelism)
    pp: int = 1                         # pipeline stages
    schedule: str = "1f1b"              # pipeline schedule: gpipe | 1f1b | interleaved | zb_h1 | zb_v
    microbatches: int = 1               # pipeline micro-batches per step (per data-parallel rank)
    virtual: int = 1                    # stages per pipeline rank (interleaved 1F1B; gpipe)
    layout: str = ""                    # explicit stage sizes in blocks, e.g. "4|4|3|5"; "" = by cost
    sequence_parallel: bool = False     # tp > 1: LayerNorm/dropout regions split along the sequence
    pad_vocab: int = 0                  # pad the GPT vocabulary to a multiple of this; 0 = of tp
    grad_accum: int = 1                 # micro-batches per rank per step, one allreduce per step
    bucket_mb: float = 25.0             # gradient bucket size for the overlapped allreduce
    allreduce: str = "auto"             # mpi | ring | rd | auto (chosen by size from a start-up calibration)
    overlap: bool = True                # start each bucket's allreduce as soon as its gradients are ready
    balance: str = "equal"              # equal | proportional (batch share proportional to replica speed)
    combine: str = "weighted"           # weighted (exact full-batch gradient) | uniform (plain mean of replicas)
    speeds: str = ""                    # fixed replica speeds "1,3" (proportional); "" = measure online
    rebalance_every: int = 10           # steps between speed measurements and share updates
    slowdown: str = ""                  # EMULATION of slower replicas on one machine: "rank:factor,..."
    slowdown_mode: str = "sleep"        # sleep (independent slower device) | spin (burns the core)
    shard: str = "contiguous"           # contiguous | skewed (global batch sorted by class before splitting)
    # -- memory -----------------------------------------------------------------------------
    remat: str = "none"                 # none | sqrt (uniform checkpoints) | optimal (rotor, within memory_budget)
    memory_budget: float = 0.0          # MiB of activations+caches per rank (a pipeline stage: all its micro-batches)
    offload_gbps: float = 0.0           # remat=optimal: also offload activations over a link of this many GB/s
    # -- numerics and reproducibility -------------------------------------------------------
    seed: int = 0                       # initial weights, batch order and dropout masks
    dtype: str = "float32"              # float32 for training, float64 for exactness checks
    device: str = "cpu"                 # cpu (NumPy) | gpu (CuPy)
    # -- evaluation and logging -------------------------------------------------------------
    eval_interval: int = 100            # steps between evaluations (0 = only at the end)
    eval_batches: int = 8               # GPT: validation batches per evaluation
    log: str = ""                       # HDF5 run log path; "" = runs/<model>-<dataset>-<seed>.h5
    log_interval: int = 10              # steps between log flushes and progress lines
    overwrite: bool = True              # replace an existing log file at the same path
    checkpoint: str = ""                # HDF5 checkpoint to write ("{step}" in it: one file per save)
    checkpoint_every: int = 0           # steps between checkpoints; 0 = at the end only
    resume: str = ""                    # checkpoint to start from (any dp/tp/pp layout)
    progress: bool = True               # print a progress line on rank 0

    def resolved(self) -> "TrainConfig":
        """A copy with derived defaults filled in (dataset, log path), validated."""
        c = dataclasses.replace(self)
        if not c.dataset:
            c.dataset = DEFAULT_DATASET.get(c.model, "")
        if not c.log:
            c.log = f"runs/{c.model}-{c.dataset}-s{c.seed}.h5"
        c.validate()
        return c

    def validate(self) -> None:
        """Check every value's range; raise ConfigError naming the bad ones."""
        errs = []

        def need(ok, msg):
            if not ok:
                errs.append(msg)
        need(self.model in MODELS, f"model={self.model!r}: expected one of {MODELS}")
        need(self.dataset in DATASETS + ("",), f"dataset={self.dataset!r}: expected one of {DATASETS}")
        need(not (self.model in ("mlp", "cnn") and self.dataset in ("shakespeare", "sonnet")),
             f"model={self.model!r} classifies images; dataset={self.dataset!r} is text")
        need(not (self.model == "gpt" and self.dataset == "digits"),
             "model='gpt' needs a text dataset (shakespeare or sonnet), got 'digits'")
        need(self.optimizer in ("adamw", "sgd"), f"optimizer={self.optimizer!r}: expected adamw or sgd")
        need(self.lr_schedule in ("cosine", "constant"),
             f"lr_schedule={self.lr_schedule!r}: expected cosine or constant")
        need(self.dtype in ("float32", "float64"), f"dtype={self.dtype!r}: expected float32 or float64")
        need(self.device in ("cpu", "gpu"), f"device={self.device!r}: expected cpu or gpu")
        need(self.batch_size >= 1, f"batch_size={self.batch_size}: must be >= 1")
        need(self.steps >= 0, f"steps={self.steps}: must be >= 0")
        need(self.steps > 0 or self.epochs > 0, f"steps=0 and epochs={self.epochs}: one must be positive")
        need(self.lr > 0, f"lr={self.lr}: must be > 0")
        need(0 <= self.dropout < 1, f"dropout={self.dropout}: must be in [0, 1)")
        need(self.dim % max(self.n_heads, 1) == 0 and self.n_heads >= 1,
             f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        need(all(h >= 1 for h in self.hidden), f"hidden={self.hidden}: widths must be >= 1")
        need(len(self.channels) >= 1 and all(c >= 1 for c in self.channels),
             f"channels={self.channels}: need at least one positive width")
        need(min(self.dp, self.tp, self.pp) >= 1, f"dp={self.dp}, tp={self.tp}, pp={self.pp}: must be >= 1")
        need(not (self.tp > 1 and self.model == "mlp"),
             f"tp={self.tp} with model='mlp': tensor parallelism is built for gpt and cnn")
        need(self.pad_vocab >= 0, f"pad_vocab={self.pad_vocab}: must be >= 0")
        need(self.schedule in ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_v"),
             f"schedule={self.schedule!r}: expected gpipe, 1f1b, interleaved, zb_h1 or zb_v")
        need(not (self.schedule == "zb_v" and self.pp > 1 and self.virtual != 2),
             f"schedule='zb_v' with virtual={self.virtual}: ZB-V places two stages per rank in "
             f"a V, pass --virtual=2")
        need(self.microbatches >= 1 and self.virtual >= 1,
             f"microbatches={self.microbatches}, virtual={self.virtual}: must be >= 1")
        need(not (self.pp > 1 and self.grad_accum > 1),
             f"grad_accum={self.grad_accum} with pp={self.pp}: use --microbatches")
        need(self.batch_size >= self.dp * self.microbatches,
             f"batch_size={self.batch_size} < dp*microbatches={self.dp * self.microbatches}")
        need(self.grad_accum >= 1, f"grad_accum={self.grad_accum}: must be >= 1")
        need(self.bucket_mb > 0, f"bucket_mb={self.bucket_mb}: must be > 0")
        need(self.allreduce in ("mpi", "ring", "rd", "auto"),
             f"allreduce={self.allreduce!r}: expected mpi, ring, rd or auto")
        need(self.balance in ("equal", "proportional"), f"balance={self.balance!r}: expected equal or proportional")
        need(self.combine in ("weighted", "uniform"), f"combine={self.combine!r}: expected weighted or uniform")
        need(self.rebalance_every >= 1, f"rebalance_every={self.rebalance_every}: must be >= 1")
        need(self.slowdown_mode in ("sleep", "spin"), f"slowdown_mode={self.slowdown_mode!r}: expected sleep or spin")
        need(self.shard in ("contiguous", "skewed"), f"shard={self.shard!r}: expected contiguous or skewed")
        need(self.batch_size >= self.dp * self.grad_accum,
             f"batch_size={self.batch_size} < dp*grad_accum={self.dp * self.grad_accum}: every "
             f"replica needs at least one sample per micro-batch")
        need(self.remat in ("none", "sqrt", "optimal"),
             f"remat={self.remat!r}: expected none, sqrt or optimal")
        need(not (self.remat == "optimal" and not self.memory_budget > 0),
             f"remat='optimal' needs --memory_budget > 0 (MiB), got {self.memory_budget}")
        need(self.memory_budget >= 0 and self.offload_gbps >= 0,
             f"memory_budget={self.memory_budget}, offload_gbps={self.offload_gbps}: must be >= 0")
        need(not (self.offload_gbps > 0 and self.remat != "optimal"),
             f"offload_gbps={self.offload_gbps} needs remat='optimal' (got {self.remat!r})")
        need(not (self.remat != "none" and self.pp > 1 and self.schedule in ("zb_h1", "zb_v")),
             f"remat={self.remat!r} with schedule={self.schedule!r}: a rematerialized stage runs its "
             f"backward whole; use 1f1b, gpipe or interleaved")
        need(not (self.half_layers and (self.model != "gpt" or self.tp > 1)),
             f"half_layers needs model='gpt' and tp=1 (got model={self.model!r}, tp={self.tp})")
        need(self.log_interval >= 1, f"log_interval={self.log_interval}: must be >= 1")
        need(self.checkpoint_every >= 0 and not (self.checkpoint_every and not self.checkpoint),
             f"checkpoint_every={self.checkpoint_every}: must be >= 0, and needs --checkpoint")
        need(self.eval_interval >= 0, f"eval_interval={self.eval_interval}: must be >= 0")
        if errs:
            raise ConfigError("invalid configuration: " + "; ".join(errs))

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(key: str, raw: str, typ):
    """Parse the string ``raw`` as ``typ`` (bool, int, float, str, tuple[int, ...])."""
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        if typ is str:
            return raw
        if typing.get_origin(typ) is tuple:
            inner = typing.get_args(typ)[0]
            return tuple(inner(p) for p in raw.replace(" ", "").split(",") if p != "")
    except ValueError:
        pass
    tname = getattr(typ, "__name__", None) or str(typ).replace("typing.", "")
    if typing.get_origin(typ) is tuple:
        tname = "comma-separated integers"
    raise ConfigError(f"--{key}={raw!r}: expected {tname}")


def parse_overrides(args, base: TrainConfig | None = None, cls=TrainConfig):
    """Apply ``["--key=value", ...]`` to ``base`` (default config); return the new config.

    Errors (all collected, then raised as one ConfigError): an argument not of the form
    ``--key=value``, an unknown key (closest names suggested), a value of the wrong type.
    """
    cfg = dataclasses.replace(base) if base is not None else cls()
    types = _field_types(type(cfg))
    errs = []
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            errs.append(f"{arg!r}: expected --key=value")
            continue
        key, raw = arg[2:].split("=", 1)
        key = key.replace("-", "_")
        if key not in types:
            close = difflib.get_close_matches(key, types, n=3)
            hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
            errs.append(f"unknown option --{key}{hint}")
            continue
        try:
            setattr(cfg, key, _convert(key, raw, types[key]))
        except ConfigError as e:
            errs.append(str(e))
    if errs:
        raise ConfigError("; ".join(errs))
    return cfg


def describe(cls=TrainConfig) -> str:
    """The fields with their defaults and comments, for ``hpcnn train --help``."""
    import inspect
    import re
    lines = []
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        m = re.fullmatch(r"(\w+): [^=]+= (.+?)\s+# (.*)", s)
        if s.startswith("# --"):
            lines.append(s.strip("# -").strip() + ":")
        elif m:
            lines.append(f"  --{m.group(1)}={m.group(2).strip(chr(34)):<14} {m.group(3)}")
    return "\n".join(lines)
