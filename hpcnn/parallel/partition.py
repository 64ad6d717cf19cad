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
    last stage is kept as small as possible (ties go to the later cut).
    """
    costs = list(costs)
    n = len(costs)
    _check_counts(n, n_stages)
    if any(c < 0 for c in costs):
        raise ValueError(f"block costs must be >= 0, got {costs}")
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):       # leave >= 1 block per later stage
            for i in range(k - 1, j):                    # stage k holds blocks [i, j)
                v = max(best[k - 1][i], pre[j] - pre[i])
                if v <= best[k][j]:
                    best[k][j], cut[k][j] = v, i
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
