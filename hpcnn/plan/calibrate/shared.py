"""What a rank gets while every rank computes: the all-at-once device of a machine file.

The device figures are timed on rank 0 alone (:mod:`.device`); then :func:`sustained_medians`
times the sustained matmul and copy rates over a wall-clock window (:func:`sustained_rates`),
alone and on all ranks at once, alternated over rounds, medians. The machine file records what a
rank gets while all compute (:func:`shared_figures`): the figures alone slowed by the ratio of
the sustained rates, ~1 with a core per rank, ~2 with two ranks per core; when the ranks share
cores, each block kind's by the ratio of its own reference blocks run over a window alone and
all at once, and the tokens ladder damped by its bottom and top rungs' ratios
(:func:`_shared_tokens`); with a core per rank, the transformer's element-wise seconds by that
of a one-block GPT's steps through the step engine.

A window's mean counts the scheduler's slices of a shared core, which the median of single
calls misses: timed all at once directly, the block figures would be medians of calls that run
uninterrupted or not by the luck of the scheduler. :func:`cores_here` is what the calibration
compares the ranks on a node with.
"""
from __future__ import annotations

import os

import numpy as np

from hpcnn.plan.calibrate.blocks import EFFICIENCY_SHAPES, blocks_pass
from hpcnn.plan.calibrate.passes import STAGE_MICRO, TOKENS_LADDER, engine_step
from hpcnn.plan.calibrate.timing import (COPY_BYTES, DTYPES, MATMUL_N, counted, quiet_barrier,
                                         window_seconds)

SUSTAIN_S = 0.5                 # wall-clock window of a sustained rate (many scheduler slices)
SUSTAIN_ROUNDS = 5              # windows alone and all at once, alternated (sustained_medians)


def sustained_rates(seconds: float = SUSTAIN_S, blocks: bool = False,
                    engine: bool = False) -> dict:
    """{"float32", "float64": matmul FLOP/s, "copy": bytes/s}, with ``blocks`` "block.KIND":
    forward + backward passes per second of the kind's wide and narrow reference blocks
    (:data:`~.blocks.EFFICIENCY_SHAPES`), with ``engine`` or ``blocks`` "engine.KIND": steps
    per second of the kind's top :data:`~.passes.TOKENS_LADDER` rung through the one-rank step
    engine (a one-block GPT, 1F1B over :data:`~.passes.STAGE_MICRO` micro-batches), with
    ``blocks`` also "engine_low.KIND", its bottom rung's (:func:`_shared_tokens`), as the work
    done over a wall-clock window of ``seconds`` each: when ranks outnumber cores the scheduler
    shares a core in slices of milliseconds, which the median of single calls misses and a
    window's mean counts."""
    out = {}
    rng = np.random.default_rng(0)
    for dt in DTYPES:
        a, b = (rng.standard_normal((MATMUL_N, MATMUL_N)).astype(dt) for _ in range(2))
        c = np.empty_like(a)
        out[dt] = 2.0 * MATMUL_N ** 3 / window_seconds(lambda: np.matmul(a, b, out=c), seconds)
    src = np.ones(COPY_BYTES // 8)
    dst = np.empty_like(src)
    out["copy"] = 2.0 * src.nbytes / window_seconds(lambda: np.copyto(dst, src), seconds)
    for kind, shapes in EFFICIENCY_SHAPES.items() if blocks else ():   # wide and narrow refs
        runs = [blocks_pass(kind, shape, "float32")[0] for shape in shapes[:2]]
        out[f"block.{kind}"] = 1.0 / window_seconds(lambda: [run() for run in runs], seconds)
    for kind, (width, heads, seq, counts) in TOKENS_LADDER.items() if engine or blocks else ():
        rungs = (("engine", counts[-1]),) + ((("engine_low", counts[0]),) if blocks else ())
        for name, sequences in rungs:                           # the top rung, the bottom's
            step = engine_step(1, width, heads, seq, STAGE_MICRO * sequences, "float32")
            out[f"{name}.{kind}"] = 1.0 / window_seconds(lambda: step("1f1b", STAGE_MICRO),
                                                         seconds)
    return out


def sustained_medians(comm, window: float, blocks: bool, rounds: int,
                      engine: bool = False) -> tuple:
    """(alone, together) sustained rates (:func:`sustained_rates` over ``window`` seconds, with
    the reference blocks when ``blocks``, the step engine's GPT when ``engine``): rank 0's by
    itself and the slowest rank's while every rank runs at once, alternated ``rounds`` times,
    each figure the median over its rounds, the same on every rank (:func:`shared_figures`
    takes their ratios). Alternated rounds and medians, as the benchmarks measure, so that a
    burst of load on one window does not set the calibration's level."""
    comm = counted(comm)
    alone, together = [], []
    for _ in range(rounds):
        if comm.rank == 0:
            alone.append(sustained_rates(window, blocks, engine))
        quiet_barrier(comm)                                # the others sleep meanwhile
        mine = sustained_rates(window, blocks, engine)     # every rank at once
        least = comm.allreduce_scalars(list(mine.values()), "min")
        together.append({k: float(v) for k, v in zip(mine, least)})
    alone = comm.bcast_object(alone, root=0)
    return tuple({k: float(np.median([r[k] for r in runs])) for k in runs[0]}
                 for runs in (alone, together))


def shared_figures(alone: dict, alone_sustained: dict, together_sustained: dict) -> dict:
    """The device figures of a rank while every rank computes, from rank 0's figures alone and the
    sustained rates alone and all at once (:func:`sustained_rates`, slowest rank).

    Each sustained figure's ratio alone / all at once is the factor by which that work slows
    when all ranks compute: about 1 with a core per rank, ~2 with two ranks per core. Matmul
    rates (per dtype) and the copy bandwidth divide by their own factor.

    With a core per rank the ranks share only the memory: a block kind's fixed seconds slow
    as the float32 matmul, its element-wise and ReLU-output seconds as the copy (memory
    traffic), except where :func:`~hpcnn.plan.calibrate.measure` passes the step engine's GPT
    (``engine.KIND``, a core per rank): that kind's element-wise and ReLU-output seconds slow as
    its steps (the 64 MiB copy streams from memory, which the host shares, and can slow far
    more than the blocks do).
    When ranks share cores (:func:`~hpcnn.plan.calibrate.measure` passes the reference blocks'
    sustained rates, ``block.KIND``, only then), a kind's fixed, element-wise and ReLU-output
    seconds multiply by the factor of the kind's own reference blocks and its efficiency by the
    matmul's factor over the kind's, capped at 1, so that a block priced alone at t is priced t
    times its kind's factor (the copy of :data:`~.timing.COPY_BYTES` streams from memory while
    its rank's core is time-shared, and slows unlike the blocks). The optimizer's seconds per
    parameter multiply by the float32 factor (CPU time, shared as the matmul's is); forward
    shares, backward splits and tokens factors are ratios of times slowed alike and stay.
    A factor below 1 (all at once faster than alone: the two windows' noise) counts as 1."""
    slow = {k: max(1.0, alone_sustained[k] / together_sustained[k]) for k in together_sustained}
    out = {}
    for key, value in alone.items():
        table, kind = key.split(".", 1) if "." in key else ("", "")
        own = slow.get(f"block.{kind}")
        if table == "overhead":
            out[key] = value * (own or slow["float32"])
        elif table in ("elementwise", "activation"):
            out[key] = value * (own or slow.get(f"engine.{kind}") or slow["copy"])
        elif table == "efficiency":
            out[key] = min(1.0, value * slow["float32"] / own) if own else value
        elif table == "update":
            out[key] = tuple((top, per * slow["float32"]) for top, per in value)
        elif table == "tokens" and f"engine_low.{kind}" in slow:
            out[key] = _shared_tokens(value, slow[f"engine_low.{kind}"] / slow[f"engine.{kind}"])
        elif table in ("forward", "split", "tokens"):
            out[key] = value
        else:                                   # a dtype's matmul rate or "copy"
            out[key] = value / slow[key]
    out["slowdown"] = slow["float32"]
    out.update({f"slowdown.{k[6:]}": v for k, v in slow.items() if k.startswith("block.")})
    out.update({k: v for k, v in slow.items() if k.startswith(("engine.", "engine_low."))})
    return out


def _shared_tokens(pieces, ratio: float) -> tuple:
    """A tokens ladder's pieces ((tokens, slowdown), ..., (inf, 1)) while all ranks compute,
    given ``ratio``: its bottom rung's sharing factor (alone / all at once) over its top
    rung's. The bottom rung's slowdown multiplies by ``ratio``, the top's by 1, those between
    by ``ratio`` to the power of their place between them in log(tokens) (a choice: two rungs
    are timed all at once), none below 1 where alone it was not. Small calls share a core
    better (their per-call Python and the others' matmuls interleave), so the ladder flattens."""
    finite = [t for t, _ in pieces if np.isfinite(t)]
    lo, hi = np.log(finite[0]), np.log(finite[-1])

    def factor(tokens):                       # one rung: it is both bottom and top, ratio^0
        if not np.isfinite(tokens) or hi == lo:
            return 1.0
        return ratio ** min(1.0, max(0.0, (hi - np.log(tokens)) / (hi - lo)))
    return tuple((t, float(max(min(s, 1.0), s * factor(t)))) for t, s in pieces)


def cores_here() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                  # macOS, Windows
        return os.cpu_count() or 1
