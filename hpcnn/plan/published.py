"""Published large-scale training runs, read from ``experiments/published_runs.toml``.

The planner is held against runs others have published (issue 40): their model, device count,
layout (tp x pp x dp, virtual stages, micro-batch), memory methods (ZeRO stage, sequence
parallelism, recomputation) and the throughput they reported, in the convention they reported
it. The file is a transcription: each run names its source and where in it the numbers are;
a field the source does not state is absent here too (None), and ``derived`` names the fields
computed from other published numbers. :func:`load` reads the file into :class:`PublishedRun`
records and refuses inconsistent data with a ValueError naming the run and the field.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import MISSING, dataclass, fields

from hpcnn.plan.machine import MACHINES as MACHINE_DIR

RUNS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "experiments", "published_runs.toml")

PRECISIONS = ("fp16", "bf16", "fp8", "mixed")      # "mixed": the 16-bit type is not stated
RECOMPUTE = ("none", "selective", "full")
CONVENTIONS = ("model", "hardware")                # FLOPs without / with the recomputed passes
GRAD_REDUCE = ("fp32", "param")                    # hpcnn train's --grad_reduce_dtype
THROUGHPUTS = ("tflops_per_device", "mfu", "hfu", "peak_fraction", "iteration_seconds",
               "tokens_per_s_per_device", "aggregate_pflops")


@dataclass(frozen=True)
class PublishedRun:
    """One published training run as its source states it (None: not stated there).

    Layout: ``devices = tp * pp * dp``; ``virtual`` model chunks per pipeline rank
    (interleaved 1F1B); ``micro_batch`` and ``global_batch`` in sequences. Throughput, as
    published: ``tflops_per_device`` in ``flops_convention`` ("model" or "hardware", the latter
    counting recomputation), ``mfu``/``hfu``/``peak_fraction`` as fractions of the device's
    peak, ``iteration_seconds``, ``tokens_per_s_per_device``, ``aggregate_pflops``.
    ``grad_reduce``: the data-parallel gradient reduction's type, "fp32" or "param" (the
    16-bit parameters' type: hpcnn train's ``--grad_reduce_dtype``). ``machine``: the machine
    file (``machines/<machine>.toml``) of the system the run used, where it is not its
    device's cluster (:data:`MACHINES`). ``derived``: the fields computed
    from other published numbers rather than read."""
    name: str
    source: str
    where: str
    model: str
    layers: int
    hidden: int
    heads: int
    sequence: int
    device: str
    devices: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    parameters: float | None = None
    vocabulary: int | None = None
    micro_batch: int | None = None
    virtual: int | None = None
    schedule: str | None = None
    zero: int | None = None
    precision: str | None = None
    dropout: float | None = None
    sequence_parallel: bool | None = None
    recompute: str | None = None
    dp_overlap: bool | None = None
    grad_reduce: str | None = None
    tflops_per_device: float | None = None
    flops_convention: str | None = None
    mfu: float | None = None
    hfu: float | None = None
    peak_fraction: float | None = None
    iteration_seconds: float | None = None
    tokens_per_s_per_device: float | None = None
    aggregate_pflops: float | None = None
    machine: str | None = None
    derived: tuple = ()

    @property
    def microbatches(self) -> int | None:
        """Micro-batches per pipeline and step: global_batch / (dp * micro_batch)."""
        if self.micro_batch is None:
            return None
        return self.global_batch // (self.dp * self.micro_batch)


_INTS = ("layers", "hidden", "heads", "sequence", "devices", "tp", "pp", "dp", "global_batch",
         "vocabulary", "micro_batch", "virtual")
_FRACTIONS = ("mfu", "hfu", "peak_fraction")


def _fail(name: str, field: str, value, expected: str):
    raise ValueError(f"published run {name!r}: {field} = {value!r}: {expected}")


def _check_types(name: str, row: dict) -> None:
    """Field names, integer and positive fields, the closed vocabularies."""
    known = {f.name for f in fields(PublishedRun)}
    for key in row:
        if key not in known:
            _fail(name, key, row[key], f"unknown field (known: {', '.join(sorted(known))})")
    for key in _INTS:
        v = row.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            _fail(name, key, v, "expected an integer >= 1")
    for key in THROUGHPUTS + ("parameters",):
        v = row.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            _fail(name, key, v, "expected a positive number")
    for key in _FRACTIONS:
        if row.get(key) is not None and row[key] > 1:
            _fail(name, key, row[key], "expected a fraction of the peak in (0, 1]")
    for key, allowed in (("precision", PRECISIONS), ("recompute", RECOMPUTE),
                         ("flops_convention", CONVENTIONS), ("grad_reduce", GRAD_REDUCE)):
        if row.get(key) is not None and row[key] not in allowed:
            _fail(name, key, row[key], f"expected one of {', '.join(allowed)}")
    v = row.get("dropout")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                          or not 0 <= v < 1):
        _fail(name, "dropout", v, "expected a probability in [0, 1)")
    if row.get("zero") is not None and row["zero"] not in (0, 1, 2, 3):
        _fail(name, "zero", row["zero"], "expected a ZeRO stage 0, 1, 2 or 3")
    for key in ("sequence_parallel", "dp_overlap"):
        if row.get(key) is not None and not isinstance(row[key], bool):
            _fail(name, key, row[key], "expected true or false")


def _check_layout(run: PublishedRun) -> None:
    """tp * pp * dp = devices; the batch splits into whole micro-batches; interleaving fits."""
    n = run.name
    if run.tp * run.pp * run.dp != run.devices:
        _fail(n, "dp", run.dp, f"tp * pp * dp = {run.tp} * {run.pp} * {run.dp} = "
              f"{run.tp * run.pp * run.dp}, expected devices = {run.devices}")
    if run.micro_batch is not None and run.global_batch % (run.dp * run.micro_batch):
        _fail(n, "global_batch", run.global_batch,
              f"expected a multiple of dp * micro_batch = {run.dp * run.micro_batch}")
    if run.virtual is not None and run.virtual > 1:
        if run.layers % (run.pp * run.virtual):
            _fail(n, "virtual", run.virtual, f"layers = {run.layers} do not split into "
                  f"pp * virtual = {run.pp * run.virtual} equal chunks")
        m = run.microbatches
        if m is not None and m % run.pp:
            _fail(n, "virtual", run.virtual, f"interleaving needs micro-batches ({m}) a "
                  f"multiple of pp = {run.pp}")
    if run.hidden % run.heads:
        _fail(n, "heads", run.heads, f"expected a divisor of hidden = {run.hidden}")
    if run.grad_reduce == "param" and (run.zero or 0) >= 2:
        _fail(n, "grad_reduce", run.grad_reduce, f"ZeRO-{run.zero} reduce-scatters the float32 "
              f"gradients: expected 'fp32'")


def _check_throughput(run: PublishedRun, sources: set) -> None:
    """A known source, a place in it, some published throughput and its convention."""
    n = run.name
    if not isinstance(run.source, str) or run.source not in sources:
        _fail(n, "source", run.source, f"expected one of the file's sources "
              f"({', '.join(sorted(sources))})")
    if not isinstance(run.where, str) or not run.where.strip():
        _fail(n, "where", run.where, "expected the table, figure or section it comes from")
    if all(getattr(run, k) is None for k in THROUGHPUTS):
        _fail(n, "tflops_per_device", None, f"expected at least one published throughput "
              f"({', '.join(THROUGHPUTS)})")
    if run.tflops_per_device is not None and run.flops_convention is None:
        _fail(n, "flops_convention", None, "expected 'model' or 'hardware' beside "
              "tflops_per_device")
    for key in run.derived:
        if key not in {f.name for f in fields(PublishedRun)}:
            _fail(n, "derived", run.derived, f"{key!r} is not a field")


def _run(row: dict, sources: set) -> PublishedRun:
    """One ``[[runs]]`` table, checked."""
    name = row.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"published run without a name: {row!r}")
    _check_types(name, row)
    required = [f.name for f in fields(PublishedRun) if f.default is MISSING]
    missing = [k for k in required if k not in row]
    if missing:
        _fail(name, missing[0], None, "required, missing")
    for key in ("source", "where", "model", "device"):
        if not isinstance(row[key], str) or not row[key]:
            _fail(name, key, row[key], "expected a non-empty string")
    machine = row.get("machine")
    if machine is not None and (not isinstance(machine, str) or not os.path.isfile(
            os.path.join(MACHINE_DIR, f"{machine}.toml"))):
        _fail(name, "machine", machine, f"expected the name of a file of {MACHINE_DIR}")
    run = PublishedRun(**{**row, "derived": tuple(row.get("derived", ()))})
    _check_layout(run)
    _check_throughput(run, sources)
    return run


def loads(text: str) -> list:
    """The runs of a published-runs TOML text, checked (see :func:`load`)."""
    data = tomllib.loads(text)
    sources = {s.get("id") for s in data.get("sources", [])}
    for s in data.get("sources", []):
        if not s.get("id") or not s.get("title"):
            raise ValueError(f"published source {s!r}: expected an id and a title")
    runs = [_run(row, sources) for row in data.get("runs", [])]
    names = [r.name for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"published run {dup[0]!r}: name = {dup[0]!r}: used twice")
    return runs


def load(path: str = RUNS) -> list:
    """The published runs of ``path`` (``experiments/published_runs.toml`` by default) as
    :class:`PublishedRun` records, in file order. ValueError, naming the run and the field,
    on a layout whose tp * pp * dp is not its device count, a global batch that is not whole
    micro-batches on every replica, an interleaving the layers or micro-batches cannot take,
    an unknown source, no published throughput, or a value out of its range."""
    with open(path, "rb") as f:
        return loads(f.read().decode())


# The machine file of each device the runs name, and the dtype the planner prices each
# published precision at (FP8 at bfloat16, hpcnn's narrowest; "mixed": 16 bits, type unstated).
MACHINES = {"A100": "dgx-a100-cluster", "H100": "dgx-h100-cluster"}
PRECISION = {"bf16": "bfloat16", "fp16": "float16", "mixed": "float16", "fp8": "bfloat16"}


def machine_name(run: PublishedRun) -> str:
    """The run's own machine file where it names one, else its device's (:data:`MACHINES`);
    ValueError if none."""
    if run.machine is not None:
        return run.machine
    for key, name in MACHINES.items():
        if key in run.device:
            return name
    raise ValueError(f"{run.name}: no machine file for device {run.device!r}")


def model_of(run: PublishedRun):
    """The run's model as the planner prices it (:class:`hpcnn.plan.hybrid.Transformer`): its
    shape, vocabulary (51,200 where unstated), global batch, precision, dropout and gradient
    reduction's type (float32 where unstated, hpcnn's default)."""
    from hpcnn.plan.hybrid import Transformer
    return Transformer(run.layers, run.hidden, run.heads, run.sequence, run.vocabulary or 51200,
                       run.global_batch, PRECISION.get(run.precision or "mixed", "float16"),
                       run.dropout or 0.0, run.grad_reduce or "fp32")
