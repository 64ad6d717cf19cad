"""Cutting a chain into pipeline stages: uniform, by cost (exact), by params, explicit layouts."""
import itertools

import numpy as np
import pytest

from hpcnn.nn import models
from hpcnn.schedule import stages as partition


def test_uniform():
    assert partition.uniform(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert partition.uniform(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert partition.uniform(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="cannot cut 3 blocks into 4 non-empty stages"):
        partition.uniform(3, 4)
    with pytest.raises(ValueError, match="n_stages must be a positive integer, got 0"):
        partition.uniform(3, 0)


def _brute(costs, S):
    n = len(costs)
    return min(max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (n,)))
               for cuts in itertools.combinations(range(1, n), S - 1))


def test_by_cost_examples():
    assert partition.by_cost([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert partition.by_cost([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition.by_cost([0, 0, 0], 3) == [(0, 1), (1, 2), (2, 3)]       # never an empty stage
    assert partition.by_cost([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [(0, 5), (5, 7), (7, 9)]  # 15|13|17
    with pytest.raises(ValueError, match=r"block costs must be >= 0, got \[1, -1\]"):
        partition.by_cost([1, -1], 2)


@pytest.mark.parametrize("seed", range(20))
def test_by_cost_is_exact(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    S = int(rng.integers(1, n + 1))
    costs = [int(c) for c in rng.integers(0, 20, size=n)]
    ranges = partition.by_cost(costs, S)
    partition.check_ranges(ranges, n)
    assert len(ranges) == S
    assert max(partition.stage_costs(costs, ranges)) == _brute(costs, S)


def _stage_figures(ranges, costs, memory, fixed_cost, fixed_memory):
    """(largest stage cost, each stage's memory) of a cut, as by_cost_bounded defines them."""
    cost = max(fixed_cost[k] + sum(costs[a:b]) for k, (a, b) in enumerate(ranges))
    return cost, [fixed_memory[k] + sum(memory[k][a:b]) for k, (a, b) in enumerate(ranges)]


@pytest.mark.parametrize("seed", range(40))
def test_by_cost_bounded_is_exact_and_respects_the_bound(seed):
    """Against every cut: the optimum among the cuts whose stages all fit, None when none fits."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    S = int(rng.integers(1, n + 1))
    costs = [int(c) for c in rng.integers(0, 20, size=n)]
    memory = [[int(m) for m in rng.integers(0, 10, size=n)] for _ in range(S)]
    fixed_cost = [int(c) for c in rng.integers(0, 15, size=S)]
    fixed_memory = [int(m) for m in rng.integers(0, 10, size=S)]
    bound = int(rng.integers(5, 40))
    fits = []
    for cuts in itertools.combinations(range(1, n), S - 1):
        ranges = list(zip((0,) + cuts, cuts + (n,)))
        cost, mem = _stage_figures(ranges, costs, memory, fixed_cost, fixed_memory)
        if max(mem) <= bound:
            fits.append(cost)
    got = partition.by_cost_bounded(costs, memory, S, bound, fixed_cost, fixed_memory)
    if not fits:
        assert got is None
        return
    partition.check_ranges(got, n)
    cost, mem = _stage_figures(got, costs, memory, fixed_cost, fixed_memory)
    assert max(mem) <= bound and cost == min(fits)


def test_by_cost_bounded_examples():
    # unbounded it is by_cost (same tie rule: the later cut); one memory list serves every stage
    assert partition.by_cost_bounded([1, 1, 1, 1], [0] * 4, 2, 0) == [(0, 2), (2, 4)]
    assert partition.by_cost_bounded([1, 1, 1, 1], [0] * 4, 2, 0, [0, 2]) == [(0, 3), (3, 4)]
    # the balanced cut 15|13|17 needs 5 memory units on its first stage: bound 4 gives 10|15|17
    costs = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert partition.by_cost_bounded(costs, [1] * 9, 3, 5) == [(0, 5), (5, 7), (7, 9)]
    assert partition.by_cost_bounded(costs, [1] * 9, 3, 4) == [(0, 4), (4, 7), (7, 9)]
    assert partition.by_cost_bounded(costs, [1] * 9, 3, 2) is None     # 9 blocks, 3 stages of 2
    with pytest.raises(ValueError, match="fixed_memory: expected 3 stages"):
        partition.by_cost_bounded(costs, [1] * 9, 3, 5, fixed_memory=[0, 0])


def test_parse_layout():
    assert partition.parse_layout("4|4|3|5", 16) == [(0, 4), (4, 8), (8, 11), (11, 16)]
    assert partition.parse_layout("7", 7) == [(0, 7)]
    with pytest.raises(ValueError, match=r"'4\|4\|3\|5'.*sum to 16 blocks, the chain has 15"):
        partition.parse_layout("4|4|3|5", 15)
    with pytest.raises(ValueError, match=r"'4\|0\|3': stage 1 has 0 blocks"):
        partition.parse_layout("4|0|3", 7)
    with pytest.raises(ValueError, match="expected integers separated by"):
        partition.parse_layout("4||3", 7)


def test_check_ranges():
    partition.check_ranges([(0, 2), (2, 5)], 5)
    with pytest.raises(ValueError, match=r"stage 1 is \(3, 5\)"):
        partition.check_ranges([(0, 2), (3, 5)], 5)
    with pytest.raises(ValueError, match="cover 4 blocks, the chain has 5"):
        partition.check_ranges([(0, 2), (2, 4)], 5)


def test_by_params_and_stage_chains():
    model = models.mlp(16, hidden=(64, 64, 64), n_out=10)      # fc0 relu fc1 relu fc2 relu fc3
    sizes = [sum(p.size for p in b.params) for b in model.blocks]
    ranges = partition.by_params(model, 2)
    assert max(partition.stage_costs(sizes, ranges)) == _brute(sizes, 2)
    stages = partition.stage_chains(model, ranges)
    assert [len(c) for c in stages] == [b - a for a, b in ranges]
    assert [c.loss for c in stages[:-1]] == [None] and stages[-1].loss is model.loss
    assert sum(c.num_params() for c in stages) == model.num_params()
    assert stages[0].blocks[0] is model.blocks[0]               # shared, not copied
    with pytest.raises(ValueError, match="cover 6 blocks, the chain has 7"):
        partition.stage_chains(model, [(0, 3), (3, 6)])


def test_by_spec_balances_flops():
    model = models.mlp(16, hidden=(64, 64, 64), n_out=10)
    specs = model.spec((8, 16), include_loss=False)
    flops = [s.flops_fwd + s.flops_bwd for s in specs]
    ranges = partition.by_spec(model, (8, 16), 3)
    assert max(partition.stage_costs(flops, ranges)) == pytest.approx(_brute(flops, 3))
