"""Cutting a chain of L blocks into S pipeline stages: contiguous (start, stop) block ranges.

Every function returns ``[(start_0, stop_0), ..., (start_{S-1}, stop_{S-1})]`` with
``start_0 = 0``, ``stop_i = start_{i+1}``, ``stop_{S-1} = L`` and at least one block per stage:
uneven stages are kept as they are, an empty stage is an error, never silently merged.

    >>> from hpcnn.nn import models
    >>> from hpcnn.parallel import partition
    >>> model = models.mlp(16, hidden=(64, 64, 64), n_out=10)           # 7 blocks
    >>> partition.uniform(len(model), 3)
    [(0, 3), (3, 5), (5, 7)]
    >>> partition.parse_layout("2|2|3", len(model))
    [(0, 2), (2, 4), (4, 7)]
    >>> stages = partition.stage_chains(model, partition.by_params(model, 2))
"""
from __future__ import annotations


def _check_counts(n_blocks, n_stages):
    for name, v in (("n_blocks", n_blocks), ("n_stages", n_stages)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if n_stages > n_blocks:
        raise ValueError(f"cannot cut {n_blocks} blocks into {n_stages} non-empty stages")


def from_sizes(sizes, n_blocks):
    """Stage sizes (blocks per stage) -> ranges; raises ValueError on an empty stage or a sum
    other than ``n_blocks``."""
    sizes = [int(n) for n in sizes]
    for i, n in enumerate(sizes):
        if n < 1:
            raise ValueError(f"stage {i} has {n} blocks (sizes {sizes}): every stage needs >= 1")
    if sum(sizes) != n_blocks:
        raise ValueError(f"stage sizes {sizes} sum to {sum(sizes)} blocks, the chain has "
                         f"{n_blocks}")
    ranges, start = [], 0
    for n in sizes:
        ranges.append((start, start + n))
        start += n
    return ranges


def check_ranges(ranges, n_blocks):
    """Raise ValueError unless ``ranges`` are contiguous, non-empty and cover [0, n_blocks)."""
    start = 0
    for i, (a, b) in enumerate(ranges):
        if a != start or b <= a:
            raise ValueError(f"stage {i} is ({a}, {b}): expected a non-empty range starting at "
                             f"{start} (ranges {list(ranges)})")
        start = b
    if start != n_blocks:
        raise ValueError(f"ranges {list(ranges)} cover {start} blocks, the chain has {n_blocks}")


def uniform(n_blocks, n_stages):
    """Equal block counts; the first ``n_blocks % n_stages`` stages take one block more."""
    _check_counts(n_blocks, n_stages)
    q, r = divmod(n_blocks, n_stages)
    return from_sizes([q + (i < r) for i in range(n_stages)], n_blocks)


def by_cost(costs, n_stages):
    """Contiguous ranges minimising the largest stage cost (the pipeline's slowest stage).

    Exact dynamic programme over cut points, O(S L^2): ``best[k][j]`` is the smallest achievable
    maximum over the first j blocks in k stages. Costs must be >= 0; among optimal partitions the
    last stage is kept as small as possible (ties go to the later cut). :func:`by_cost_bounded`
    without a memory bound.
    """
    costs = list(costs)
    return by_cost_bounded(costs, [0] * len(costs), n_stages, float("inf"))


def _prefix(values) -> list:
    """[0, v0, v0 + v1, ...]: the running sums, added left to right."""
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _bounded_inputs(costs, memory, n_stages, fixed_cost, fixed_memory) -> tuple:
    """:func:`by_cost_bounded`'s arguments checked and as lists: (costs, memory per stage,
    fixed costs, fixed memory)."""
    costs = list(costs)
    n = len(costs)
    _check_counts(n, n_stages)
    if any(c < 0 for c in costs):
        raise ValueError(f"block costs must be >= 0, got {costs}")
    per_stage = [list(memory)] * n_stages if not memory or not hasattr(memory[0], "__len__") \
        else [list(m) for m in memory]
    fixed_cost = [0.0] * n_stages if fixed_cost is None else list(fixed_cost)
    fixed_memory = [0.0] * n_stages if fixed_memory is None else list(fixed_memory)
    for name, v in (("memory", per_stage), ("fixed_cost", fixed_cost),
                    ("fixed_memory", fixed_memory)):
        if len(v) != n_stages or (name == "memory" and any(len(m) != n for m in v)):
            raise ValueError(f"{name}: expected {n_stages} stages of {n} blocks "
                             f"(or one list of {n} block figures for memory), got {v}")
    if any(x < 0 for m in per_stage for x in m):
        raise ValueError(f"block memory must be >= 0, got {memory}")
    return costs, per_stage, fixed_cost, fixed_memory


def by_cost_bounded(costs, memory, n_stages, bound, fixed_cost=None, fixed_memory=None):
    """Contiguous ranges minimising the largest stage cost subject to every stage's memory
    ``<= bound``; None when no cut fits.

    Stage k holding blocks [i, j) costs ``fixed_cost[k] + sum(costs[i:j])`` and needs
    ``fixed_memory[k] + sum(memory_k[i:j])``, where ``memory_k`` is ``memory`` when that is one
    list of per-block figures, or ``memory[k]`` when it is one list per stage (a block's memory
    can depend on the stage holding it: a pipeline stage holds its caches for as many
    micro-batches as its schedule keeps in flight). The fixed terms (default 0) are what a stage
    carries whatever its blocks: the first stage's embedding, the last stage's LM head.

    An exact dynamic programme over cut points, O(S L^2) at worst: ``best[k][j]`` is the
    smallest achievable maximum over the first j blocks in k stages whose stages all fit; a
    stage that does not fit is never a candidate, so the optimum is the optimum among the cuts
    that fit (the bound is a per-stage constraint, the objective a maximum of per-stage terms).
    Stage k's start is tried from the latest back, stopping once the stage alone costs more than
    the best found or no longer fits (costs and memory are >= 0, so both only grow). The tie
    rule of :func:`by_cost`: among optimal cuts the last stage is kept as small as possible
    (the later cut).
    """
    costs, per_stage, fixed_cost, fixed_memory = _bounded_inputs(
        costs, memory, n_stages, fixed_cost, fixed_memory)
    n = len(costs)
    pre, mem = _prefix(costs), [_prefix(m) for m in per_stage]
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        m, fc, fm = mem[k - 1], fixed_cost[k - 1], fixed_memory[k - 1]
        prev, row, cut_row = best[k - 1], best[k], cut[k]    # locals: the planner's hot loop
        for j in range(k, n - (n_stages - k) + 1):       # leave >= 1 block per later stage
            top, used, here, at = fc + pre[j], fm + m[j], inf, 0
            for i in range(j - 1, k - 2, -1):            # stage k holds blocks [i, j)
                stage = top - pre[i]
                if stage > here or used - m[i] > bound:
                    break                                # only grows as the stage does
                v = prev[i] if prev[i] > stage else stage
                if v < here:                             # the first, latest cut of equals
                    here, at = v, i
            row[j], cut_row[j] = here, at
    if best[n_stages][n] == inf:
        return None
    stops, j = [], n
    for k in range(n_stages, 0, -1):
        stops.append(j)
        j = cut[k][j]
    stops.reverse()
    return [(a, b) for a, b in zip([0] + stops[:-1], stops)]


def stage_costs(costs, ranges):
    """Sum of ``costs`` over each range."""
    return [sum(costs[a:b]) for a, b in ranges]


def by_params(chain, n_stages):
    """Balance the parameter count per stage (:func:`by_cost` with each block's size)."""
    return by_cost([sum(p.size for p in b.params) for b in chain.blocks], n_stages)


def by_spec(chain, x_shape, n_stages):
    """Balance forward + backward FLOPs per stage, from the blocks' ``spec(x_shape)``."""
    specs = chain.spec(x_shape, include_loss=False)
    return by_cost([s.flops_fwd + s.flops_bwd for s in specs], n_stages)


def parse_layout(layout, n_blocks):
    """Explicit stage sizes as ``"4|4|3|5"`` -> ranges; ValueError names the layout and the
    numbers when a size is not an integer, a stage is empty or the sizes do not sum to n_blocks."""
    parts = str(layout).split("|")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"layout {layout!r}: expected integers separated by '|', "
                         f"e.g. '4|4|3|5'") from None
    try:
        return from_sizes(sizes, n_blocks)
    except ValueError as e:
        raise ValueError(f"layout {layout!r}: {e}") from None


def stage_chains(chain, ranges):
    """One sub-chain per range (``chain[start:stop]``, sharing blocks and parameters; the loss
    goes to the last stage)."""
    check_ranges(ranges, len(chain))
    return [chain[a:b] for a, b in ranges]
