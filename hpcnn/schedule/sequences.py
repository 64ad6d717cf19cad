"""Operation sequences for one forward + backward of a chain, in rotor's notation, as plain data.

    F_ck(i)    forward of stage i, keep its input x[i] (a checkpoint), produce x[i+1]
    F_n(i)     forward of stage i, keep nothing: x[i] is dropped unless it is part of an x̄[i]
    F_all(i)   forward of stage i keeping x̄[i+1] (x[i+1] and everything B(i) needs)
    B(i)       backward of stage i: needs x̄[i+1], δ[i+1] and x[i]; produces δ[i]; frees x̄[i+1],
               δ[i+1] and x[i] (unless x[i] is part of an x̄[i])
    OFF(x|x̄, i) / PRE(x|x̄, i)   move a stored value to the offload channel and back

Each is an :class:`~hpcnn.schedule.ops.Op` with ``block = i`` (``Op("F_ck", block=i)``; OFF/PRE
with ``item`` "x" or "bar"); :func:`hpcnn.schedule.ops.fmt` prints a sequence on one line.

Builders here: :func:`store_all`, :func:`segments` (uniform checkpointing, PyTorch's
``checkpoint_sequential``), :func:`revolve` (the binomial schedule of Griewank & Walther for
homogeneous chains, with a given number of checkpoints). The optimal one is :mod:`.rotor`'s.
"""
from __future__ import annotations

import math
from functools import lru_cache

from hpcnn.schedule.ops import Op

def forward_run(s: int, j: int) -> list[Op]:
    """Forwards of stages s .. j-1 keeping only x[s] (a checkpoint) and the result x[j]."""
    return [Op("F_ck", block=s)] + [Op("F_n", block=k) for k in range(s + 1, j)]


def store_all(n: int) -> list[Op]:
    """Forward keeping everything, then the backward: the fastest sequence and the largest."""
    return [Op("F_all", block=i) for i in range(n)] + \
        [Op("B", block=i) for i in range(n - 1, -1, -1)]


def segment_bounds(n_blocks: int, n_segments: int) -> list[int]:
    """Start indices of ``n_segments`` near-equal segments of ``n_blocks`` (PyTorch's split)."""
    if not 1 <= n_segments <= n_blocks:
        raise ValueError(f"segments must be in [1, {n_blocks}], got {n_segments}")
    size = math.ceil(n_blocks / n_segments)
    return list(range(0, n_blocks, size))


def segments(n: int, n_segments: int | None = None, *, has_loss: bool = True) -> list[Op]:
    """Uniform checkpointing: keep each segment's input; with the loss, run the last segment
    normally.

    The blocks (the loss, when ``has_loss``, joins the last segment) are cut into
    ``n_segments`` (default ⌈√blocks⌉) segments. Forward: each segment but the last from its input
    without keeping anything; with the loss the last keeping everything, its backward next.
    Backward: the last segment, then each earlier one recomputed from its checkpoint with F_all
    and backpropagated. Without the loss (a pipeline stage that sends its output on and waits
    for its gradient) the last segment too keeps only its input and its output, and is
    recomputed first in the backward (its F_all turns the stored output into x̄): between a
    micro-batch's forward and backward the stage holds checkpoints, no cache (Megatron's full
    recomputation).
    """
    blocks = n - 1 if has_loss and n > 1 else n
    k = n_segments or max(1, math.isqrt(blocks - 1) + 1 if blocks > 1 else 1)
    k = min(k, blocks)
    starts = segment_bounds(blocks, k)
    ends = starts[1:] + [n]
    stored = len(starts) - 1 if has_loss else len(starts)      # segments run from checkpoints
    seq = []
    for a, b in zip(starts[:stored], ends[:stored]):
        seq += forward_run(a, b)
    if has_loss:
        seq += [Op("F_all", block=i) for i in range(starts[-1], n)]
        seq += [Op("B", block=i) for i in range(n - 1, starts[-1] - 1, -1)]
    for a, b in reversed(list(zip(starts[:stored], ends[:stored]))):
        seq += [Op("F_all", block=i) for i in range(a, b)]
        seq += [Op("B", block=i) for i in range(b - 1, a - 1, -1)]
    return seq


@lru_cache(maxsize=None)
def _binomial(steps: int, c: int) -> tuple[float, int]:
    """(least recomputed forwards, first split) to reverse ``steps`` unit stages from a stored input
    with room for ``c`` more stored inputs at a time (Griewank's recursion)."""
    if steps == 1:
        return 0.0, 0
    if c == 0:
        return math.inf, 0
    best, arg = math.inf, 0
    for i in range(1, steps):
        t = i + _binomial(steps - i, c - 1)[0] + _binomial(i, c)[0]
        if t < best:
            best, arg = t, i
    return best, arg


def revolve(n: int, checkpoints: int) -> list[Op]:
    """Griewank & Walther's binomial schedule for ``n`` stages with ``checkpoints`` stored values
    besides the input (optimal when all stages cost the same); ValueError if ``checkpoints < 1``
    for n > 1."""
    if n > 1 and checkpoints < 1:
        raise ValueError(f"revolve needs at least 1 checkpoint for {n} stages, got {checkpoints}")

    def rev(s, t, c):
        if s == t:
            return [Op("F_all", block=s), Op("B", block=s)]
        i = _binomial(t - s + 1, c)[1]
        j = s + i
        return forward_run(s, j) + rev(j, t, c - 1) + rev(s, j - 1, c)
    return rev(0, n - 1, min(checkpoints, n - 1))


def recomputations(seq) -> int:
    """Forwards beyond the first of each stage."""
    return sum(op.kind in ("F_ck", "F_n", "F_all") for op in seq) - \
        len({op.block for op in seq if op.kind in ("F_ck", "F_n", "F_all")})
