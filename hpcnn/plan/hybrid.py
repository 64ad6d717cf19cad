"""The hybrid layout of a transformer chain: dp x tp x pp x schedule x micro-batches x remat.

:func:`plan` (:func:`layouts`, :func:`price`) prices every :class:`Layout` of a GPT
(:class:`Transformer`) over ``devices`` devices of a machine (:mod:`.machine`) in closed form from
the blocks' own ``spec()`` (a :class:`~hpcnn.parallel.tensor.attention.ParallelTransformerBlock`
built without storage) and the machine's rates, ranks ordered as
:class:`hpcnn.parallel.collectives.grid.ProcessGrid` orders them (tp fastest, then dp, then pp). A step:

- **compute** per stage and micro-batch: the blocks' FLOPs at the device's rate and
  "transformer" efficiency (where the machine file lists published GEMM rates for the dtype,
  their GEMMs and the head's on a roofline instead, :mod:`hpcnn.plan.gemm`), their fixed
  (``overhead``) and element-wise seconds, slowed for small calls (``tokens``), split between
  the passes by the device's ``forward`` share, the LM head as a "linear" block on the last
  stage, and the device's ``"stage"`` cost per stage pass;
  ``remat="full"`` runs each block's forward again in the backward but the last segment's
  (:func:`recomputed_forward`);
- **tensor parallelism** (Megatron): two ring allreduces of the activation per block each way
  (:func:`ring_allreduce_s`; under sequence parallelism a reduce-scatter and an all-gather, the
  same ring); **data parallelism**: the ring allreduce of the gradients after the step, or where
  the machine file says ``dp_overlap`` what the backward does not hide (:func:`dp_seconds`);
  **pipeline**: the schedule's makespan in stage passes (chunk passes when interleaved,
  :mod:`hpcnn.schedule.pipeline`) plus the activation messages the step waits on: one per
  boundary each way in the fill and drain, and in 1F1B's steady state 2(pp - 1) / pp a
  micro-batch (:func:`_messages`);
- **where ranks share cores**: the level's handoffs (per allreduce, pp message and stage pass)
  and its ``bubble_weight`` on a pipeline's fill and drain;
- **held activations**: the device's ``elementwise["held"]`` seconds per byte a stage holds beyond
  one micro-batch's (:func:`held_microbatches`, :func:`held_seconds`);
- **optimizer**: the device's measured ``update`` seconds per parameter, else a stream through
  memory (:func:`update_seconds`, :data:`UPDATE_PASSES`);
- **memory per rank**: parameters, gradients, optimizer state and scratch of its share, plus its
  fullest stage's held caches, as the pipeline executor counts them
  (:meth:`hpcnn.engine.stage.Stage.cache_bytes`).

Stage cuts (the thesis is silent): uniform layouts price every stage as the last; :func:`stage_cut`
chooses explicit ``stages`` (the least slowest stage that fits the memory,
:func:`hpcnn.schedule.stages.by_cost_bounded`), offered up to :data:`STAGE_CUT_PASSES`. Our
choices: Megatron's collectives, no overlap of communication with compute, the slowest stage
setting the pace (measurements behind the terms: docs/results/planner-model.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import NamedTuple

from hpcnn.plan import gemm, traffic
from hpcnn.plan.machine import cached_hash, unhashed_state
from hpcnn.schedule import pipeline
from hpcnn.schedule import stages as partition

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
SCHEDULES = ("1f1b", "gpipe", "zb_h1", "interleaved")
# The schedules of one stage per rank: what `hpcnn train --plan=auto` chooses among (it runs one
# stage per rank) and what the validations on this machine measured.
ONE_STAGE_PER_RANK = ("1f1b", "gpipe", "zb_h1")
REMAT = ("none", "full")
# What price() also prices, for the published runs (experiments/plan_published.py): "selective"
# (Korthikanti et al., MLSys 2023: the attention core recomputed) is not offered by layouts()
# unless asked for, as `hpcnn train` has no such --remat.
PRICED_REMAT = REMAT + ("selective",)
# Passes over parameter-sized arrays per optimizer step (hpcnn.nn.optim): AdamW's 10 and its
# decoupled decay; SGD's momentum (2), its update and the L2 decay (zero_grad is lazy: no pass).
UPDATE_PASSES = {"adamw": 11, "sgd": 4}
# Words held per parameter between steps: the parameter, its gradient and the optimizer's slots
# (AdamW's two moments, SGD's momentum).
STATE_WORDS = {"adamw": 4, "sgd": 3}


def state_bytes(optimizer: str, layout=None, word: int = 4, slots: int | None = None) -> float:
    """Bytes a rank holds per parameter of ``word`` bytes: the parameter, its gradient and the
    optimizer's ``slots`` (default :data:`STATE_WORDS` less two: AdamW's m and v, SGD's
    momentum). A 16-bit parameter (word 2: hpcnn's mixed precision, :mod:`hpcnn.nn.precision`)
    has a float32 gradient, float32 slots and a float32 master copy: 2 + 4 + 4 + 8 = 18 bytes
    under AdamW. A ``layout`` with ``zero=1`` holds 1/dp of the slots and master copy, with
    ``zero=2`` of the gradient too (the buckets' storage while in use aside), with ``zero=3`` of
    the parameter too (the gathered blocks aside: :func:`_stage_memory`)."""
    slots = STATE_WORDS[optimizer] - 2 if slots is None else slots
    zero, dp = (layout.zero, layout.dp) if layout is not None else (0, 1)
    wide = 4 if word == 2 else word
    rest = wide * (slots + (1 if word == 2 else 0))
    return (word / (dp if zero >= 3 else 1) + wide / (dp if zero >= 2 else 1)
            + rest / (dp if zero >= 1 else 1))


def state_words(optimizer: str, layout=None) -> float:
    """Words a rank holds per parameter (:func:`state_bytes` of one-unit words)."""
    return state_bytes(optimizer, layout, word=1)


def reduced_share(layout) -> float:
    """The share of a ring allreduce the gradients' reduction costs: all of it, or at ZeRO-2
    and 3 its reduce-scatter half (each rank receives its part only)."""
    return 0.5 if layout.zero >= 2 and layout.dp > 1 else 1.0


def sharded_update_seconds(local_params: float, layout, machine, word: int,
                           optimizer: str) -> float:
    """The update of a rank's ``local_params``: the whole at zero 0; at zero 1 and 2 its 1/dp
    part, then the parts gathered over dp (our choice: a ring allgather, half the ring
    allreduce's 2(dp-1) steps, at the level spanning tp x dp); at zero 3 its part, and the
    parameters gathered twice a micro-batch instead (before the forward and the backward of
    each block, a recomputation finding its block gathered: :mod:`hpcnn.parallel.data.zero3`),
    priced as not hidden behind the compute."""
    if not layout.zero or layout.dp == 1:
        return update_seconds(local_params, word, machine.device, optimizer)
    level = machine.level_for_group(layout.tp * layout.dp)
    gathers = 2 * layout.microbatches if layout.zero == 3 else 1
    return (update_seconds(local_params / layout.dp, word, machine.device, optimizer)
            + gathers * ring_allreduce_s(local_params * word, layout.dp, level) / 2)


def update_seconds(n_params: float, word: int, device, optimizer: str = "adamw") -> float:
    """One optimizer step over ``n_params`` parameters of ``word`` bytes. From the device's
    measured figure where it has one for ``optimizer`` (:meth:`~hpcnn.plan.machine.Device.
    update_seconds`, float32) times word / 4: the step is memory-bound, so its time goes with the
    bytes it moves. Otherwise UPDATE_PASSES passes of 3 words each (two read, one written) at
    the device's memory bandwidth, which prices small models (their arrays in cache) too slow
    (docs/results/planner-model.md)."""
    measured = device.update_seconds(n_params, optimizer)
    if measured is not None:
        return measured * word / 4
    return device.stream_seconds(UPDATE_PASSES[optimizer] * 3 * word * n_params)


@dataclass(frozen=True)
class Transformer:
    """A GPT's shape: ``n_layers`` blocks of width ``dim`` with ``n_heads`` heads, context
    ``seq``, vocabulary ``vocab``, global ``batch`` sequences per step, in ``dtype``, its
    blocks' dropout probability ``dropout`` (their masks cached and moved), its gradients
    reduced over dp in ``grad_reduce`` (hpcnn train's ``--grad_reduce_dtype``: "fp32", or
    "param", the 16-bit parameters' type, half the bytes; not at ZeRO-2 and 3)."""

    n_layers: int
    dim: int
    n_heads: int
    seq: int = 1024
    vocab: int = 50304
    batch: int = 512
    dtype: str = "bfloat16"
    dropout: float = 0.0    # the blocks' dropout probability (hpcnn train's --dropout)
    grad_reduce: str = "fp32"   # hpcnn train's --grad_reduce_dtype: fp32, or param (16 bits)

    def __post_init__(self):
        bad = {k: v for k, v in vars(self).items() if k not in (
            "dtype", "dropout", "grad_reduce") and not (isinstance(v, int) and v >= 1)}
        if (bad or self.dim % self.n_heads or self.dtype not in DTYPE_BYTES
                or not 0.0 <= self.dropout < 1.0 or self.grad_reduce not in ("fp32", "param")
                or (self.grad_reduce == "param" and DTYPE_BYTES[self.dtype] != 2)):
            raise ValueError(f"transformer shape: {dict(vars(self))}: every size an integer "
                             f">= 1, n_heads dividing dim, dtype one of {list(DTYPE_BYTES)}, "
                             f"0 <= dropout < 1, grad_reduce fp32 or param (param with a "
                             f"16-bit dtype)")

    __hash__ = cached_hash
    __getstate__ = unhashed_state

    @cached_property
    def word(self) -> int:
        """Bytes of one number in ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @cached_property
    def reduce_word(self) -> int:
        """Bytes of one gradient in the data-parallel reduction: float32 under 16-bit
        parameters (hpcnn's float32 gradients), or the parameters' own word where
        ``grad_reduce`` is "param"."""
        return self.word if self.grad_reduce == "param" else max(self.word, 4)

    def params(self) -> int:
        """Parameters of the whole model (blocks, embeddings, head)."""
        return self.n_layers * _block(self.dim, self.n_heads, self.seq, 1, self.word)[3] // \
            self.word + (2 * self.vocab + self.seq) * self.dim


class _ShapeComm(NamedTuple):
    """All a tensor-parallel block built without storage reads of its communicator."""
    size: int
    rank: int = 0
    name: str = "tp"


@lru_cache(maxsize=4096)
def _block(dim: int, heads: int, seq: int, rows: int, word: int, tp: int = 1,
           sp: bool = False, dropout: float = 0.0) -> tuple:
    """(FLOPs forward, FLOPs backward, cache bytes, parameter bytes, input bytes) of one
    transformer block on ``rows`` sequences as one of ``tp`` ranks runs it (``sp``: with
    sequence parallelism, its input a seq/tp slice): one sequence's figures
    (:func:`_block_one`) times ``rows`` (every figure but the parameters is a sum over the
    sequences; tests/test_plan_hybrid.py checks it against the spec on many rows)."""
    f, b, cache, pbytes, xbytes = _block_one(dim, heads, seq, word, tp, 1, sp, dropout)
    return f * rows, b * rows, cache * rows, pbytes, xbytes * rows


def _layout_block(model: Transformer, layout, rows: int) -> tuple:
    """:func:`_block` of ``model`` on ``rows`` sequences under ``layout`` (its tp and
    sequence parallelism)."""
    return _block(model.dim, model.n_heads, model.seq, rows, model.word, layout.tp,
                  layout.sequence_parallel, model.dropout)


def _spec(dim: int, heads: int, seq: int, word: int, tp: int, rows: int, sp: bool,
          dropout: float = 0.0):
    """The block's ``spec()`` (built without storage: the serial block, or the Megatron block
    over a tp group, with ``sp`` its sequence-parallel form) at float32 or float64, and the
    factor from its bytes to ``word``-byte ones."""
    from hpcnn.nn.transformer import TransformerBlock
    from hpcnn.parallel.tensor.attention import ParallelTransformerBlock
    dtype, scale = _spec_dtype(word)
    blk = (ParallelTransformerBlock(_ShapeComm(tp), dim, heads, dtype=dtype, keep=(),
                                    sequence_parallel=sp, dropout=dropout) if tp > 1
           else TransformerBlock(dim, heads, dtype=dtype, keep=(), dropout=dropout))
    return blk.spec((rows, seq // tp if sp else seq, dim)), scale


def _spec_dtype(word: int) -> tuple:
    """(the dtype a spec is built in for ``word``-byte words, the factor from its bytes to
    ``word``-byte ones): 16-bit words from float32 specs, halved."""
    return {2: "float32", 4: "float32", 8: "float64"}[word], word / (4 if word <= 4 else 8)


@lru_cache(maxsize=4096)
def _block_one(dim: int, heads: int, seq: int, word: int, tp: int = 1, rows: int = 1,
               sp: bool = False, dropout: float = 0.0) -> tuple:
    """(FLOPs forward, FLOPs backward, cache bytes, parameter bytes, input bytes) of one
    transformer block on ``rows`` sequences as one of ``tp`` ranks runs it, from its ``spec()``
    (:func:`_spec`)."""
    s, scale = _spec(dim, heads, seq, word, tp, rows, sp, dropout)
    return (s.flops_fwd, s.flops_bwd, int(s.bytes_cache * scale), int(s.bytes_params * scale),
            int(s.bytes_x * scale))


@lru_cache(maxsize=4096)
def _moved(dim: int, heads: int, seq: int, word: int, tp: int = 1, sp: bool = False,
           dropout: float = 0.0) -> tuple:
    """(forward, backward, attention core's forward) bytes one block's memory-bound operations
    move per sequence on one of ``tp`` ranks (:func:`hpcnn.plan.traffic.moved` of its spec)."""
    s, scale = _spec(dim, heads, seq, word, tp, 1, sp, dropout)
    return tuple(x * scale for x in traffic.moved(s))


@lru_cache(maxsize=1024)
def _tail_moved(dim: int, seq: int, rows: int, vocab: int, word: int, tp: int = 1) -> tuple:
    """(forward, backward) bytes the last stage's tail moves per micro-batch on one of ``tp``
    ranks: the final LayerNorm and the loss over the vocab / tp logits
    (:func:`hpcnn.plan.traffic.tail`; the LM head's GEMM is on its roofline)."""
    norm, _, loss, scale = _tail_specs(dim, seq, rows, vocab, word, tp)
    return tuple(x * scale for x in traffic.tail((norm, loss)))


@lru_cache(maxsize=4096)
def attention_core(dim: int, heads: int, seq: int, word: int, tp: int = 1,
                   sp: bool = False, dropout: float = 0.0) -> tuple:
    """(forward FLOPs, cache bytes) per sequence of one block's attention core on one of ``tp``
    ranks: the scores (Q K^T, the causal mask, softmax), the attention dropout and att^T V, the
    part selective recomputation runs again in the backward and does not hold (Korthikanti et
    al., MLSys 2023, Sec. 4.2). The cache is what those sub-blocks' specs cache beyond the
    scores' input (the q, k, v the recomputation reads, still held): hpcnn's blocks cache the
    softmax output (a s^2 / t words per sequence and block; with dropout, its mask too), where
    Korthikanti et al. count 5 a s^2 b / t bytes at 16 bits (the softmax's input as well)."""
    s, scale = _spec(dim, heads, seq, word, tp, 1, sp, dropout)
    walk, core = list(s.children), []
    while walk:
        c = walk.pop()
        walk += c.children
        if c.name.endswith((".attn.scores", ".attn.drop", ".attn.av")):
            core.append(c)
    return (sum(c.flops_fwd for c in core),
            int(sum(c.bytes_cache - (c.bytes_x if c.name.endswith(".scores") else 0)
                    for c in core) * scale))


@lru_cache(maxsize=4096)
def _tail(dim: int, seq: int, rows: int, vocab: int, word: int, tp: int = 1) -> int:
    """Cache bytes per micro-batch of the last stage's tail on one of ``tp`` ranks: the final
    LayerNorm, the LM head's vocab/tp columns and the loss's probabilities (their spec())."""
    *specs, scale = _tail_specs(dim, seq, rows, vocab, word, tp)
    return int(sum(s.bytes_cache for s in specs) * scale)


@lru_cache(maxsize=1024)
def _tail_specs(dim: int, seq: int, rows: int, vocab: int, word: int, tp: int = 1) -> tuple:
    """(the final LayerNorm's, the LM head's vocab / tp columns' and the loss's spec on a
    micro-batch of ``rows`` sequences, built as :func:`_spec` builds a block's, and the factor
    from their bytes to ``word``-byte ones)."""
    from hpcnn.nn.layers import LayerNorm, Linear
    from hpcnn.nn.loss import SoftmaxCrossEntropy
    dtype, scale = _spec_dtype(word)
    shape = (rows, seq, dim)
    head = Linear(dim, -(-vocab // tp), bias=False, dtype=dtype, keep=()).spec(shape)
    return (LayerNorm(dim, dtype=dtype, keep=()).spec(shape), head,
            SoftmaxCrossEntropy().spec(head.out_shape, dtype), scale)


def held_microbatches(schedule: str, pp: int, m_count: int, stage: int, virtual: int = 1) -> int:
    """Micro-batches stage ``stage`` holds at its peak (from its F to its last backward part,
    as :func:`hpcnn.schedule.pipeline.simulate` counts them): GPipe all m; 1F1B min(pp - s, m);
    ZB-H1 min(pp, m) on every stage (a micro-batch's B is early, its W late). Interleaved 1F1B
    with v = ``virtual`` chunks per rank (:func:`hpcnn.schedule.pipeline.interleaved_1f1b`):
    chunk passes, not micro-batches, rank s holding its warm-up's forwards and one more,
    min(v m, 2(pp - s - 1) + (v - 1) pp + 1), all v m when m = pp: on the first rank
    v pp + pp - 1 chunks, pp + (pp - 1) / v stages' worth (Korthikanti et al., MLSys 2023,
    Sec. 4.2.3; Narayanan et al., SC 2021, Sec. 2.2)."""
    if schedule == "gpipe":
        return m_count
    if schedule == "zb_h1":
        return min(pp, m_count)
    if schedule == "interleaved" and virtual > 1:
        total = virtual * m_count
        return total if m_count == pp else min(total, 2 * (pp - stage - 1)
                                               + (virtual - 1) * pp + 1)
    return min(pp - stage, m_count)


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    microbatches: int
    schedule: str = "1f1b"
    remat: str = "none"     # none | full | selective (priced only: PRICED_REMAT)
    stages: tuple = ()      # transformer blocks per stage; () the uniform cut, n_layers / pp each
    zero: int = 0           # ZeRO stage (hpcnn/parallel/data/sharded.py): 1 = slots over dp,
    #                         2 = and the gradients, 3 = and the parameters (zero3.py)
    virtual: int = 1        # model chunks per pipeline rank (schedule "interleaved")
    sequence_parallel: bool = False     # tp > 1: the LayerNorm/dropout regions split over tp

    def __post_init__(self):
        if self.stages and (len(self.stages) != self.pp or min(self.stages) < 1):
            raise ValueError(f"stages={self.stages}: expected pp={self.pp} stage sizes, each at "
                             f"least one transformer block")
        if self.virtual < 1 or (self.virtual > 1 and (self.schedule != "interleaved"
                                                      or self.stages)):
            raise ValueError(f"virtual={self.virtual} with schedule={self.schedule!r}, stages="
                             f"{self.stages}: chunks per rank are >= 1, more than one only "
                             f"with the interleaved schedule on uniform stages")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel with tp=1: the sequence is split over tp ranks")
        if self.remat not in PRICED_REMAT:
            raise ValueError(f"remat={self.remat!r}: expected one of {', '.join(PRICED_REMAT)}")

    __hash__ = cached_hash
    __getstate__ = unhashed_state

    def __str__(self) -> str:
        cut = f", stages {'|'.join(map(str, self.stages))}" if self.stages else ""
        chunks = f" x{self.virtual} chunks" if self.virtual > 1 else ""
        return (f"dp={self.dp} x tp={self.tp} x pp={self.pp}, {self.schedule}{chunks}, "
                f"{self.microbatches} micro-batches, remat={self.remat}{cut}"
                + (", sequence parallel" if self.sequence_parallel else "")
                + (f", zero {self.zero}" if self.zero else ""))


@dataclass
class Priced:
    """A layout's predicted memory per rank, ``memory_bytes`` (by kind: ``memory_parts``), and
    ``feasible`` (it fits the device memory); its predicted step: ``step_s``, its ``parts``
    (seconds) and ``formula`` (the step as a sum of its terms). The step is priced from
    ``terms`` (the model, the machine, the optimizer) when first read: a plan ranks by step
    only the layouts that fit (those that do not, by memory), often a fifth of them, and shows
    a few."""

    layout: Layout
    memory_bytes: float = 0.0
    feasible: bool = True
    memory_parts: dict = field(default_factory=dict)    # bytes by kind, the fullest stage's
    terms: tuple = field(default=(), repr=False)

    @cached_property
    def times(self) -> StageTimes:
        """The times the step adds up (:func:`_step_times`)."""
        model, machine, optimizer = self.terms
        return _step_times(model, self.layout, machine, optimizer)

    @cached_property
    def step_s(self) -> float:
        """Seconds of the predicted step: the schedule's span, the pipeline's messages, the
        data-parallel reduction, the optimizer's update and the held activations' cost."""
        st = self.times
        return st.span + st.pp_s + st.dp_s + st.opt_s + st.held_s

    @cached_property
    def parts(self) -> dict:
        """The step's seconds by part (:func:`_step_parts`)."""
        model, machine, _ = self.terms
        return _step_parts(model, self.layout, machine, self.times)

    @cached_property
    def formula(self) -> str:
        """The step as a sum of its terms (:func:`_formula`)."""
        return _formula(self.layout, self.times, self.terms[2], self.step_s)


def ring_allreduce_s(nbytes: float, n: int, level, after: float = 0.0,
                     crossing: float | None = None) -> float:
    """An allreduce of ``nbytes`` over ``n`` ranks at ``level`` after ``after`` seconds of
    compute: where the level has ``after_compute`` allreduce curves (calibrated where ranks
    share cores), the curve's seconds (:meth:`hpcnn.plan.machine.Level.collective_seconds`,
    the wait for the group's last rank included), as the MLP's cost (:mod:`.cost`) prices its
    allreduces; else a ring, 2(n-1) steps of n-th parts
    (:meth:`hpcnn.plan.machine.Level.allreduce_seconds`: at the level's calibrated reduce rate
    where it has one, at its links' share for a fraction ``crossing`` of a node's devices
    sending across at once) and its handoff. What the curves changed on a validation:
    docs/results/planner-model.md."""
    if n == 1 or nbytes == 0:
        return 0.0
    measured = level.collective_seconds("allreduce", n, nbytes, after)
    if measured is not None:
        return measured
    return level.allreduce_seconds(nbytes, n, after, crossing)


def dp_allreduce_s(nbytes: float, layout, machine, after: float = 0.0) -> float:
    """The data-parallel gradient allreduce of ``nbytes`` as ``auto`` would run it: the
    cheaper of :func:`dp_allreduce_forms`. At ZeRO-2 and 3 the gradients are reduce-scattered
    instead, and ``auto`` leaves a parts collective to the MPI library (only ``hier`` takes
    the two-level form: ``Comm._levels``): the flat ring, the form the parameters' gathers are
    priced in too (:func:`sharded_update_seconds`)."""
    forms = _dp_forms_of(nbytes, layout, machine, after)
    if layout.zero >= 2:
        return dict(forms)["flat"]
    return min(s for _, s in forms)


def dp_allreduce_forms(nbytes: float, layout, machine, after: float = 0.0) -> dict:
    """The data-parallel gradient allreduce of ``nbytes`` over ``layout.dp`` ranks (strided by
    tp: tp x dp consecutive devices, tp fastest), in each form that applies: ``"flat"``, the
    ring at the level spanning tp x dp; ``"hier"``, where an inner level holds g of the dp
    ranks (1 < g < dp, g dividing dp), the two-level form of
    :mod:`hpcnn.parallel.collectives.hier`: a reduce-scatter and an all-gather among the g
    (one ring allreduce's steps at that level) and a ring allreduce of the g-th part across
    the dp / g groups at the outer level. Crossing the outer level, a flat ring laid over
    consecutive ranks sends one message per ring from each node at once (min(tp, q) of a
    node's q devices), the two-level form one from every device (its rails)."""
    return dict(_dp_forms_of(nbytes, layout, machine, after))


def _dp_forms_of(nbytes: float, layout, machine, after: float) -> tuple:
    """:func:`_dp_forms` of ``layout``'s dp and tp, ``after`` read only where the machine's
    collectives depend on the compute before them."""
    return _dp_forms(nbytes, layout.dp, layout.tp, machine,
                     after if machine.compute_dependent else 0.0)


@lru_cache(maxsize=4096)
def _dp_forms(nbytes: float, dp: int, tp: int, machine, after: float) -> tuple:
    """:func:`dp_allreduce_forms` as (form, seconds) pairs, once per plan for the layouts that
    share them."""
    outer = machine.level_for_group(tp * dp)
    spans = machine._spans()
    at = machine.levels.index(outer)
    q = spans[at - 1] if at else 1                 # devices under one child of the outer level
    forms = {"flat": ring_allreduce_s(nbytes, dp, outer, after, crossing=min(tp, q) / q)}
    for lv, span in zip(machine.levels, spans):
        g = span // tp if span % tp == 0 else 0
        if 1 < g < dp and dp % g == 0 and lv is not outer:
            forms["hier"] = (ring_allreduce_s(nbytes, g, lv, after)
                             + ring_allreduce_s(nbytes / g, dp // g, outer, after, crossing=1.0))
            break
    return tuple(forms.items())


class StageTimes(NamedTuple):
    """What one layout's step is made of (seconds): a stage pass's forward ``t_f``, whole backward
    ``t_b`` (input and weight gradients) and the part of it ``t_w`` zero bubble splits off (else
    0), each including ``tp_s``, the pass's tensor-parallel allreduces (the backward
    :func:`regather_share` times them); ``span`` the schedule's
    makespan in such passes (messages free), ``msg`` one activation message between stages,
    ``pp_s`` the seconds the step waits on them (:func:`_messages`), ``dp_s`` the
    data-parallel allreduce,
    ``opt_s`` the optimizer's update, ``held_s`` the fresh memory of the activations held beyond
    one micro-batch's (:func:`held_seconds`)."""
    t_f: float
    t_b: float
    t_w: float
    tp_s: float
    span: float
    msg: float
    pp_s: float
    dp_s: float
    opt_s: float
    held_s: float = 0.0


def stage_times(model: Transformer, layout: Layout, machine, optimizer: str = "adamw") -> StageTimes:
    """The times :func:`price` adds up (see the module docstring); :mod:`.timeline` lays them
    out as a predicted run's events. Uniform layouts only: a layout with explicit ``stages`` has
    one set of times per stage (:func:`price`)."""
    if layout.stages:
        raise ValueError(f"{layout}: stage_times lays out uniform stages; explicit stages are "
                         f"priced per stage by price()")
    return _priced_parts(model, layout, machine, optimizer)


def _pass_times(model: Transformer, layout: Layout, machine, blocks: float, head: bool):
    """(t_f, t_b, t_w, tp_s) of one micro-batch's pass through a stage of ``blocks`` transformer
    blocks, with the LM head when ``head`` (module docstring: compute, tp allreduces, remat,
    zero bubble's halves, the pass's fixed cost; where pp > 1 the wait on the neighbour's
    message; the gradients' accumulation, :func:`_with_accumulation`). Affine in ``blocks``: a
    block's figures times their count, plus the pass's own. The pass itself is priced once for
    every layout that shares its micro-batch's rows, tp, sequence parallelism, recomputation
    and zero-bubble split (:func:`_pass_core`)."""
    key, rows, lvl = _pass_args(model, layout, machine)
    return _with_accumulation(model, layout, machine,
                              _pass_with(model, key, machine, rows, blocks, head, lvl),
                              _accumulated_params(model, layout, blocks, head))


def _with_accumulation(model: Transformer, layout: Layout, machine, times: tuple,
                       params: float) -> tuple:
    """A pass's (t_f, t_b, t_w, tp_s) with the accumulation of its ``params`` parameters'
    gradients (:func:`accumulate_seconds`) in its backward, in the weight half under zero
    bubble."""
    acc = accumulate_seconds(model, layout, machine, params)
    t_f, t_b, t_w, tp_s = times
    return t_f, t_b + acc, t_w + (acc if layout.schedule == "zb_h1" else 0.0), tp_s


def _pass_args(model: Transformer, layout: Layout, machine) -> tuple:
    """(:func:`_pass_key`, sequences per micro-batch, the level whose message each pass waits
    on, None without a pipeline) of ``layout``'s stage passes: where ranks share cores, a pass
    waits for its neighbour to get a core after its pass."""
    rows = model.batch // (layout.dp * layout.microbatches)
    return _pass_key(layout), rows, _neighbours(layout, machine) if layout.pp > 1 else None


@lru_cache(maxsize=1 << 14)
def _pass_with(model: Transformer, key: Layout, machine, rows: int, blocks: float, head: bool,
               lvl) -> tuple:
    """:func:`_pass_core` and the wait on the neighbour's message at level ``lvl`` (None
    without a pipeline)."""
    t_f, t_b, t_w, tp_s, _ = _pass_core(model, key, machine, rows, blocks, head)
    if lvl is not None:
        t_f, t_b = t_f + lvl.handoff_after(t_f), t_b + lvl.handoff_after(t_b - t_w)
    return t_f, t_b, t_w, tp_s


def regather_share(layout: Layout) -> float:
    """The backward's tensor-parallel seconds over the forward's: under sequence parallelism
    the backward also gathers the two column-parallel GEMMs' inputs again (their slices are
    cached: :class:`hpcnn.parallel.tensor.linear.ColumnParallelLinear`), two all-gathers a
    block, half the forward's two allreduces; else 1."""
    return 1.5 if layout.sequence_parallel and layout.tp > 1 else 1.0


def _pass_key(layout: Layout) -> Layout:
    """What of ``layout`` a stage pass's price reads (:func:`_pass_core`): tp, sequence
    parallelism, recomputation, and whether zero bubble splits the backward; one object for
    each (the pass caches then find their keys by identity)."""
    return _pass_key_of(layout.tp, layout.schedule == "zb_h1", layout.remat,
                        layout.sequence_parallel)


@lru_cache(maxsize=256)
def _pass_key_of(tp: int, zero_bubble: bool, remat: str, sequence_parallel: bool) -> Layout:
    """:func:`_pass_key`'s layout."""
    return Layout(1, tp, 1, 1, "zb_h1" if zero_bubble else "1f1b", remat,
                  sequence_parallel=sequence_parallel)


def _pass_core(model: Transformer, layout: Layout, machine, rows: int, blocks: float,
               head: bool) -> tuple:
    """:func:`_pass_times` of ``rows`` sequences a micro-batch, before the neighbours' wait:
    affine in ``blocks`` (a block's figures times their count, plus the pass's own and the
    head's), so from :func:`_pass_terms` of its rows."""
    per_block, bare, with_head = _pass_terms(model, layout, machine, rows)
    return tuple(a + blocks * b for a, b in zip(with_head if head else bare, per_block))


@lru_cache(maxsize=4096)
def _pass_terms(model: Transformer, layout: Layout, machine, rows: int) -> tuple:
    """(a block's (t_f, t_b, t_w, tp_s), a pass's own without blocks, with the head) of
    ``rows`` sequences a micro-batch (:func:`_pass_priced`), once per plan for the stages of
    every size that share them."""
    bare = _pass_priced(model, layout, machine, rows, 0, False)
    one = _pass_priced(model, layout, machine, rows, 1, False)
    return (tuple(b - a for a, b in zip(bare, one)), bare,
            _pass_priced(model, layout, machine, rows, 0, True))


def _pass_priced(model: Transformer, layout: Layout, machine, rows: int, blocks: float,
                 head: bool) -> tuple:
    """:func:`_pass_core` priced term by term for ``blocks`` blocks, and the pass's seconds in
    memory-bound operations (its recomputation's included) as a fifth term."""
    tp = layout.tp
    f, b, _, _, _ = _layout_block(model, layout, rows)
    dev = machine.device
    dtype = model.dtype if model.dtype in dev.flops else max(dev.flops, key=dev.flops.get)
    act = rows * model.seq * model.dim * model.word                  # one activation
    # a block's fixed cost split between its passes by the device's measured forward share
    # (Device.pass_seconds), its FLOPs as spec() counts them, the FLOP seconds slowed for a
    # call on the micro-batch's rows x seq tokens (where the machine file lists published GEMM
    # rates for the dtype, the block's GEMMs on their roofline instead: hpcnn.plan.gemm), and
    # its memory-bound operations (_block_memory_s)
    shapes = gemm.block_shapes(model.dim, model.n_heads, model.seq, rows, tp)
    mem_f, mem_b, mem_core = _block_memory_s(model, layout, dev, rows)
    comp_f, comp_b = (dev.pass_seconds(blocks * rest, dtype, "transformer", blocks, 0.0, fwd,
                                       tokens=rows * model.seq)
                      + blocks * (gemm_s + (mem_f if fwd else mem_b))
                      for (rest, gemm_s), fwd in ((gemm.split(dev, dtype, shapes, flops, fwd), fwd)
                                                  for flops, fwd in ((f, True), (b, False))))
    # two allreduces per block each way, each after the compute since the previous one
    between = (comp_f + comp_b) / (4 * blocks) if blocks else 0.0
    tp_s = 2 * ring_allreduce_s(act, tp, machine.level_for_group(tp), after=between) * blocks
    # every pass of a micro-batch: the step engine's stage pass around its blocks (the device's
    # "stage" kind: the instruction, embedding, the tail's small calls, the loss)
    around_f, around_b = (dev.pass_seconds(0.0, dtype, "stage", 1, 0.0, fwd)
                          for fwd in (True, False))
    (head_f, head_mf), (head_b, head_mb) = (
        _head_seconds(model, dev, dtype, rows, tp, fwd) if head else (0.0, 0.0)
        for fwd in (True, False))
    t_f = comp_f + tp_s + around_f + head_f
    t_b = comp_b + tp_s * regather_share(layout) + around_b + head_b
    memory = blocks * (mem_f + mem_b) + head_mf + head_mb
    if layout.remat == "full":
        t_b += recomputed_forward(comp_f + tp_s, blocks, head)
        memory += recomputed_forward(blocks * mem_f, blocks, head)
    elif layout.remat == "selective":       # every block's attention core run again
        core_f = attention_core(model.dim, model.n_heads, model.seq, model.word, tp,
                                layout.sequence_parallel, model.dropout)[0]
        rest, gemm_s = gemm.split(dev, dtype, gemm.core_shapes(
            model.dim, model.n_heads, model.seq, rows, tp), rows * core_f, True)
        t_b += dev.pass_seconds(blocks * rest, dtype, "transformer", 0, 0.0, True,
                                tokens=rows * model.seq) + blocks * (gemm_s + mem_core)
        memory += blocks * mem_core
    t_w = 0.0
    if layout.schedule == "zb_h1":
        # zero bubble splits B into its input and weight halves, each the measured fraction of
        # the whole (Device.backward_halves; the head taken as a transformer block's): t_b
        # becomes the split backward, t_w its weight half
        b_in, b_w = dev.backward_halves("transformer")
        tp_b = tp_s * regather_share(layout)
        t_w = b_w * (t_b - tp_b)
        t_b = b_in * (t_b - tp_b) + tp_b + t_w
    return t_f, t_b, t_w, tp_s, memory


def _head_seconds(model: Transformer, dev, dtype: str, rows: int, tp: int,
                  forward: bool) -> tuple:
    """(seconds, of which in memory-bound operations) of the LM head's forward (``forward``)
    or backward on ``rows`` sequences on one of ``tp`` ranks, as a "linear" block: its FLOPs
    (2 rows seq dim vocab / tp forward, twice that backward) at the device's rate, or its GEMMs
    on their roofline where the machine file lists GEMM rates for ``dtype``
    (:func:`hpcnn.plan.gemm.split`), and its activation's element-wise seconds (the pass's
    share of them) or the loss tail's bytes moved (:func:`_tail_moved_s`)."""
    flops = 2.0 * rows * model.seq * model.dim * model.vocab / tp * (1 if forward else 2)
    act = rows * model.seq * model.dim * model.word                  # one activation
    rest, gemm_s = gemm.split(dev, dtype, gemm.head_shapes(model.dim, model.seq, rows,
                                                           model.vocab, tp), flops, forward)
    share = dev.forward.get("linear", 1 / 3)
    memory = ((share if forward else 1 - share) * dev.elementwise_seconds("linear", act, None)
              + _tail_moved_s(model, dev, rows, tp)[0 if forward else 1])
    return dev.pass_seconds(rest, dtype, "linear", 1, 0.0, forward) + gemm_s + memory, memory


def _block_memory_s(model: Transformer, layout: Layout, dev, rows: int) -> tuple:
    """(forward, backward, attention core's recomputed forward) seconds of one block's
    memory-bound operations on a micro-batch of ``rows`` sequences: by the bytes each moves
    where the machine file has ``elementwise["moved"]`` (:func:`_block_moved_s`), else its
    cache at the device's ``transformer`` element-wise figure, split between the passes by
    its forward share (the core's cache at the forward's)."""
    moved_s = _block_moved_s(model, layout, dev, rows)
    if moved_s is not None:
        return moved_s
    cache = _layout_block(model, layout, rows)[2]
    core_cache = rows * attention_core(model.dim, model.n_heads, model.seq, model.word,
                                       layout.tp, layout.sequence_parallel, model.dropout)[1]
    share = dev.forward.get("transformer", 1 / 3)
    whole, core = (dev.elementwise_seconds("transformer", n, rows * model.seq)
                   for n in (cache, core_cache))
    return share * whole, (1 - share) * whole, share * core


def _block_moved_s(model: Transformer, layout: Layout, dev, rows: int) -> tuple | None:
    """(forward, backward, attention core's forward) seconds of one block's memory-bound
    operations on a micro-batch of ``rows`` sequences, their bytes moved
    (:func:`hpcnn.plan.traffic.moved`) at the device's ``elementwise["moved"]`` seconds per
    byte; None where the machine file prices them per byte of cache instead."""
    per_byte = dev.elementwise.get("moved")
    if per_byte is None:
        return None
    return tuple(rows * b * per_byte for b in _moved(
        model.dim, model.n_heads, model.seq, model.word, layout.tp, layout.sequence_parallel,
        model.dropout))


def _tail_moved_s(model: Transformer, dev, rows: int, tp: int) -> tuple:
    """(forward, backward) seconds of the loss tail's memory-bound operations on ``rows``
    sequences (:func:`_tail_moved`), (0, 0) where the machine file has no ``moved`` figure."""
    per_byte = dev.elementwise.get("moved")
    if per_byte is None:
        return 0.0, 0.0
    return tuple(b * per_byte for b in _tail_moved(model.dim, model.seq, rows, model.vocab,
                                                   model.word, tp))


def memory_bound_seconds(model: Transformer, layout: Layout, machine) -> float:
    """The part of a step's ``compute`` (:func:`price`) in memory-bound operations: the
    micro-batches' passes through the busiest stage (the uniform stage, priced as the last, or
    the largest of explicit ``stages``, with the head), as those passes are priced
    (:func:`_pass_priced`'s fifth term: :func:`_block_memory_s`, the head's and the loss
    tail's, what the recomputation runs again) and their gradients' accumulation
    (:func:`accumulate_seconds`, of the fullest stage's parameters)."""
    rows = model.batch // (layout.dp * layout.microbatches)
    blocks = max(layout.stages) if layout.stages else model.n_layers / layout.pp
    acc = accumulate_seconds(model, layout, machine, _accumulated_params(model, layout, blocks,
                                                                         True))
    return layout.microbatches * (_pass_core(model, _pass_key(layout), machine, rows, blocks,
                                             True)[4] + acc)


def recomputed_forward(blocks_f: float, blocks: float, head: bool) -> float:
    """Seconds of forward a stage pass runs again under ``remat="full"``, as ``hpcnn train
    --remat=full`` runs it (:func:`hpcnn.schedule.sequences.segments` with a segment per chain
    block): every block's forward but the last segment's, which runs once with the loss. On a
    stage with the head (``head``) that segment is the LM head; a stage without it keeps
    only its blocks' inputs and its output between a micro-batch's forward and backward and
    recomputes its last block too: either way all ``blocks`` transformer blocks (their forward
    ``blocks_f``, tensor-parallel allreduces included) run again, as Megatron's full
    recomputation does (the embedding and the final LayerNorm, also recomputed, are left out
    as their forward is)."""
    return blocks_f if blocks > 0 else 0.0


def _neighbours(layout: Layout, machine):
    """The level that holds two pp neighbours (tp x dp devices apart)."""
    return _level_for(machine, min(machine.p, 2 * layout.tp * layout.dp))


@lru_cache(maxsize=1024)
def _level_for(machine, size: int):
    """``machine.level_for_group(size)``, once per plan."""
    return machine.level_for_group(size)


def _messages(model: Transformer, layout: Layout, machine, after: float = 0.0,
              slack: float = 0.0) -> tuple:
    """(one activation message between pp neighbours, sent after ``after`` seconds of a
    chunk's pass; the step's seconds waiting on them, None where the schedule has no count;
    one message's wire seconds). Under sequence parallelism a rank sends its seq/tp slice.
    The step waits on the fill and drain's 2(pp v - 1) messages (wire and handoff, where ranks
    share cores, :meth:`hpcnn.plan.machine.Level.handoff_after`; a pass's own wait on its
    neighbour is in the pass, :func:`_pass_with`) and on the schedule's others
    (:func:`hpcnn.schedule.pipeline.formula_messages`, on equal stages): 1F1B's steady state
    waits on two wires a round of its pp - 1 in pp micro-batches, less the ``slack`` of a
    last stage whose pass is that much longer than the others' (the LM head's, in a uniform
    price), which hides them: floor((M - 1)(pp - 1) / pp) max(0, 2 wire - slack), equal to
    the simulated growth (tests/test_plan_hybrid.py). Where the count does not hold
    (:func:`_counted`) the callers simulate the lists up to :data:`SIMULATED_PASSES`."""
    if layout.pp == 1:
        return 0, 0, 0
    rows = model.batch // (layout.dp * layout.microbatches)
    act = rows * model.seq * model.dim * model.word / (layout.tp if layout.sequence_parallel
                                                        else 1)
    lvl = _neighbours(layout, machine)
    msg, wire = lvl.message_seconds(act, after), lvl.wire_seconds(act)
    count = pipeline.formula_messages(layout.schedule, layout.pp, layout.microbatches,
                                      layout.virtual)
    if count is None:
        return msg, None, wire
    fill = _fill_messages(layout)
    if _plain_1f1b(layout):
        return msg, fill * msg + (count - fill) // 2 * max(0.0, 2 * wire - slack), wire
    return msg, count * wire + fill * (msg - wire), wire


def _plain_1f1b(layout: Layout) -> bool:
    """Whether ``layout`` runs 1F1B without interleaving (interleaved with one chunk is it)."""
    return layout.virtual == 1 and layout.schedule in ("1f1b", "interleaved")


def _counted(layout: Layout, wire: float, c_f: float, c_in: float, c_w: float) -> bool:
    """Whether the schedule's count of messages waited on (:func:`_messages`) holds for these
    chunk pass times (forward, input half, weight half): a ``wire`` up to the shortest pass
    (1F1B, GPipe) or half of it (interleaved, ZB-H1), ZB-H1's weight half no longer than its
    others (:func:`hpcnn.schedule.pipeline.formula_messages`)."""
    name = "1f1b" if _plain_1f1b(layout) else layout.schedule
    if name in ("1f1b", "gpipe"):
        return wire <= min(c_f, c_in + c_w)
    if name == "interleaved":
        return wire <= 0.5 * min(c_f, c_in)
    return name == "zb_h1" and c_w <= min(c_f, c_in) and wire <= 0.5 * min(c_f, c_in, c_w)


def _simulated_waits(layout: Layout, halves: tuple, msg: float, wire: float) -> float:
    """The seconds ``layout``'s step waits on its messages, its schedule simulated with these
    per-stage (or per-chunk) ``halves`` (forward, input half, weight half): the makespan's
    growth when every message takes its ``wire``, and the fill and drain's handoffs (the rest
    of ``msg``), as :func:`_messages` counts them."""
    args = (layout.schedule, layout.pp, layout.microbatches, *halves)
    return (_simulated_span(*args, wire, virtual=layout.virtual)
            - _simulated_span(*args, virtual=layout.virtual)
            + _fill_messages(layout) * (msg - wire))


def _fill_messages(layout: Layout) -> int:
    """The fill and drain's messages: every one of the pp x v chunks' boundaries crossed by
    the first micro-batch's forward and the last one's backward."""
    return 2 * (layout.pp * layout.virtual - 1)


def _weighted(layout: Layout, machine, span: float, busy: float) -> float:
    """The makespan ``span`` with its fill and drain (what it holds beyond a stage's ``busy``
    passes) weighted by the pp neighbours' level's ``bubble_weight`` (1 but where ranks share
    cores: :class:`hpcnn.plan.machine.Level`)."""
    if layout.pp == 1:
        return span
    w = _neighbours(layout, machine).bubble_weight
    return span if w == 1 else busy + w * (span - busy)


def _chunk_times(model: Transformer, layout: Layout, machine, per_stage: float) -> tuple:
    """(t_f, t_b, t_w, tp_s) of one pass through one of the v = ``layout.virtual`` chunks of a
    rank of ``per_stage`` blocks, the stage pass (every stage priced as the last, the LM head
    on it) for v = 1. Our choice for v > 1: a chunk of per_stage / v blocks without the head
    (its own fixed cost per pass, as the executor runs each chunk as a stage), plus 1/v of what
    the head adds to the rank's stage pass."""
    v = layout.virtual
    if v == 1:
        return _pass_times(model, layout, machine, per_stage, True)
    key, rows, lvl = _pass_args(model, layout, machine)
    chunk = _pass_with(model, key, machine, rows, per_stage / v, False, lvl)
    whole, bare = (_pass_with(model, key, machine, rows, per_stage, h, lvl) for h in (True, False))
    return _with_accumulation(model, layout, machine,
                              tuple(c + (w - b) / v for c, w, b in zip(chunk, whole, bare)),
                              _accumulated_params(model, layout, per_stage, True) / v)


def accumulate_seconds(model: Transformer, layout: Layout, machine, params: float) -> float:
    """Seconds a stage pass's backward spends adding its micro-batch's weight gradients of
    ``params`` parameters into the gradients held, averaged over the step's micro-batches, as
    hpcnn's engine runs it (:meth:`hpcnn.nn.core.Parameter.add_matmul`): the first
    micro-batch's GEMM writes the gradient itself, each later one's result is added to it
    (``grad += a @ b``: two gradients read, one written, in the gradients' type, float32 under
    16-bit parameters), so 3 words a parameter on (m - 1) / m of the passes (the product's own
    write is its GEMM's, on its roofline), at the device's ``moved`` seconds per byte. Only on
    the machine files that price memory-bound operations by the bytes they move (``moved``):
    on a calibrated file the measured backward of a block already holds it, the calibration's
    passes adding their gradients as every pass after a step's first does
    (:func:`hpcnn.plan.calibrate.blocks.blocks_pass`). Zero bubble runs it in the weight half.
    Our choice: it follows the pass and the pass's wait on its neighbour
    (:meth:`~hpcnn.plan.machine.Level.handoff_after`, of the pass without it)."""
    per_byte = machine.device.elementwise.get("moved")
    m_count = layout.microbatches
    if m_count <= 1 or per_byte is None:
        return 0.0
    return 3 * _wide(model) * params * (m_count - 1) / m_count * per_byte


def dp_seconds(model: Transformer, layout: Layout, machine, params: float,
               window: float) -> float:
    """The data-parallel reduction of ``params`` gradients left on the step (float32 gradients
    under 16-bit parameters, as hpcnn's engine holds and reduces them: ``Parameter.grad_dtype``,
    ``--grad_reduce_dtype=fp32``; in 16 bits under ``param``, ``Transformer.reduce_word``,
    as the engine runs it: the flat ring, blocking, never overlapped; at ZeRO-2 and 3 its
    reduce-scatter half,
    :func:`reduced_share`, once per micro-batch without a pipeline:
    :meth:`hpcnn.parallel.data.sharded.ShardedGradients.hook_for`). Where the machine file
    says ``dp_overlap`` (its collectives on their own stream, hpcnn train's default
    ``--overlap``: a bucket's reduction launched as the last micro-batch's backward fills it,
    :mod:`hpcnn.parallel.data.bucketed`), what the backward of ``window`` seconds does not
    hide, plus the last bucket's (``--bucket_mb``'s default), at most the whole; else the
    whole, after the step (the machine files where ranks share cores: what their validation
    measured)."""
    nbytes = params * model.reduce_word
    if model.grad_reduce == "param":
        # hpcnn's 16-bit reduction: a blocking ring on the compute's thread, whatever the
        # overlap and the algorithm (hpcnn.parallel.data.bucketed.narrow_allreduce)
        return dict(_dp_forms_of(nbytes, layout, machine, window))["flat"]
    share = reduced_share(layout)
    times = layout.microbatches if share < 1 and layout.pp == 1 else 1
    whole = dp_allreduce_s(nbytes, layout, machine, after=window) * share
    if not getattr(machine, "dp_overlap", False) or whole == 0:
        return times * whole
    last = dp_allreduce_s(min(nbytes, _bucket_bytes()), layout, machine, after=window) * share
    return times * min(whole, max(0.0, whole - window) + last)


@lru_cache(maxsize=1)
def _bucket_bytes() -> int:
    """Bytes of a gradient bucket at ``hpcnn train``'s default ``--bucket_mb``."""
    from hpcnn.config import TrainConfig
    return TrainConfig.bucket_mb * 2 ** 20


def _priced_parts(model: Transformer, layout: Layout, machine, optimizer: str) -> StageTimes:
    """The StageTimes of the uniform ``layout``: the one place its formulas live, for
    :func:`price` and :func:`stage_times`. Interleaved: the schedule's span in chunk passes
    (:func:`_chunk_times`), the StageTimes' passes a rank's v chunks together."""
    per_stage = model.n_layers / layout.pp
    t_f, t_b, t_w, tp_s, span, msg, pp_s, held_s = _unsharded_times(
        model, dataclasses.replace(layout, zero=0) if layout.zero else layout, machine)
    # every stage priced as the last (the head's table): the fullest, the first, has the
    # embedding's and position tables too
    local_params = _stage_params(model, layout, 0, per_stage, True)
    dp_s = dp_seconds(model, layout, machine, local_params, t_b)
    opt_s = sharded_update_seconds(local_params, layout, machine, model.word, optimizer)
    return StageTimes(t_f, t_b, t_w, tp_s, span, msg, pp_s, dp_s, opt_s, held_s)


@lru_cache(maxsize=4096)
def _unsharded_times(model: Transformer, layout: Layout, machine) -> tuple:
    """(t_f, t_b, t_w, tp_s, span, msg, pp_s, held_s) of the uniform ``layout``: what does not
    depend on its ZeRO stage, once for a plan's ZeRO stages of one layout."""
    pp, m_count, v = layout.pp, layout.microbatches, layout.virtual
    c_f, c_b, c_w, c_tp = _chunk_times(model, layout, machine, model.n_layers / pp)
    halves = tuple((c,) * (pp * v) for c in (c_f, c_b - c_w, c_w))    # every chunk alike
    span = pipeline.formula_makespan(layout.schedule, pp, m_count, c_f, c_b - c_w, c_w, v)
    if span is None:
        span = _simulated_span(layout.schedule, pp, m_count, *halves, virtual=v)
    t_f, t_b, t_w, tp_s = v * c_f, v * c_b, v * c_w, v * c_tp
    span = _weighted(layout, machine, span, m_count * (t_f + t_b))
    slack = 0.0
    if pp > 1 and _plain_1f1b(layout):      # the middle stages' passes, without the LM head
        mid = _pass_times(model, layout, machine, model.n_layers / pp, False)
        slack = c_f + c_b - mid[0] - mid[1]
    msg, pp_s, wire = _messages(model, layout, machine, c_f, slack)
    if pp_s is None or (not _counted(layout, wire, c_f, c_b - c_w, c_w)
                        and pp * m_count <= SIMULATED_PASSES):
        pp_s = _simulated_waits(layout, halves, msg, wire)
    return t_f, t_b, t_w, tp_s, span, msg, pp_s, held_seconds(model, layout, machine)


@lru_cache(maxsize=256)
def _lists(schedule: str, pp: int, m_count: int, virtual: int = 1) -> tuple:
    """The instruction lists of ``schedule`` on pp ranks, pp x ``virtual`` stages, M
    micro-batches, validated once (every stage cut of a plan simulates the same lists)."""
    lists = pipeline.SCHEDULES[schedule](pp * virtual, m_count, pp)
    pipeline.validate(lists, pp * virtual, m_count, pp)
    return tuple(tuple(lst) for lst in lists)


def _held_bytes(model: Transformer, layout: Layout, stage: int, blocks: float,
                beyond_one: bool = False) -> float:
    """Activation bytes stage ``stage`` of ``blocks`` transformer blocks holds at its peak
    (with ``beyond_one``: those beyond one micro-batch's, without the gradient pair): its
    held micro-batches (:func:`held_microbatches`) x (the blocks' caches; the tail's caches on
    the last stage, the int64 tokens on the first). Under ``remat="full"`` a micro-batch keeps
    its blocks' inputs and, but on the last stage, its output until its gradient comes
    (:func:`hpcnn.schedule.sequences.segments` without the loss; on the last stage its last
    segment's cache is the tail, counted above); once per rank, a backward in progress holds
    its gradient pair (dy, dx) and one block's recomputed cache on top: the rematerializing
    executor's account (:meth:`hpcnn.memory.executor.Executor`), which counts these where a
    stored cache does not.
    Under ``remat="selective"`` the blocks' caches less their attention cores'
    (:func:`attention_core`). Interleaved (v chunks): chunk passes of blocks / v blocks each,
    the tail held once (the last chunk's one micro-batch), the tokens for at most m of them.
    """
    rows, v = model.batch // (layout.dp * layout.microbatches), layout.virtual
    _, _, cache, _, xbytes = _layout_block(model, layout, rows)
    last, unit = stage == layout.pp - 1, blocks / v
    tail = _tail(model.dim, model.seq, rows, model.vocab, model.word, layout.tp) if last else 0
    tokens = rows * model.seq * 8 if stage == 0 else 0  # the first stage's int64 input
    pending = 0
    if layout.remat == "full":
        held, pending = xbytes * unit + (0 if last and v == 1 else xbytes), 2 * xbytes + cache
    elif layout.remat == "selective":
        held = (cache - rows * attention_core(model.dim, model.n_heads, model.seq, model.word,
                                              layout.tp, layout.sequence_parallel,
                                              model.dropout)[1]) * unit
    else:
        held = cache * unit
    count = held_microbatches(layout.schedule, layout.pp, layout.microbatches, stage, v)
    total = (count * held + (count if v == 1 else 1) * tail
             + (count if v == 1 else min(layout.microbatches, count)) * tokens)
    return total - (held + tail + tokens) if beyond_one else total + pending


def held_seconds(model: Transformer, layout: Layout, machine, blocks=None) -> float:
    """Seconds a step pays for the activations its fullest stage holds beyond one micro-batch's
    (module docstring, "held activations"): the device's ``elementwise["held"]`` seconds per
    byte times the most such bytes (:func:`_held_bytes`) over the stages of ``blocks``
    transformer blocks each (default the uniform cut: n_layers / pp each)."""
    per_byte = machine.device.elementwise.get("held", 0.0)
    if per_byte == 0.0:
        return 0.0
    blocks = blocks or [model.n_layers / layout.pp] * layout.pp
    return per_byte * max(_held_bytes(model, layout, s, n, beyond_one=True)
                          for s, n in enumerate(blocks))


def _stage_params(model: Transformer, layout: Layout, stage: int, blocks: float,
                  head: bool) -> float:
    """Parameters of one rank of stage ``stage``: its blocks' share, a vocab x dim / tp table
    where it holds the LM head (``head``), and on the first stage the vocab-parallel
    embedding's table and the position table (whole on every tp rank); the final LayerNorm's
    2 x dim words are left out."""
    pbytes = _block(model.dim, model.n_heads, model.seq, 1, model.word, layout.tp)[3]
    table = model.vocab * model.dim / layout.tp
    first = table + model.seq * model.dim if stage == 0 else 0
    return blocks * pbytes / model.word + (table if head else 0) + first


def _accumulated_params(model: Transformer, layout: Layout, blocks: float,
                        head: bool) -> float:
    """Parameters of one rank's ``blocks`` transformer blocks and, with ``head``, its
    vocab x dim / tp LM head: those whose gradients a micro-batch's GEMMs add to
    (:func:`accumulate_seconds`); the embedding's and position tables' are scatter-added
    by token, not in a pass over the table (:class:`hpcnn.nn.transformer.Embedding`)."""
    pbytes = _block(model.dim, model.n_heads, model.seq, 1, model.word, layout.tp)[3]
    return blocks * pbytes / model.word + (model.vocab * model.dim / layout.tp if head else 0)


def _stage_memory(model: Transformer, layout: Layout, stage: int, blocks: float, head: bool,
                  optimizer: str, slots: int | None = None) -> float:
    """Bytes one rank of stage ``stage`` holds at its peak: the sum of
    :func:`stage_memory_parts`."""
    return sum(stage_memory_parts(model, layout, stage, blocks, head, optimizer, slots).values())


def stage_memory_parts(model: Transformer, layout: Layout, stage: int, blocks: float,
                       head: bool, optimizer: str, slots: int | None = None) -> dict:
    """Bytes one rank of stage ``stage`` holds at its peak, by kind: ``parameters``,
    ``gradients`` and ``optimizer`` (the slots and, at 16 bits, the master copy) of its
    parameters (:func:`_stage_params`; 1/dp of them by the ZeRO stage, :func:`state_bytes`;
    at ZeRO-2 and 3 the gradients also count the buffers their reduction holds,
    :func:`grad_buffer_params`), ``scratch`` (the optimizer's: an array the size of its
    largest parameter, an MLP weight,
    dim x 4 dim / tp, or a table; at zero >= 1 at most the rank's part), ``gathered`` (at zero
    3 the parameters of two blocks, one computing, the next prefetched: twice the largest of a
    transformer block, the embedding's tables, the LM head) and ``activations`` (the held
    ones, :func:`_held_bytes`)."""
    key = _state_key(layout.dp, layout.tp, layout.zero, layout.pp > 1)
    state = _state_parts(model, key, stage == 0, blocks, head, optimizer, slots)
    return {**state, "activations": _held_bytes(model, layout, stage, blocks)}


@lru_cache(maxsize=4096)
def _state_key(dp: int, tp: int, zero: int, pipelined: bool = False) -> Layout:
    """What of a layout its state's memory reads (:func:`_state_parts`): dp, tp, ZeRO stage
    and whether it is a pipeline (pp 2 for any pp > 1)."""
    return Layout(dp, tp, 2 if pipelined else 1, 1, zero=zero)


@lru_cache(maxsize=4096)
def _state_parts(model: Transformer, layout: Layout, first: bool, blocks: float, head: bool,
                 optimizer: str, slots: int | None) -> dict:
    """:func:`stage_memory_parts` but the activations, of the first stage (``first``) or
    another: what depends on the layout's dp, tp, ZeRO stage and whether it is a pipeline
    alone, once per plan."""
    stage = 0 if first else 1
    table = model.vocab * model.dim / layout.tp
    largest = max(4 * model.dim * model.dim / layout.tp, table if head or stage == 0 else 0,
                  model.seq * model.dim if stage == 0 else 0)
    params = _stage_params(model, layout, stage, blocks, head)
    gathered = 0.0
    if layout.zero:                          # the scratch: at most the rank's part
        largest = min(largest, params / layout.dp)
    if layout.zero == 3 and layout.dp > 1:
        gathered = 2 * _largest_block(model, layout.tp, first, head)
    wide = _wide(model)
    dp, zero = layout.dp, layout.zero
    weights = params * model.word / (dp if zero >= 3 else 1)
    grads = params * wide / (dp if zero >= 2 else 1)
    buffers = _grad_buffers(model, layout, first, blocks, head)[0]
    return {"parameters": weights, "gradients": grads + buffers,
            "optimizer": state_bytes(optimizer, layout, model.word, slots) * params
            - weights - grads,
            "scratch": largest * wide, "gathered": gathered * model.word}


def _largest_block(model: Transformer, tp: int, first: bool, head: bool) -> float:
    """Parameters of the largest block of a stage's chain, as one of ``tp`` ranks holds them:
    a transformer block, the LM head's table (``head``), the embedding's and position tables
    (the ``first`` stage)."""
    block = _block(model.dim, model.n_heads, model.seq, 1, model.word, tp)[3] / model.word
    table = model.vocab * model.dim / tp
    return max(block, table if head else 0, table + model.seq * model.dim if first else 0)


def _wide(model: Transformer) -> int:
    """Bytes of a gradient and an optimizer word: float32 under 16-bit parameters."""
    return 4 if model.word == 2 else model.word


def _grad_buffers(model: Transformer, layout: Layout, first: bool, blocks: float,
                  head: bool) -> tuple:
    """(priced, least) bytes of the buckets a rank's ZeRO-2 or 3 reduction binds whole, on
    the ``first`` stage or another of ``blocks`` transformer blocks (``head``: with the LM
    head): :func:`grad_buffer_params`'s, and without a pipeline the one block's a backward
    binds at least (the block computing writes its gradients before any is reduced); (0, 0)
    below ZeRO-2 or at dp 1."""
    if layout.zero < 2 or layout.dp == 1:
        return 0.0, 0.0
    params = _stage_params(model, layout, 0 if first else 1, blocks, head)
    chain, wide = _largest_block(model, layout.tp, first, head), _wide(model)
    priced = grad_buffer_params(params, chain, wide, layout.pp > 1) * wide
    return priced, priced if layout.pp > 1 else min(params, chain) * wide


def grad_buffer_params(params: float, chain: float, word: int, pipelined: bool,
                       bucket: float | None = None) -> float:
    """Gradient elements the ZeRO-2 and 3 reduction holds whole at its peak, besides the rank's
    reduced part, as hpcnn's engine runs it (:class:`hpcnn.parallel.data.sharded.
    ShardedGradients`): a bucket's storage is bound when the backward first writes it and
    freed once its reduce-scatter is done. Without a pipeline (``--overlap``) every
    micro-batch's buckets are reduce-scattered during its own backward, and after each block
    the engine waits for those launched two blocks before: at most the block computing and
    the two before it, each rounded up to the buckets (``--bucket_mb``) that cover it, 3
    (``chain`` + a bucket), ``chain`` the chain's largest block, at most all ``params``. A
    pipeline (``pipelined``) reduces once, after its last micro-batch: every one of its
    ``params`` gradients is held until then. ``word``: the gradients' bytes; ``bucket``: the
    buckets' bytes (default ``hpcnn train``'s)."""
    if pipelined:
        return params
    return min(params, 3 * (chain + (_bucket_bytes() if bucket is None else bucket) / word))


def rank_memory(model: Transformer, layout: Layout, optimizer: str = "adamw",
                slots: int | None = None, held: bool = True, least: bool = False) -> float:
    """Bytes some rank of ``layout`` holds at least, however its stages are cut: the mean over
    its pp stages of :func:`_stage_memory` on the uniform cut (n_layers / pp transformer blocks
    each, the embedding's tables on the first stage, the LM head on the last only), which for
    pp = 1 is :func:`price`'s ``memory_bytes``. The stages' parameters, gradients and optimizer
    state sum to the model's whatever the cut, so the fullest stage holds at least their mean;
    so do the held activations where every stage holds as many micro-batches (one micro-batch:
    the least a stage holds). ``slots``: the optimizer's arrays per parameter (default
    :data:`STATE_WORDS` of ``optimizer`` less two; SGD without momentum holds none);
    ``held=False``: without the held activations (a rematerialization this module does not
    price); ``least``: at ZeRO-2 and 3 the least gradient buckets a backward binds
    (:func:`_grad_buffers`), instead of those :func:`grad_buffer_params` prices."""
    pp, blocks = layout.pp, model.n_layers / layout.pp
    total = 0.0
    for s in range(pp):
        head = s == pp - 1
        total += _stage_memory(model, layout, s, blocks, head, optimizer, slots)
        if not held:
            total -= _held_bytes(model, layout, s, blocks)
        if least:
            priced, floor = _grad_buffers(model, layout, s == 0, blocks, head)
            total -= priced - floor
    return total / pp


def _staged(model: Transformer, layout: Layout, machine, optimizer: str, heads=None):
    """(span, pp messages, busiest stage's (t_f, t_b, t_w, tp_s), dp allreduce + update of the
    fullest stage as (dp_s, opt_s)) of a layout with explicit ``stages`` (its memory:
    :func:`_staged_memory`).

    Our choices (the thesis is silent on stage cuts): each stage's times from its own block
    count (:func:`_pass_times`), the LM head's on the stages in ``heads`` (default: the last
    only; the embedding's gather is free, as in the uniform price); the span is the schedule
    simulated with these per-stage times (:func:`hpcnn.schedule.pipeline.simulate`); the
    stages reduce their gradients and update in parallel, the slowest of them counting;
    memory per rank is the fullest stage's (:func:`_staged_memory`).
    ``heads`` = every stage is the uniform price's convention (every stage priced as the last):
    with uniform stages this prices exactly as :func:`price` prices the uniform layout."""
    pp, m_count, word = layout.pp, layout.microbatches, model.word
    heads = {pp - 1} if heads is None else set(heads)
    once = {key: _pass_times(model, layout, machine, *key)       # a few distinct stages
            for key in {(n, s in heads) for s, n in enumerate(layout.stages)}}
    times = [once[n, s in heads] for s, n in enumerate(layout.stages)]
    t_f, t_b, t_w, _ = (tuple(t) for t in zip(*times))
    halves = (t_f, tuple(b - w for b, w in zip(t_b, t_w)), t_w)
    passes = [f + b for f, b in zip(t_f, t_b)]
    span = _staged_span(layout.schedule, pp, m_count, *halves)
    span = _weighted(layout, machine, span, m_count * max(passes))
    slack = max(0.0, passes[-1] - max(passes[:-1]))     # the last stage's lead, where it leads
    msg, pp_s, wire = _messages(model, layout, machine, max(t_f), slack)
    if pp_s is None or pp * m_count <= SIMULATED_PASSES:   # the cut's own waits, simulated
        pp_s = _simulated_waits(layout, halves, msg, wire)
    params = dict.fromkeys(_stage_params(model, layout, s, layout.stages[s], s in heads)
                           for s in _fullest_candidates(layout.stages, heads))
    reduce = [(dp_seconds(model, layout, machine, q, max(t_b)),
               sharded_update_seconds(q, layout, machine, word, optimizer)) for q in params]
    busiest = times[passes.index(max(passes))]
    return span, pp_s, busiest, max(reduce, key=sum)


def _staged_memory(model: Transformer, layout: Layout, heads: set, optimizer: str) -> dict:
    """The fullest stage's memory by kind (:func:`stage_memory_parts`) of a layout with
    explicit ``stages``, the LM head's table on the stages in ``heads``."""
    return max((stage_memory_parts(model, layout, s, layout.stages[s], s in heads, optimizer)
                for s in _fullest_candidates(layout.stages, heads)),
               key=lambda m: sum(m.values()))


def _fullest_candidates(stages: tuple, heads: set) -> list:
    """The stages of a cut that may hold the most, and the most parameters: the first of each
    block count (with or without the head) and the last. A later stage of as many blocks holds
    no more: no more micro-batches (:func:`held_microbatches` falls or stays with the stage on
    every schedule that runs explicit stages), and the embedding's tables and the tokens only
    on the first."""
    first = {}
    for s, n in enumerate(stages):
        first.setdefault((n, s in heads), s)
    return sorted({*first.values(), len(stages) - 1})


def _staged_span(schedule: str, pp: int, m_count: int, t_f: tuple, t_b: tuple,
                 t_w: tuple) -> float:
    """The makespan of ``schedule`` with these per-stage times (messages free): simulated up to
    :data:`SIMULATED_PASSES` stage passes (:func:`_simulated_span`); beyond, GPipe's exactly
    (its forwards and its backwards each a flow shop of M identical jobs: the stages' sum and
    M - 1 times the slowest) and the other schedules' with every stage as slow as the busiest
    (:func:`hpcnn.schedule.pipeline.formula_makespan`), the convention of the uniform price
    (every stage priced as the last): exact on equal stages, above the simulated span on
    others (a span is its schedule's longest path, which no shorter pass lengthens)."""
    if pp * m_count <= SIMULATED_PASSES:
        return _simulated_span(schedule, pp, m_count, t_f, t_b, t_w)
    back = tuple(b + w for b, w in zip(t_b, t_w))
    if schedule == "gpipe":
        return sum(t_f) + (m_count - 1) * max(t_f) + sum(back) + (m_count - 1) * max(back)
    busiest = max(range(pp), key=lambda k: t_f[k] + back[k])
    span = pipeline.formula_makespan(schedule, pp, m_count, t_f[busiest], t_b[busiest],
                                      t_w[busiest])
    return (span if span is not None else
            _simulated_span(schedule, pp, m_count, t_f, t_b, t_w))


@lru_cache(maxsize=1024)
def _simulated_span(schedule: str, pp: int, m_count: int, t_f: tuple, t_b: tuple,
                    t_w: tuple, t_comm: float = 0.0, virtual: int = 1) -> float:
    """The makespan of ``schedule`` on pp ranks of ``virtual`` chunks each, simulated with
    these per-stage (per-chunk) times, each message taking ``t_comm`` (0: messages free),
    once for the layouts that share them (a plan's ZeRO stages cut alike)."""
    return pipeline.makespan(_lists(schedule, pp, m_count, virtual), t_f, t_b, t_w, t_comm)


def _check_fits(model: Transformer, layout: Layout) -> None:
    """ValueError where ``layout`` cannot run ``model``: interleaving whose chunks do not split
    the layers evenly or whose micro-batches are not a multiple of pp (hpcnn's
    :func:`~hpcnn.schedule.pipeline.interleaved_1f1b`), sequence parallelism whose tp does not
    divide the sequence."""
    v, pp = layout.virtual, layout.pp
    if v > 1 and (model.n_layers % (pp * v) or layout.microbatches % pp):
        raise ValueError(f"{layout}: interleaving needs the {model.n_layers} layers in pp x "
                         f"virtual = {pp * v} equal chunks and micro-batches a multiple of pp")
    if layout.sequence_parallel and model.seq % layout.tp:
        raise ValueError(f"{layout}: sequence parallelism needs tp dividing seq = {model.seq}")
    _check_reduce(model, (layout.zero,))


def _check_reduce(model: Transformer, zero) -> None:
    """ValueError where the gradients reduced at the parameters' 16 bits meet ZeRO-2 or 3,
    whose reduce-scatter hpcnn runs on the float32 gradients (as ``hpcnn train`` refuses)."""
    if model.grad_reduce == "param" and max(zero) >= 2:
        raise ValueError(f"grad_reduce='param' with ZeRO stage {max(zero)}: ZeRO-2 and 3 "
                         f"reduce-scatter the float32 gradients; use grad_reduce='fp32' or "
                         f"ZeRO stages 0 and 1")


def price(model: Transformer, layout: Layout, machine, memory_bytes: float | None = None,
          optimizer: str = "adamw") -> Priced:
    """The predicted memory per rank and step time of ``layout`` (see the module docstring; a
    layout with explicit ``stages``: :func:`_staged`), the step priced when first read
    (:class:`Priced`)."""
    pp = layout.pp
    _check_fits(model, layout)
    if layout.stages:
        if sum(layout.stages) != model.n_layers:
            raise ValueError(f"stages {layout.stages} hold {sum(layout.stages)} transformer "
                             f"blocks, the model has {model.n_layers}")
        memory = _staged_memory(model, layout, {pp - 1}, optimizer)
    else:
        per_stage = model.n_layers / pp
        # uniform stages, each priced as the last: a middle stage holds what the first does
        # less its tables, tokens and (every schedule's held count falls with the stage) its
        # extra micro-batches; the first and the last are the candidates for the fullest
        memory = max((stage_memory_parts(model, layout, s, per_stage, True, optimizer)
                      for s in sorted({0, pp - 1})), key=lambda m: sum(m.values()))
    total = sum(memory.values())
    cap = machine.device.memory_bytes if memory_bytes is None else memory_bytes
    return Priced(layout, total, total <= cap, memory, (model, machine, optimizer))


def _step_times(model: Transformer, layout: Layout, machine, optimizer: str) -> StageTimes:
    """The times :func:`price`'s step adds up: the uniform layout's (:func:`_priced_parts`),
    or the busiest stage's and the schedule's span of a layout with explicit stages
    (:func:`_staged`)."""
    if not layout.stages:
        return _priced_parts(model, layout, machine, optimizer)
    span, pp_s, (t_f, t_b, _, tp_s), (dp_s, opt_s) = _staged(model, layout, machine, optimizer)
    return StageTimes(t_f, t_b, 0.0, tp_s, span, 0.0, pp_s, dp_s, opt_s,
                      held_seconds(model, layout, machine, layout.stages))


def _step_parts(model: Transformer, layout: Layout, machine, st: StageTimes) -> dict:
    """A step's seconds (:func:`price`) by part: compute, memory-bound operations
    (:func:`memory_bound_seconds`), tensor-parallel communication, the pipeline's bubble and
    messages, the data-parallel reduction, the optimizer, the held activations."""
    m_count = layout.microbatches
    tp_comm = m_count * st.tp_s * (1 + regather_share(layout))
    compute = m_count * (st.t_f + st.t_b) - tp_comm
    memory_bound = min(compute, memory_bound_seconds(model, layout, machine))
    return {"compute": compute - memory_bound, "memory_bound": memory_bound,
            "tp_comm": tp_comm,
            "bubble": st.span - m_count * (st.t_f + st.t_b), "pp_comm": st.pp_s,
            "dp_comm": st.dp_s, "optimizer": st.opt_s, "held": st.held_s}


def _formula(layout: Layout, st: StageTimes, optimizer: str, step: float) -> str:
    """A step (:func:`price`) as the sum of its terms."""
    cut = f"stages {'|'.join(map(str, layout.stages))}, busiest " if layout.stages else ""
    return (f"({layout.microbatches} micro-batches, {layout.pp} stages) {layout.schedule} span "
            f"{st.span:.4g} s [{cut}t_f {st.t_f:.3g} + t_b {st.t_b:.3g} per stage pass, of "
            f"which tp {st.tp_s:.3g}] + pp messages {st.pp_s:.3g} + dp allreduce "
            f"{st.dp_s:.3g} + {optimizer} update {st.opt_s:.3g}"
            + (f" + held activations {st.held_s:.3g}" if st.held_s else "")
            + f" = {step:.4g} s")


def stage_cut(model: Transformer, layout: Layout, machine,
              memory_bytes: float | None = None, optimizer: str = "adamw") -> tuple:
    """Transformer blocks per stage of ``layout`` (pp > 1): the cut of least slowest stage whose
    every stage fits ``memory_bytes`` (default the device's), by the exact dynamic programme
    :func:`hpcnn.schedule.stages.by_cost_bounded`; where no cut fits, the uniform cut
    (:func:`hpcnn.schedule.stages.uniform`; :func:`price` then marks the layout infeasible,
    and a second, unbounded programme for a layout that cannot run took most of the plan's
    time on the largest models).

    Our choices (the thesis is silent on stage cuts): a block costs its forward + backward
    seconds (:func:`_pass_times` of one block), the LM head is a fixed cost of the last stage;
    a block on stage s needs its parameters x 4 words plus its cache (its input under remat)
    times the micro-batches stage s holds; the first stage carries the embedding's and
    position tables and the tokens, the last the head's table and the tail's caches
    (:func:`_stage_memory`), so the cut's memory per stage is what :func:`price` charges it.
    The objective is the slowest stage, not the simulated span: the schedule's span grows
    with it, and it is what the existing ``by_cost`` cut balances."""
    pp, n = layout.pp, model.n_layers
    uniform = dataclasses.replace(layout, stages=())
    head = _pass_times(model, uniform, machine, 0, True)
    bare = _pass_times(model, uniform, machine, 0, False)        # a pass's own fixed cost
    # a block's passes as a stage of several prices them (under remat, its forward run again)
    one = [a - h for a, h in zip(_pass_times(model, uniform, machine, 1, True), head)]
    block_params = _stage_params(model, uniform, 1, 1, False)
    memory = [[state_bytes(optimizer, uniform, model.word) * block_params
               + _held_bytes(model, uniform, s, 1)
               - _held_bytes(model, uniform, s, 0)] * n for s in range(pp)]
    # a stage's fixed part: its _stage_memory without blocks (the scratch of one block's largest
    # weight included: every stage holds a block)
    fixed_memory = [_stage_memory(model, uniform, s, 0, s == pp - 1, optimizer)
                    for s in range(pp)]
    fixed_cost = [bare[0] + bare[1]] * (pp - 1) + [head[0] + head[1]]
    cap = machine.device.memory_bytes if memory_bytes is None else memory_bytes
    costs = [one[0] + one[1]] * n
    # the fullest stage holds at least the mean over the stages, at least (their fixed parts +
    # every block at the least a block costs a stage) / pp: above the cap, no cut fits
    if (sum(fixed_memory) + n * min(row[0] for row in memory)) / pp > cap:
        return tuple(b - a for a, b in partition.uniform(n, pp))
    ranges = (partition.by_cost_bounded(costs, memory, pp, cap, fixed_cost, fixed_memory)
              or partition.uniform(n, pp))
    return tuple(b - a for a, b in ranges)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# A layout with explicit stages is priced by simulating its schedule (pp x M micro-batch passes
# of each kind), milliseconds to seconds each: plan() offers stage cuts up to this many passes
# and keeps the uniform layouts alone beyond (our choice: GPT-3 on 1024 devices of
# machines/dgx-a100-cluster.toml plans in 0.2 s uniform, 0.58 s with cuts up to 64 passes,
# 1.3 s up to 256, on this 2-core machine idle; the cut DP and the simulations share the time).
STAGE_CUT_PASSES = 64
# Up to how many stage passes (pp x M) a pp that does not divide the layers is offered its even
# cut, where no cut is searched.
EVEN_CUT_PASSES = 2048
# Up to how many stage passes a layout with explicit stages has its schedule simulated with each
# stage's own times (milliseconds each); beyond, closed forms (_staged_span).
SIMULATED_PASSES = STAGE_CUT_PASSES


def layouts(model: Transformer, devices: int, *, schedules=SCHEDULES, remat=REMAT, machine=None,
            memory_bytes: float | None = None, zero=(0,), allow: dict | None = None):
    """Every layout of ``model`` on ``devices``: dp x tp x pp = devices, tp dividing the heads,
    pp dividing the layers, any count of micro-batches M with dp x M dividing the batch (and
    M >= pp for the pipelined schedules' steady state), each schedule, chunk count, remat,
    sequence parallelism and ZeRO choice (:func:`_variants`).

    With a ``machine``, each pipelined choice (pp > 1) with pp x M <= :data:`STAGE_CUT_PASSES`
    also comes with explicit stages cut by :func:`stage_cut` for that machine and
    ``memory_bytes``, pp then any number up to the layers (not only their divisors).
    ``allow`` fixes or bounds dimensions (:data:`DIMENSIONS`) -> the values allowed (any
    container: a set, a ``range``); a dimension not named is free."""
    ok = _allowed(allow or {})
    for tp in _divisors(devices):
        if model.n_heads % tp or not ok("tp", tp):
            continue
        for pp in _divisors(devices // tp):
            uniform = model.n_layers % pp == 0
            if not uniform and (machine is None or pp > model.n_layers) or not ok("pp", pp):
                continue
            dp = devices // (tp * pp)
            if model.batch % dp or not ok("dp", dp):
                continue
            for m_count in _divisors(model.batch // dp):
                if (pp > 1 and m_count < pp) or not ok("microbatches", m_count) or not ok(
                        "micro_batch_size", model.batch // (dp * m_count)):
                    continue
                for lay in _variants(model, Layout(dp, tp, pp, m_count), schedules, remat,
                                     zero, ok, uniform):
                    yield from _with_cut(lay, uniform, model, machine, memory_bytes)


def _variants(model: Transformer, base: Layout, schedules, remat, zero, ok, uniform: bool):
    """``base`` (dp, tp, pp, M) in each schedule of ``schedules`` (pp > 1; else 1F1B), each
    chunk count v >= 2 of the interleaved schedule (uniform stages, v dividing n_layers / pp,
    M a multiple of pp: as ``hpcnn train --virtual`` builds it), each remat of ``remat`` (no
    rematerialized zero-bubble schedule: their split backward is not rematerialized), with and
    without sequence parallelism (tp > 1, tp dividing seq; not with ZeRO-2 and 3, as ``hpcnn
    train`` refuses), each ZeRO stage of ``zero`` (1 and 2 where dp > 1, 3 where also pp = 1),
    as ``ok`` allows."""
    dp, tp, pp, m_count = base.dp, base.tp, base.pp, base.microbatches
    chunks = {"interleaved": [v for v in _divisors(model.n_layers // pp)[1:]
                              if uniform and m_count % pp == 0]}
    sps = (False, True) if tp > 1 and model.seq % tp == 0 else (False,)
    for s in (("1f1b",) if pp == 1 else schedules):
        if not ok("schedule", s):
            continue
        for v in chunks.get(s, (1,)):
            for r in remat:
                if r != "none" and s.startswith("zb") or not (ok("remat", r)
                                                              and ok("virtual", v)):
                    continue                             # (zero bubble: as train refuses)
                for sp in sps:
                    for z in zero if dp > 1 else (0,):
                        if (z == 3 and pp > 1 or sp and z >= 2 or not ok("zero", z)
                                or not ok("sequence_parallel", sp)):
                            continue                     # (as train refuses)
                        yield Layout(dp, tp, pp, m_count, s, r, (), z, v, sp)


DIMENSIONS = ("tp", "pp", "dp", "microbatches", "micro_batch_size", "schedule", "remat", "zero",
              "virtual", "sequence_parallel")


def _allowed(allow: dict):
    """``ok(name, value)``: whether ``allow`` (dimension -> allowed values) lets ``value``."""
    unknown = set(allow) - set(DIMENSIONS)
    if unknown:
        raise ValueError(f"unknown layout dimension(s) {sorted(unknown)}: expected some of "
                         f"{list(DIMENSIONS)}")
    return lambda name, value: name not in allow or value in allow[name]


def _with_cut(lay: Layout, uniform: bool, model, machine, memory_bytes):
    """``lay`` if its stages are uniform, and with a ``machine`` its stage cut (pipelined, up
    to :data:`STAGE_CUT_PASSES` passes, micro-batch counts a power of two: each cut is a
    search and a simulation, what a plan's time goes to); where pp does not divide the layers
    and no cut is searched, the even cut (the first stages a block more, as
    :func:`hpcnn.schedule.stages.uniform` and BLOOM's 70 layers on 12 stages), up to
    :data:`EVEN_CUT_PASSES` passes (one simulation each)."""
    if uniform:
        yield lay
    if machine is None or lay.pp == 1 or lay.virtual > 1:
        return
    m = lay.microbatches
    if lay.pp * m <= STAGE_CUT_PASSES and not m & (m - 1):
        yield dataclasses.replace(lay, stages=stage_cut(model, lay, machine, memory_bytes))
    elif not uniform and lay.pp * m <= EVEN_CUT_PASSES:
        yield dataclasses.replace(lay, stages=_even_cut(model.n_layers, lay.pp))


@lru_cache(maxsize=256)
def _even_cut(n_layers: int, pp: int) -> tuple:
    """Transformer blocks per stage of the even cut of ``n_layers`` over ``pp`` stages."""
    return tuple(b - a for a, b in partition.uniform(n_layers, pp))


def plan(model: Transformer, machine, devices: int | None = None, *,
         memory_bytes: float | None = None, zero=(0,), allow: dict | None = None,
         remat=REMAT) -> list[Priced]:
    """Every layout priced (:func:`layouts` with this machine: the uniform ones and the stage
    cuts; ``allow`` fixing or bounding dimensions; ``remat`` the choices offered, of
    :data:`PRICED_REMAT`), the feasible ones first, each group by predicted step time."""
    devices = machine.p if devices is None else int(devices)
    if devices < 1 or devices > machine.p:
        raise ValueError(f"devices={devices}: the machine {machine.name!r} has {machine.p}")
    _check_reduce(model, zero)
    out = [price(model, lay, machine, memory_bytes)
           for lay in layouts(model, devices, machine=machine, memory_bytes=memory_bytes,
                              zero=zero, allow=allow, remat=remat)]
    if not out:
        raise ValueError(f"no layout of {model} fits {devices} devices (tp must divide the "
                         f"{model.n_heads} heads, pp the {model.n_layers} layers or be cut "
                         f"into stages, dp the batch)"
                         + (f" within {allow}" if allow else ""))
    return sorted(out, key=plan_order)


def plan_order(q: Priced) -> tuple:
    """:func:`plan`'s order: the feasible layouts first, by predicted step time; the others by
    memory."""
    return not q.feasible, q.step_s if q.feasible else q.memory_bytes


def flops_per_step(model: Transformer) -> float:
    """Model FLOPs of one step (forward + backward, no recomputation): for throughput."""
    f, b, *_ = _block(model.dim, model.n_heads, model.seq, model.batch, model.word, 1, False,
                      model.dropout)
    head = 2.0 * model.batch * model.seq * model.dim * model.vocab
    return model.n_layers * (f + b) + 3 * head


def hardware_flops_per_step(model: Transformer, layout: Layout) -> float:
    """FLOPs one step runs, recomputation counted: :func:`flops_per_step` plus, under
    ``remat="full"``, the forward of every block, run again (:func:`recomputed_forward`),
    under ``remat="selective"`` the forward of every block's attention core
    (:func:`attention_core`, on the whole sequence)."""
    if layout.remat == "selective":
        return flops_per_step(model) + model.n_layers * model.batch * attention_core(
            model.dim, model.n_heads, model.seq, model.word, 1, False, model.dropout)[0]
    if layout.remat != "full":
        return flops_per_step(model)
    f = _block(model.dim, model.n_heads, model.seq, model.batch, model.word, 1, False,
               model.dropout)[0]
    return flops_per_step(model) + f * model.n_layers


__all__ = ["DIMENSIONS", "Layout", "ONE_STAGE_PER_RANK", "PRICED_REMAT", "Priced", "StageTimes",
           "Transformer", "accumulate_seconds", "attention_core", "dp_allreduce_forms",
           "dp_seconds",
           "flops_per_step", "hardware_flops_per_step",
           "held_microbatches", "memory_bound_seconds",
           "layouts", "plan", "price", "recomputed_forward", "ring_allreduce_s", "stage_cut",
           "stage_times", "update_seconds"]
