"""Run configuration: one typed dataclass with commented defaults, and checked overrides.

``hpcnn train --model=gpt --lr=3e-4`` turns each ``--key=value`` into a field of
:class:`TrainConfig`: an unknown key or a value of the wrong type is an error that names it (with
the closest field names), raised identically on every rank before any communication.

Every option has its range in one place: :data:`CHOICES` (named values), :data:`RANGES`
(intervals; floats also finite) or :data:`FREE` (switches and paths, and three strings parsed as
the run parses them). :func:`combination_errors` refuses what the engine cannot run together
(e.g. ``--schedule=interleaved`` with a micro-batch count the schedule cannot use); checks that
need the data or the model's length are in :mod:`hpcnn.preflight`.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import numbers
import re
import typing
from dataclasses import dataclass

from hpcnn.schedule.pipeline import SCHEDULES
from hpcnn.signals import STOP_SIGNALS

MODELS = ("mlp", "cnn", "gpt", "gcn")
GRAPH_PARTITIONS = ("contiguous", "random", "spectral", "metis")  # hpcnn.graph.partitioners
GRAPH_DATASETS = ("karate", "lesmis", "digits_knn", "sbm", "sbm20k")   # hpcnn.graph.nodes.makers
DATASETS = ("digits", "shakespeare", "sonnet") + GRAPH_DATASETS
DEFAULT_DATASET = {"mlp": "digits", "cnn": "digits", "gpt": "shakespeare", "gcn": "karate"}


class ConfigError(ValueError):
    """A bad key or value in the run configuration, or a combination the engine cannot run.

    Raised identically on every rank (the checks read only the configuration and data that every
    rank loads alike, or gather every rank's verdict first), so that the command line prints it
    once and every rank stops with exit code 2."""


@dataclass
class TrainConfig:
    # -- what to train ----------------------------------------------------------------------
    model: str = "mlp"                  # mlp | cnn | gpt | gcn (graph convolution, node classification)
    dataset: str = ""                   # digits | shakespeare | sonnet (tiny built-in text) | karate | lesmis | digits_knn | sbm (graphs, gcn); "" = model's default
    hidden: tuple[int, ...] = (256, 256)  # MLP (and GCN) hidden widths
    partition: str = "contiguous"       # GCN: who holds which graph rows: contiguous | random | spectral (recursive bisection) | metis (needs pymetis)
    channels: tuple[int, ...] = (16, 32)  # CNN conv channels (one 3x3 conv + 2x2 pool each)
    n_layers: int = 2                   # GPT transformer blocks
    dim: int = 128                      # GPT width (embedding size)
    n_heads: int = 4                    # GPT attention heads (must divide dim)
    block_size: int = 64                # GPT context length in characters
    dropout: float = 0.0                # GPT dropout probability
    half_layers: bool = False           # GPT: each layer as two chain blocks (attention, MLP) for finer remat/pipeline cuts
    spectral_features: int = 0          # GCN: append the k dominant eigenvectors of Â to the node features (k; 0 = off)
    coarsen: str = "none"               # GCN: train on a coarsened graph, evaluate on the full one: none | heavy_edge | spectral | random
    reduction: float = 1.0              # GCN --coarsen: coarse nodes / nodes (in (0, 1])
    max_plays: int = 0                  # Shakespeare: number of plays to load, 0 = all 38
    # -- how long ---------------------------------------------------------------------------
    steps: int = 0                      # optimizer steps; 0 = from epochs (digits, graphs), 1000 (text)
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
    zero: int = 0                       # ZeRO stage: 1 = optimizer state sharded over the dp ranks (each updates 1/dp of the parameters, then they are gathered); 2 = gradients too (reduce-scattered per bucket, held only while a bucket is in use); 3 = parameters too (each block's gathered before its forward and backward, freed after); 0 = every rank holds all of it
    divergence: float = 100.0           # a loss above this many times the run's first is named as divergence in the log and the result line (0 = off; a non-finite loss always stops the run)
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
    allreduce: str = "auto"             # mpi | ring | rd | shm | cma | hier (two levels: nodes, then across them) | auto (chosen by size from a start-up calibration)
    overlap: bool = True                # reduce each bucket during the backward (rd and cma block: after it)
    balance: str = "equal"              # equal | proportional (batch share proportional to replica speed)
    combine: str = "weighted"           # weighted (exact full-batch gradient) | uniform (plain mean of replicas)
    speeds: str = ""                    # fixed replica speeds "1,3" (proportional); "" = measure online
    rebalance_every: int = 10           # steps between speed measurements and share updates
    slowdown: str = ""                  # EMULATION of slower replicas on one machine: "rank:factor,..."
    slowdown_mode: str = "sleep"        # sleep (independent slower device) | spin (burns the core)
    shard: str = "contiguous"           # contiguous | skewed (global batch sorted by class before splitting)
    # -- memory -----------------------------------------------------------------------------
    remat: str = "none"                 # none | sqrt (uniform checkpoints) | full (every block) | optimal (rotor, within memory_budget)
    memory_budget: float = 0.0          # MiB of activations+caches per rank (a pipeline stage: all its micro-batches)
    offload_gbps: float = 0.0           # remat=optimal: also offload activations over a link of this many GB/s
    # -- numerics and reproducibility -------------------------------------------------------
    seed: int = 0                       # initial weights, batch order and dropout masks
    dtype: str = "float32"              # float32 for training, float64 for exactness checks
    precision: str = "fp32"             # fp32 | bf16 | fp16: parameters and activations in 16 bits, matmuls, statistics, gradients, master copy and optimizer state in fp32 (gpt, mlp; needs --dtype=float32)
    grad_reduce_dtype: str = "fp32"     # bf16/fp16: the gradient buckets reduced in fp32, or cast to the parameters' 16 bits for the message (param: half the bytes)
    loss_scale_init: float = 65536.0    # fp16: the first loss scale (torch GradScaler's 2**16)
    loss_scale_growth: float = 2.0      # fp16: the scale's factor after loss_scale_growth_interval good steps in a row
    loss_scale_backoff: float = 0.5     # fp16: the scale's factor at a step with an inf/NaN gradient (the step is skipped)
    loss_scale_growth_interval: int = 2000  # fp16: good steps in a row before the scale grows
    device: str = "cpu"                 # cpu (NumPy) | gpu (CuPy) | strict (NumPy with a GPU's checks)
    gpu_comm: str = "auto"              # collectives of device arrays: auto (nccl where CuPy has NCCL, else mpi where MPI is CUDA-aware, else staged) | nccl | mpi (CUDA-aware MPI; HPCNN_CUDA_AWARE=0|1 overrides its detection) | staged (through host memory)
    share_gpus: bool = False            # let the ranks of a node share its GPUs (else a node with more ranks than GPUs is refused)
    nodes: int = 0                      # emulate this many nodes of consecutive ranks on this machine (0: the real ones, or HPCNN_NODES)
    # -- evaluation and logging -------------------------------------------------------------
    eval_interval: int = 100            # steps between evaluations (0 = only at the end)
    eval_batches: int = 8               # GPT: validation batches per evaluation
    log: str = ""                       # HDF5 run log path; "" = runs/<model>-<dataset>-<seed>.h5
    log_interval: int = 10              # steps between log flushes and progress lines
    overwrite: bool = True              # replace an existing log file at the same path
    log_durable: bool = False           # fsync the log's journal and file at every flush: survives power loss, costs 2 fsyncs a flush
    checkpoint: str = ""                # HDF5 checkpoint to write ("{step}" in it: one file per save)
    checkpoint_every: int = 0           # steps between checkpoints; 0 = at the end only
    resume: str = ""                    # checkpoint to start from (any dp/tp/pp layout)
    stop_signal: str = "USR1"           # on this signal: stop at a step all ranks agree on, checkpoint, log "stopped", exit 0 (none = ignore it)
    progress: bool = True               # print a progress line on rank 0
    hang_timeout: float = 300.0         # seconds one rank may wait inside one communication call before the job is reported as hung and aborted (0 = no watchdog; else >= 1)
    show_schedule: bool = False         # print (and log) each rank's first step as the schedule it ran
    plan: str = ""                      # MLP: per-Linear layouts over the --tp ranks: a JSON plan file, or auto (the planner's search); GPT: auto (dp x tp x pp, schedule, micro-batches of least predicted step)
    machine: str = ""                   # --plan=auto for the GPT: machine file (machines/*.toml); "" = this machine's (as hpcnn.plan.machine.this_machine)

    def resolved(self) -> "TrainConfig":
        """A copy with derived defaults filled in (dataset, log path), validated."""
        c = dataclasses.replace(self)
        for f in dataclasses.fields(c):          # hidden=[64, 32] from Python: a tuple, as parsed
            if isinstance(getattr(c, f.name), list):
                setattr(c, f.name, tuple(getattr(c, f.name)))
        if not c.dataset:
            c.dataset = DEFAULT_DATASET.get(c.model, "")
        if not c.log:
            c.log = f"runs/{c.model}-{c.dataset}-s{c.seed}.h5"
        c.validate()
        return c

    def validate(self) -> None:
        """Check every option's range (:data:`CHOICES`, :data:`RANGES`, :func:`_syntax_errors`)
        and every combination the engine cannot run; raise one ConfigError naming them all.

        The checks read the configuration alone (and whether CuPy is importable), so every rank
        takes the same decision before any communication. Those that need the data or the
        model's length are in :mod:`hpcnn.preflight`.
        """
        errs = option_errors(self)
        if all(isinstance(getattr(self, n), (numbers.Real, tuple)) for n in RANGES):
            errs += combination_errors(self)       # they compare numbers: not on a string
        if errs:
            raise ConfigError("invalid configuration: " + "; ".join(errs))

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


# -- the range of every option ---------------------------------------------------------------
ALLREDUCE = ("mpi", "ring", "rd", "shm", "cma", "hier", "auto")
CHOICES = {            # option -> its allowed values
    "model": MODELS, "dataset": DATASETS + ("",), "optimizer": ("adamw", "sgd"),
    "lr_schedule": ("cosine", "constant"), "allreduce": ALLREDUCE,
    "balance": ("equal", "proportional"), "combine": ("weighted", "uniform"),
    "slowdown_mode": ("sleep", "spin"), "shard": ("contiguous", "skewed"),
    "partition": GRAPH_PARTITIONS,
    "remat": ("none", "sqrt", "full", "optimal"), "dtype": ("float32", "float64"), "device": ("cpu", "gpu", "strict"),
    "gpu_comm": ("auto", "nccl", "mpi", "staged"),
    "precision": ("fp32", "bf16", "fp16"), "grad_reduce_dtype": ("fp32", "param"),
    "schedule": tuple(SCHEDULES), "stop_signal": STOP_SIGNALS,
    "coarsen": ("none", "heavy_edge", "spectral", "random"),
}


@dataclass(frozen=True)
class Range:
    """A numeric interval; ``open_lo``/``open_hi`` exclude the bound. Floats must also be
    finite (``inf`` and ``nan`` parse as floats but are no learning rate or epoch count)."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False

    def __contains__(self, v) -> bool:
        if not isinstance(v, numbers.Real):        # a string or a list from Python: no number
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.open_lo else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.open_hi else v <= self.hi)

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}"
                    f"{')' if self.open_hi else ']'}")
        if self.lo is not None:
            return f"{'>' if self.open_lo else '>='} {self.lo:g}"
        return f"{'<' if self.open_hi else '<='} {self.hi:g}"


AT_LEAST_0, AT_LEAST_1, POSITIVE, UNIT = Range(0), Range(1), Range(0, open_lo=True), \
    Range(0, 1, open_hi=True)
RANGES = {             # option -> its interval (for a tuple option: every element's)
    "hidden": AT_LEAST_1, "channels": AT_LEAST_1, "n_layers": AT_LEAST_1, "dim": AT_LEAST_1,
    "n_heads": AT_LEAST_1, "block_size": AT_LEAST_1, "dropout": UNIT, "max_plays": AT_LEAST_0,
    "steps": AT_LEAST_0, "epochs": AT_LEAST_0, "batch_size": AT_LEAST_1, "lr": POSITIVE,
    "min_lr": AT_LEAST_0, "warmup": AT_LEAST_0, "momentum": UNIT, "weight_decay": AT_LEAST_0,
    "clip": AT_LEAST_0, "divergence": AT_LEAST_0, "zero": Range(0, 3),
    "dp": AT_LEAST_1, "tp": AT_LEAST_1, "pp": AT_LEAST_1,
    "microbatches": AT_LEAST_1, "virtual": AT_LEAST_1, "pad_vocab": AT_LEAST_0,
    "grad_accum": AT_LEAST_1, "bucket_mb": POSITIVE, "rebalance_every": AT_LEAST_1,
    "memory_budget": AT_LEAST_0, "offload_gbps": AT_LEAST_0,
    "seed": AT_LEAST_0,            # NumPy's generators take non-negative seeds only
    "eval_interval": AT_LEAST_0, "eval_batches": AT_LEAST_1, "log_interval": AT_LEAST_1,
    "checkpoint_every": AT_LEAST_0, "hang_timeout": AT_LEAST_0,
    "spectral_features": AT_LEAST_0, "reduction": Range(0, 1, open_lo=True),
    "loss_scale_init": POSITIVE, "loss_scale_growth": Range(1, open_lo=True),
    "loss_scale_backoff": Range(0, 1, open_lo=True, open_hi=True),
    "loss_scale_growth_interval": AT_LEAST_1, "nodes": AT_LEAST_0,
}
# --hang_timeout: the least seconds in one call that report a hang and abort the job (a
# collective waits that long for a peer's compute in healthy runs; 0 turns the watchdog off)
MIN_HANG_TIMEOUT = 1.0
# options with any value of their type: switches and paths; layout, speeds and slowdown are
# parsed by _syntax_errors
FREE = ("half_layers", "sequence_parallel", "overlap", "overwrite", "log_durable", "progress",
        "show_schedule", "share_gpus",
        "log", "checkpoint", "resume", "layout", "speeds", "slowdown", "plan", "machine")


def option_errors(c: TrainConfig) -> list[str]:
    """One message per option whose value is outside its range or choices (or malformed)."""
    errs = []
    for name, allowed in CHOICES.items():
        v = getattr(c, name)
        if v not in allowed:
            errs.append(f"{name}={v!r}: expected one of {', '.join(a for a in allowed if a)}")
    for name, rng in RANGES.items():
        v = getattr(c, name)
        if isinstance(v, tuple):
            if not all(x in rng for x in v):
                errs.append(f"{name}={','.join(map(str, v))}: every entry must be {rng}")
        elif v not in rng:
            finite = "finite and " if isinstance(v, float) and not math.isfinite(v) else ""
            errs.append(f"{name}={v!r}: must be {finite}{rng}")
    return errs + _syntax_errors(c)


def _syntax_errors(c: TrainConfig) -> list[str]:
    """--layout, --speeds and --slowdown parsed as the run will parse them (against dp)."""
    from hpcnn.parallel.data import hetero
    errs = []
    if c.layout and not re.fullmatch(r"\s*\d+\s*(\|\s*\d+\s*)*", c.layout):
        errs.append(f"layout={c.layout!r}: expected block counts separated by '|', e.g. '4|4|3|5'")
    if c.dp >= 1:
        for parse, spec in ((hetero.parse_speeds, c.speeds), (hetero.slowdowns_from_config,
                                                               c.slowdown)):
            if spec:
                try:
                    parse(spec, c.dp)
                except ValueError as e:
                    errs.append(str(e))
    return errs


def combination_errors(c: TrainConfig) -> list[str]:
    """One message per combination of options the engine cannot run (each names them)."""
    errs = []

    def need(ok, msg):
        if not ok:
            errs.append(msg)
    need(not (c.model in ("mlp", "cnn") and c.dataset in ("shakespeare", "sonnet")),
         f"model={c.model!r} classifies images; dataset={c.dataset!r} is text")
    need(not (c.model == "gpt" and c.dataset == "digits"),
         "model='gpt' needs a text dataset (shakespeare or sonnet), got 'digits'")
    need(c.steps > 0 or c.epochs > 0, f"steps=0 and epochs={c.epochs}: one must be positive")
    need(not c.min_lr > c.lr, f"min_lr={c.min_lr} > lr={c.lr}: the decay ends below the peak")
    if c.model == "gpt" and c.n_heads >= 1:
        need(c.dim % c.n_heads == 0, f"dim={c.dim} is not divisible by n_heads={c.n_heads}")
    _tensor_parallel_errors(c, need)
    _graph_errors(c, need)
    _precision_errors(c, need)
    _pipeline_errors(c, need)        # (pp = 1 ignores the pipeline options, so that a serial
    #                                  reference run can take the same command line)
    need(not (c.remat != "none" and c.pp > 1 and c.schedule in ("zb_h1", "zb_v")),
         f"remat={c.remat!r} with schedule={c.schedule!r}: a rematerialized stage runs its "
         f"backward whole; use 1f1b, gpipe or interleaved")
    # -- data parallelism --
    need(c.batch_size >= c.dp * c.grad_accum,
         f"batch_size={c.batch_size} < dp*grad_accum={c.dp * c.grad_accum}: every "
         f"replica needs at least one sample per micro-batch")
    need(not (c.speeds and c.balance != "proportional"),
         f"speeds={c.speeds!r} with balance={c.balance!r}: fixed speeds set proportional "
         f"shares (--balance=proportional)")
    _zero_errors(c, need)
    # -- memory --
    need(not (c.remat == "optimal" and not c.memory_budget > 0),
         f"remat='optimal' needs --memory_budget > 0 (MiB), got {c.memory_budget}")
    need(not (c.offload_gbps > 0 and c.remat != "optimal"),
         f"offload_gbps={c.offload_gbps} needs remat='optimal' (got {c.remat!r})")
    # -- runs and files --
    need(not (c.checkpoint_every and not c.checkpoint),
         f"checkpoint_every={c.checkpoint_every} needs --checkpoint")
    need(c.hang_timeout == 0 or c.hang_timeout >= MIN_HANG_TIMEOUT,
         f"hang_timeout={c.hang_timeout:g}: pass 0 (no watchdog) or at least "
         f"{MIN_HANG_TIMEOUT:g} s: healthy steps wait that long in communication calls, and "
         f"the run would be aborted as hung")
    need(c.device != "gpu" or importlib.util.find_spec("cupy") is not None,
         "device='gpu' needs CuPy, which is not installed here (pip install 'hpcnn[gpu]')")
    need(c.gpu_comm == "auto" or c.device != "cpu",
         f"gpu_comm={c.gpu_comm!r} with device='cpu': the arrays are in host memory; "
         f"--gpu_comm is for --device=gpu (or strict)")
    return errs


def _precision_errors(c: TrainConfig, need) -> None:
    """What 16-bit storage covers (hpcnn.nn.precision): the GPT and the MLP, serial or data
    parallel, in float32 compute."""
    if c.precision == "fp32":
        need(c.grad_reduce_dtype == "fp32", f"grad_reduce_dtype={c.grad_reduce_dtype!r} with "
                                            f"precision='fp32': the gradients are fp32 already")
        return
    p = f"precision={c.precision!r}"
    need(c.dtype == "float32", f"{p} with dtype={c.dtype!r}: 16-bit storage computes in "
                               f"float32 (--dtype=float32); float64 is for exactness checks")
    need(not (c.zero >= 2 and c.grad_reduce_dtype == "param"),
         f"{p} with zero={c.zero} and grad_reduce_dtype='param': ZeRO-{c.zero} reduce-scatters "
         f"the float32 gradients with the MPI library; use --grad_reduce_dtype=fp32")
    need(c.model in ("gpt", "mlp"), f"{p} with model={c.model!r}: 16-bit storage covers "
                                    f"model='gpt' and model='mlp' only")
    need(c.tp == 1 and c.pp == 1 and c.remat == "none" and not c.plan and not c.half_layers,
         f"{p} with tp={c.tp}, pp={c.pp}, remat={c.remat!r}, plan={c.plan!r}, half_layers="
         f"{str(c.half_layers).lower()}: 16-bit storage runs serial and data-parallel layouts "
         f"only (tp=1, pp=1, no remat, plan or half_layers)")
    need(not (c.precision == "bf16" and c.device == "gpu"),
         "precision='bf16' with device='gpu': CuPy has no bfloat16; use precision='fp16'")


def _graph_errors(c: TrainConfig, need) -> None:
    """The GCN splits the graph's rows over the dp ranks (hpcnn.graph.task): graph data, and
    nothing that would cut those rows otherwise or differently on different ranks."""
    graph = c.dataset in GRAPH_DATASETS
    need(graph == (c.model == "gcn") or not c.dataset,
         f"model={c.model!r} with dataset={c.dataset!r}: the graphs "
         f"({', '.join(GRAPH_DATASETS)}) are for model='gcn', which takes only those")
    reduce = c.spectral_features > 0 or c.coarsen != "none" or c.reduction != 1.0
    need(c.model == "gcn" or not reduce,
         f"spectral_features={c.spectral_features}, coarsen={c.coarsen!r}, reduction="
         f"{c.reduction}: graph preprocessing is for model='gcn' (got model={c.model!r})")
    need(c.coarsen != "none" or c.reduction == 1.0,
         f"reduction={c.reduction} needs a coarsening (--coarsen=heavy_edge|spectral|random)")
    if c.model != "gcn":
        need(c.partition == "contiguous", f"partition={c.partition!r} cuts a graph's rows: "
                                          f"it is for model='gcn' (got model={c.model!r})")
        return
    need(c.partition != "metis" or importlib.util.find_spec("pymetis") is not None,
         "partition='metis' needs the optional package pymetis, which is not installed here "
         "(pip install pymetis); use contiguous, random or spectral")
    need(c.tp == 1 and c.pp == 1, f"model='gcn' splits the graph over the dp ranks "
                                  f"(--dp = number of ranks): got tp={c.tp}, pp={c.pp}")
    need(c.grad_accum == 1 and c.balance == "equal" and c.combine == "weighted"
         and c.shard == "contiguous",
         f"model='gcn' runs full-batch steps on the --partition row sets: got grad_accum="
         f"{c.grad_accum}, balance={c.balance!r}, combine={c.combine!r}, shard={c.shard!r}")
    need(c.remat == "none" and not c.plan and c.device == "cpu",
         f"model='gcn' runs on the CPU without remat or --plan: got remat={c.remat!r}, "
         f"plan={c.plan!r}, device={c.device!r}")


def _tensor_parallel_errors(c: TrainConfig, need) -> None:
    """What the shards need: ``need(ok, message)`` for each tensor-parallel combination."""
    need(not (c.tp > 1 and c.model == "mlp" and not c.plan),
         f"tp={c.tp} with model='mlp': tensor parallelism is built for gpt and cnn (an MLP "
         f"is laid out over tp ranks by --plan)")
    gpt_auto = c.model == "gpt" and c.plan == "auto"
    need(not (c.machine and not gpt_auto), f"machine={c.machine!r} is read by --plan=auto for "
                                           f"model='gpt' (got model={c.model!r}, plan={c.plan!r})")
    if gpt_auto:          # the layout options are chosen (or constrained): hpcnn.plan.auto
        need(c.remat in ("none", "full") and c.virtual == 1,
             f"plan='auto' with model='gpt' prices remat none or full and one stage per rank: "
             f"got remat={c.remat!r}, virtual={c.virtual}")
    elif c.plan:
        need(c.model == "mlp" and c.dp == 1 and c.pp == 1,
             f"plan={c.plan!r}: per-layer layouts are built for model='mlp' over the --tp ranks "
             f"with dp=1 and pp=1 (batch cuts are part of the plan; model='gpt' takes "
             f"plan='auto'), got model={c.model!r}, dp={c.dp}, pp={c.pp}")
        need(c.plan != "auto" or c.tp & (c.tp - 1) == 0,
             f"plan='auto' with tp={c.tp}: the search bisects the devices, tp must be a power "
             f"of two (or give a plan file)")
        need(not (c.clip > 0 or c.checkpoint or c.resume or c.remat != "none"),
             f"plan={c.plan!r} with clip={c.clip}, checkpoint={c.checkpoint!r}, "
             f"resume={c.resume!r}, remat={c.remat!r}: laid-out layers run without clipping, "
             f"checkpoints and remat for now")
    if c.tp > 1 and c.model == "gpt":
        need(c.n_heads % c.tp == 0, f"n_heads={c.n_heads} with tp={c.tp}: attention heads "
                                    f"({c.n_heads}) is not divisible by tp ({c.tp})")
        need(c.pad_vocab % c.tp == 0, f"pad_vocab={c.pad_vocab} is not a multiple of tp={c.tp} "
                                      f"(the vocabulary is split over tp)")
        need(not c.sequence_parallel or c.block_size % c.tp == 0,
             f"sequence_parallel with block_size={c.block_size} not divisible by tp={c.tp}")
    if c.tp > 1 and c.model == "cnn":
        need(all(ch % c.tp == 0 for ch in c.channels),
             f"channels={','.join(map(str, c.channels))}: every entry must be a multiple of "
             f"tp={c.tp} (convolutions are split on output channels)")
    need(not (c.sequence_parallel and c.model != "gpt"),
         f"sequence_parallel with model={c.model!r}: the sequence is split in gpt only")
    need(not (c.half_layers and (c.model != "gpt" or c.tp > 1)),
         f"half_layers needs model='gpt' and tp=1 (got model={c.model!r}, tp={c.tp})")


def _pipeline_errors(c: TrainConfig, need) -> None:
    """What a pipeline needs (with pp = 1 its options are ignored): ``need(ok, message)``."""
    if c.pp > 1:
        need(c.grad_accum == 1, f"grad_accum={c.grad_accum} with pp={c.pp}: use --microbatches")
        need(c.batch_size >= c.dp * c.microbatches,
             f"batch_size={c.batch_size} < dp*microbatches={c.dp * c.microbatches}: every "
             f"replica needs at least one sample per micro-batch")
        err = _schedule_error(c)
        need(not err, err)
        n = len(c.layout.split("|")) if c.layout else c.pp * c.virtual
        need(n == c.pp * c.virtual, f"layout={c.layout!r} has {n} stages, pp*virtual = "
                                    f"{c.pp}*{c.virtual} = {c.pp * c.virtual}")


def _schedule_error(c: TrainConfig) -> str:
    """Why the pipeline schedule cannot be built for these sizes ('' if it can)."""
    if c.schedule not in SCHEDULES or min(c.pp, c.virtual, c.microbatches) < 1:
        return ""                      # reported by the choices and ranges
    try:
        SCHEDULES[c.schedule](c.pp * c.virtual, c.microbatches, c.pp)
    except ValueError as e:
        return (f"schedule={c.schedule!r} with pp={c.pp}, virtual={c.virtual}, "
                f"microbatches={c.microbatches}: {e}")
    return ""


def _field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def convert(key: str, raw: str, typ):
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


def split_option(arg: str, types: dict) -> tuple[str, str | None]:
    """One command-line argument as ``(key, raw value)``, dashes in the key read as underscores.

    ``--key=value`` gives its value; a bare ``--flag`` of a boolean option (``types[flag] is
    bool``) reads as ``--flag=true`` and ``--no-flag`` (or ``--no_flag``) as ``--flag=false``;
    any other bare ``--key`` gives ``(key, None)``: the caller refuses it, as an unknown option
    or one that needs a value (:func:`needs_value`). Raises ConfigError for an argument not
    starting with ``--``. The one reading of options for ``hpcnn train`` and the tools
    (:mod:`hpcnn.cli_tools`)."""
    if not arg.startswith("--"):
        raise ConfigError(f"{arg!r}: expected --key=value")
    key, eq, raw = arg[2:].partition("=")
    key = key.replace("-", "_")
    if eq:
        return key, raw
    if types.get(key) is bool:
        return key, "true"
    if key.startswith("no_") and types.get(key[3:]) is bool:
        return key[3:], "false"
    return key, None


def _zero_errors(c, need) -> None:
    """The combinations of --zero the engine cannot run."""
    if c.zero < 2:
        return
    need(c.allreduce in ("mpi", "auto", "hier"),
         f"zero={c.zero} with allreduce={c.allreduce!r}: ZeRO-{c.zero} reduce-scatters each "
         f"bucket with the MPI library (or in two levels, hier); pass --allreduce=mpi, auto "
         f"or hier")
    need(not c.sequence_parallel,
         f"zero={c.zero} with sequence_parallel=true: sequence parallelism sums the replicated "
         f"parameters' whole gradients over tp after the reduction, which ZeRO-{c.zero} no "
         f"longer holds")
    if c.zero == 3:
        need(c.pp == 1, f"zero=3 with pp={c.pp}: ZeRO-3 gathers the parameters around the "
                        f"blocks of one chain, not yet around pipeline stages; use --zero=2")
        need(c.remat != "optimal",
             "zero=3 with remat='optimal': each rank's recomputation sequence depends on its "
             "share of the batch, and every data-parallel rank must gather the same blocks in "
             "the same order; use --remat=sqrt or full")


def needs_value(key: str) -> str:
    """The refusal of a bare ``--key`` whose option is not boolean."""
    return f"--{key} needs a value (--{key}=VALUE)"


def flags_note(flag: str) -> str:
    """The line of ``--help`` that says how a boolean option (e.g. ``flag``) is written."""
    return (f"a true/false option alone is true (--{flag}); --no-{flag} or --{flag}=false "
            f"is false")


def parse_overrides(args, base: TrainConfig | None = None, cls=TrainConfig):
    """Apply ``["--key=value", ...]`` to ``base`` (default config); return the new config.

    A boolean option also stands alone: ``--progress`` is ``--progress=true`` and
    ``--no-progress`` is ``--progress=false`` (:func:`split_option`). Errors (all collected,
    then raised as one ConfigError): an argument not starting with ``--``, an unknown key
    (closest names suggested), a bare key that needs a value, a value of the wrong type.
    """
    cfg = dataclasses.replace(base) if base is not None else cls()
    types = _field_types(type(cfg))
    errs = []
    for arg in args:
        try:
            key, raw = split_option(arg, types)
        except ConfigError as e:
            errs.append(str(e))
            continue
        if key not in types:
            close = difflib.get_close_matches(key, types, n=3)
            hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
            errs.append(f"unknown option --{key}{hint}")
        elif raw is None:
            errs.append(needs_value(key))
        else:
            try:
                setattr(cfg, key, convert(key, raw, types[key]))
            except ConfigError as e:
                errs.append(str(e))
    if errs:
        raise ConfigError("; ".join(errs))
    return cfg


def shown(value) -> str:
    """A default as it is typed on the command line: 256,256 for a tuple, true/false."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def describe(cls=TrainConfig) -> str:
    """The options with their defaults and comments in aligned columns, grouped as in the
    class body (for ``hpcnn train --help``)."""
    import inspect
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    rows = []                       # (heading, None) or (--key=default, comment)
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        m = re.fullmatch(r"(\w+): [^=]+= .+?\s+# (.*)", s)
        if s.startswith("# --"):
            rows.append((s.strip("# -").strip() + ":", None))
        elif m and m.group(1) in defaults:
            rows.append((f"  --{m.group(1)}={shown(defaults[m.group(1)])}", m.group(2)))
    width = max(len(k) for k, c in rows if c is not None) + 2
    return "\n".join(k if c is None else f"{k:<{width}}{c}" for k, c in rows)


def padded_vocab(vocab: int, cfg: TrainConfig) -> int:
    """The GPT vocabulary rounded up to a multiple of ``pad_vocab`` (0: of tp), as Megatron-LM
    pads it so that vocab-parallel shards are equal; the extra ids never occur in the data."""
    m = cfg.pad_vocab or cfg.tp
    return -(-vocab // m) * m
