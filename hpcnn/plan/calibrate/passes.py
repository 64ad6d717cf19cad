"""The device figures of passes through the step engine, as training runs them on one rank.

- :func:`tokens_costs`: a ladder of one transformer block on 1 to 8 sequences a micro-batch
  (:data:`TOKENS_LADDER`), each rung's time per token beyond the fixed cost over the top rung's:
  the device's ``tokens`` slowdown of small calls; :func:`rows_costs`, the linear kind's alike
  over rows (:data:`LINEAR_ROWS`), timed bare.
- :func:`stage_costs`: what a pipeline stage's pass costs beyond its blocks (the instruction's
  handling, the embedding, the tail's small calls, the loss): ``overhead["stage"]``.
- :func:`held_costs`: GPipe (every micro-batch's activations held at once) against 1F1B (one at
  a time), the difference per byte held beyond one micro-batch's: ``elementwise["held"]``, what
  fresh memory costs a pipeline that holds many micro-batches.

Figures of the framework on this machine, like the blocks' overhead, not of a model planned:
the sizes are fixed here and re-planning another model reruns nothing. :func:`engine_step` (one
step of the one-rank step engine over a small GPT) is what :mod:`.shared` times in windows too.
"""
from __future__ import annotations

import time

import numpy as np

from hpcnn.nn.models import gpt
from hpcnn.parallel.collectives import Communicator
from hpcnn.engine.pipelined import train_step
from hpcnn.plan import hybrid
from hpcnn.plan.calibrate.blocks import OVERHEAD_SHAPES, blocks_pass, median_pass
from hpcnn.plan.calibrate.timing import FULL_ROUNDS

# The tokens ladder of the slowdown by tokens per call (Device.tokens): a GPT of one block of
# width 192, 6 heads, context 64 (apart from the experiments' width 128) through the step
# engine, micro-batches of 1 .. 8 sequences, 64 to 512 tokens; the transformer kind only.
TOKENS_LADDER = {"transformer": (192, 6, 64, (1, 2, 4, 8))}
# The rows ladder of the linear kind's slowdown by rows per call (Device.tokens["linear"]): a
# Linear and its ReLU, 512 -> 512, on 32 .. 256 rows (the wide efficiency reference's 256 the
# top rung).
LINEAR_ROWS = (512, 512, (32, 64, 128, 256))
# The stage pass figure: a GPT of one block of the transformer overhead's size (vocabulary 16)
# through the step engine, a one-rank 1F1B list of this many micro-batches of one sequence.
STAGE_MICRO = 8
# The held-activations figure (held_costs): a GPT of 2 blocks of width 128, 4 heads, context 64
# (vocabulary 16) on 16 sequences in 16 micro-batches through the step engine, GPipe (20 MB of
# activations held) against 1F1B (1.3 MB): (n_layers, width, heads, context, sequences).
HELD_SHAPE = (2, 128, 4, 64, 16)
ENGINE_VOCAB = 16               # the vocabulary of the step-engine GPTs the calibration runs


def engine_step(layers: int, dim: int, heads: int, seq: int, sequences: int, dtype: str):
    """``step(schedule, micro)`` -> the result of one step of the one-rank step engine
    (:func:`hpcnn.engine.pipelined.train_step`) over a GPT of ``layers`` blocks (vocabulary
    :data:`ENGINE_VOCAB`) on ``sequences`` random sequences of ``seq`` tokens in ``micro``
    micro-batches: what :func:`stage_costs`, :func:`tokens_costs` and :func:`held_costs` time."""
    chain = gpt(ENGINE_VOCAB, seq, layers, dim, heads, dtype=dtype)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, ENGINE_VOCAB, (sequences, seq)) for _ in range(2))
    comm = Communicator.single("calibrate")
    return lambda schedule, micro: train_step(schedule, chain, comm, x, y, micro)


def _pass_medians(events) -> tuple:
    """(median F, median B) seconds of a step engine run's timeline ``events``."""
    return tuple(float(np.median([t1 - t0 for _, kind, _, t0, t1 in events if kind == want]))
                 for want in ("F", "B"))


def tokens_costs(kind: str, dtype: str, fixed: float, repeats: int = FULL_ROUNDS) -> tuple:
    """The tokens pieces ((tokens, slowdown), ..., (inf, 1)) of ``kind``'s blocks in this
    process (:class:`hpcnn.plan.machine.Device` ``tokens``), given the fixed seconds of one
    micro-batch's forward + backward through a one-block stage, ``fixed`` (the block's
    overhead, :func:`~.blocks.block_costs`, plus the stage pass's, :func:`stage_costs`).

    The ladder runs through the step engine, as training runs a pipeline's passes: for each of
    the kind's :data:`TOKENS_LADDER` rungs, a one-rank 1F1B list of :data:`STAGE_MICRO`
    micro-batches of that many sequences through a GPT of one such block (vocabulary 16,
    :func:`hpcnn.engine.pipelined.train_step`); a rung's figure is its passes' median F + B
    beyond ``fixed`` per token, its slowdown that over the top rung's; the medians over
    ``repeats`` rounds. The same block timed bare slows more at few tokens than it does in
    training, hence the engine."""
    if kind != "transformer":
        raise ValueError(f"tokens_costs: kind {kind!r}: the ladder runs transformer blocks only")
    width, heads, seq, counts = TOKENS_LADDER[kind]
    rungs = [(n, engine_step(1, width, heads, seq, STAGE_MICRO * n, dtype)) for n in counts]
    for _, step in rungs:
        step("1f1b", STAGE_MICRO)                                           # warm-up

    def per_token() -> list:
        return [max(sum(_pass_medians(step("1f1b", STAGE_MICRO)["events"])) - fixed, 1e-9)
                / (n * seq) for n, step in rungs]
    return _ladder([n * seq for n in counts], per_token, repeats)


def _ladder(sizes, per_unit, repeats: int) -> tuple:
    """Slowdown pieces ((size, slowdown), ..., (inf, 1)) of a ladder of rungs of ``sizes``
    (increasing): ``per_unit()`` times one round, the seconds per unit of each rung; a rung's
    slowdown is its seconds per unit over the top rung's, the median over ``repeats`` rounds
    (:func:`tokens_costs`, :func:`rows_costs`)."""
    ratios = []
    for _ in range(repeats):
        per = per_unit()
        ratios.append([v / per[-1] for v in per])
    slowdown = np.median(np.array(ratios), axis=0)
    return tuple((size, float(f)) for size, f in zip(sizes, slowdown)) + ((np.inf, 1.0),)


def rows_costs(dtype: str, fixed: float, repeats: int = FULL_ROUNDS) -> tuple:
    """The linear kind's tokens pieces ((rows, slowdown), ..., (inf, 1)) in this process
    (:class:`hpcnn.plan.machine.Device` ``tokens``; a Linear's tokens are its rows), given the
    fixed seconds of one forward + backward of a Linear and its ReLU, ``fixed`` (the kind's
    overhead, :func:`~.blocks.block_costs`).

    Each of ``repeats`` rounds times, for each rung of :data:`LINEAR_ROWS`, a Linear and its
    ReLU on that many rows (the median forward + backward of five); a rung's figure is its
    seconds beyond ``fixed`` per row, its slowdown that over the top rung's; the medians over
    rounds. The efficiency is fitted on references of 256-2048 rows, and a matmul's rate falls
    with its rows whatever its weight's shape: without these factors, plans whose Linears are
    cut on their batch (few rows a rank) ran slower than their price."""
    width_in, width_out, counts = LINEAR_ROWS
    rungs = [(n, blocks_pass("linear", (width_in, width_out, (n, width_in)), dtype)[0])
             for n in counts]
    return _ladder([float(n) for n in counts],
                   lambda: [max(sum(median_pass(run, 5)) - fixed, 1e-9) / n for n, run in rungs],
                   repeats)


def stage_costs(dtype: str, repeats: int = FULL_ROUNDS) -> tuple | None:
    """(seconds per forward + backward of a pipeline stage pass beyond its transformer blocks,
    the forward's share of them) in this process, or None where they measure nothing.

    The step engine (:func:`hpcnn.engine.pipelined.train_step`, the executor every ``hpcnn
    train`` step runs) runs a one-rank 1F1B list of :data:`STAGE_MICRO` micro-batches of a tiny
    GPT (token and position embedding, one transformer block of the overhead's size
    :data:`~.blocks.OVERHEAD_SHAPES`, final LayerNorm, LM head, loss): each pass's F and B
    instruction as its timeline times it, less the tiny block's own forward and backward timed
    alone; the medians over ``repeats`` rounds. The GPT planned has none of these sizes."""
    dim, heads, (rows, seq, _) = OVERHEAD_SHAPES["transformer"]
    step = engine_step(1, dim, heads, seq, STAGE_MICRO * rows, dtype)
    block = blocks_pass("transformer", OVERHEAD_SHAPES["transformer"], dtype)[0]
    step("1f1b", STAGE_MICRO)                                               # warm-up
    fwd, bwd = [], []
    for _ in range(repeats):
        f, b = _pass_medians(step("1f1b", STAGE_MICRO)["events"])
        bf, bb = median_pass(block, 5)
        fwd.append(max(f - bf, 0.0))
        bwd.append(max(b - bb, 0.0))
    f, b = float(np.median(fwd)), float(np.median(bwd))
    return (f + b, f / (f + b)) if f > 0 and b > 0 else None


def held_costs(dtype: str, repeats: int = FULL_ROUNDS) -> float:
    """Seconds per byte of the activations a pipeline stage holds beyond one micro-batch's
    (:func:`hpcnn.plan.hybrid.held_seconds`), in this process: each of ``repeats`` rounds runs
    one step of a one-rank GPipe list and one of a 1F1B list of the step engine
    (:func:`hpcnn.engine.pipelined.train_step`) over the same :data:`HELD_SHAPE` GPT, one
    micro-batch a sequence, and takes the difference of their times over the difference of
    their held bytes as the price counts them (:func:`hpcnn.plan.hybrid._held_bytes`); the
    median over rounds, at least 0. Both lists run the same passes: what differs is that
    GPipe's forwards take fresh memory for every micro-batch's caches, and its backwards read
    them long after."""
    layers, dim, heads, seq, rows = HELD_SHAPE
    step = engine_step(layers, dim, heads, seq, rows, dtype)
    model = hybrid.Transformer(layers, dim, heads, seq, ENGINE_VOCAB, rows, dtype)
    held = {s: hybrid._held_bytes(model, hybrid.Layout(1, 1, 1, rows, s), 0, layers)
            for s in ("gpipe", "1f1b")}
    for schedule in held:                                                # warm-up
        step(schedule, rows)
    per_byte = []
    for _ in range(repeats):
        t = {}
        for schedule in held:
            t0 = time.perf_counter()
            step(schedule, rows)
            t[schedule] = time.perf_counter() - t0
        per_byte.append((t["gpipe"] - t["1f1b"]) / (held["gpipe"] - held["1f1b"]))
    return max(0.0, float(np.median(per_byte)))
