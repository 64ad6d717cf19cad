"""Three searches for the operator cuts of a graph over p = 2**L devices, all minimising the same
SAPP total (:func:`hpcnn.plan.cost.sapp_cost`) so that they compare:

- :func:`dra`: H. Wang's double recursive algorithm (MindSpore's SAPP planner), greedy, linear in
  the operators: O(L * (n log n + |E|));
- :func:`chain_dp`: a dynamic program over a chain, optimal: the state is an operator's whole cut
  sequence (4**L of them), the transition from one operator to the next is minimised one
  bisection at a time, O(n * L * 4**(L+1));
- :func:`exhaustive`: every combination of cut sequences, the reference for small cases.

Each returns ``(cuts, cost)``: a list of :class:`~hpcnn.schedule.placement.Cut` (the layout the executor runs, one
per Matmul in graph order) and the SAPP total. The ``*_sequences`` variants return the cut
sequences themselves (strings over ``"ijkr"``, bisection 0 first), which the cost needs: two
sequences with the same product of cuts may cost differently.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from hpcnn.plan.cost import (CONSUMER_SPLIT, CUTS, MU, PRODUCER_SPLIT, RHO, Graph, check_graph,
                             log2_devices, sapp_cost, strategy_cost, to_cut)

# MOVES[a][b] = 1 when a producer cutting ``a`` and a consumer cutting ``b`` at one bisection
# must redistribute the shared tensor (the rule of hpcnn.plan.cost.redistribution_cost).
MOVES = np.array([[float(PRODUCER_SPLIT[a] is not None and PRODUCER_SPLIT[a] != CONSUMER_SPLIT[b])
                   for b in CUTS] for a in CUTS])


def _plan(graph: Graph, p: int, sequences, mu: float, rho: float):
    return [to_cut(s, p) for s in sequences], sapp_cost(graph, sequences, mu, rho)


def _cut_cost_table(ext: np.ndarray, mu: float) -> np.ndarray:
    """(n, 4) intra costs in CUTS order for local extents ext[:, (i, k, j)]; inf where illegal."""
    i, k, j = (ext[:, 0].astype(float), ext[:, 1].astype(float), ext[:, 2].astype(float))
    return np.stack([np.where(ext[:, 0] % 2 == 0, mu * j * k / 2, np.inf),
                     np.where(ext[:, 2] % 2 == 0, i * k / 2, np.inf),
                     np.where(ext[:, 1] % 2 == 0, i * j / 2, np.inf),
                     i * j * k / 2], axis=1)


def _adjacency(n: int, pairs):
    """CSR lists (start, index) of each operator's neighbours in ``pairs`` (x, y): y's of every x.

    Flat lists of ints keep the search free of per-operator Python lists, which the garbage
    collector would walk again and again on large graphs.
    """
    counts = [0] * (n + 1)
    for x, _ in pairs:
        counts[x + 1] += 1
    start = list(itertools.accumulate(counts))
    index, fill = [0] * len(pairs), start[:-1]
    for x, y in pairs:
        index[fill[x]] = y
        fill[x] += 1
    return start, index


def dra_sequences(graph: Graph, p: int, mu: float = MU, rho: float = RHO) -> list:
    """The double recursive algorithm's cut sequence per operator.

    At each of the L bisections, operators are visited by decreasing weight, the largest of
    their legal i/j/k cut costs at the current local extents (replicate's cost when none is
    legal; the thesis says "largest candidate cost", we leave replicate out because it is the
    largest whenever a cut exists and would only repeat the compute volume); each takes the
    choice of least intra cost + redistribution with the neighbours already decided at this
    bisection (ties: the order of CUTS). A visit costs O(its degree).
    """
    L = log2_devices(p)
    check_graph(graph)
    n = len(graph.ops)
    p_start, p_index = _adjacency(n, [(b, a) for a, b in graph.edges])      # producers of b
    c_start, c_index = _adjacency(n, list(graph.edges))                    # consumers of a
    from_producer = [tuple(row) for row in MOVES.tolist()]       # [producer cut][consumer cut]
    to_consumer = [tuple(col) for col in MOVES.T.tolist()]       # [consumer cut][producer cut]
    ext = np.array([[op.i, op.k, op.j] for op in graph.ops], dtype=np.int64).reshape(n, 3)
    picked = np.zeros((L, n), dtype=np.int64)
    for t in range(L):
        costs = _cut_cost_table(ext, mu)
        cut_part = costs[:, :3]
        weight = np.where(np.isfinite(cut_part), cut_part, -np.inf).max(axis=1)
        weight = np.where(np.isfinite(weight), weight, costs[:, 3])
        order = np.argsort(-weight, kind="stable").tolist()
        flat = costs.ravel().tolist()
        inputs = (rho * ext[:, 0] * ext[:, 1]).tolist()    # rho * local input i*k per operator
        choice = [-1] * n
        for b in order:
            c0, c1, c2, c3 = flat[4 * b], flat[4 * b + 1], flat[4 * b + 2], flat[4 * b + 3]
            for e in range(p_start[b], p_start[b + 1]):
                ca = choice[p_index[e]]
                if ca >= 0:
                    w = inputs[b]
                    m0, m1, m2, m3 = from_producer[ca]
                    c0, c1, c2, c3 = c0 + w * m0, c1 + w * m1, c2 + w * m2, c3 + w * m3
            for e in range(c_start[b], c_start[b + 1]):
                d = c_index[e]
                if choice[d] >= 0:
                    w = inputs[d]
                    m0, m1, m2, m3 = to_consumer[choice[d]]
                    c0, c1, c2, c3 = c0 + w * m0, c1 + w * m1, c2 + w * m2, c3 + w * m3
            best, low = 0, c0
            if c1 < low:
                best, low = 1, c1
            if c2 < low:
                best, low = 2, c2
            if c3 < low:
                best = 3
            choice[b] = best
        picked[t] = choice
        ext[:, 0] >>= picked[t] == 0
        ext[:, 2] >>= picked[t] == 1
        ext[:, 1] >>= picked[t] == 2
    letters = np.array(list(CUTS))[picked.T]                            # (n, L)
    return ["".join(row) for row in letters.tolist()]


def dra(graph: Graph, p: int, mu: float = MU, rho: float = RHO):
    """(list of Cut, SAPP cost) of the double recursive algorithm."""
    return _plan(graph, p, dra_sequences(graph, p, mu, rho), mu, rho)


def _sequence_tables(op, L: int, mu: float):
    """All 4**L cut sequences of one operator: their intra costs (flat, bisection 0 the most
    significant base-4 digit) and, per bisection t, the local input i*k of each prefix (4**t)."""
    i = np.array([op.i], dtype=np.int64)
    k = np.array([op.k], dtype=np.int64)
    j = np.array([op.j], dtype=np.int64)
    cost = np.zeros(1)
    inputs = []
    for _ in range(L):
        inputs.append((i * k).astype(float))
        table = _cut_cost_table(np.stack([i, k, j], axis=1), mu)            # (4**t, 4)
        cost = (cost[:, None] + table).ravel()
        i = np.stack([i // 2, i, i, i], axis=1).ravel()
        j = np.stack([j, j // 2, j, j], axis=1).ravel()
        k = np.stack([k, k, k // 2, k], axis=1).ravel()
    return cost, inputs


def _transition(values: np.ndarray, inputs, L: int, rho: float) -> np.ndarray:
    """For every consumer sequence b: min over producer sequences a of values[a] + moves(a, b).

    moves(a, b) = sum_t rho * inputs[t][b's prefix] * MOVES[a_t, b_t] is a sum of per-bisection
    terms, so the minimum over a is taken one digit at a time: after step t the array is indexed
    by (b_0..b_t, a_{t+1}..a_{L-1}). 4**(L+1) work per bisection instead of 16**L.
    """
    v = values
    for t in range(L):
        v = v.reshape(4 ** t, 4, 4 ** (L - t - 1))
        step = rho * inputs[t][:, None, None] * MOVES[None, :, :]             # (prefix, a, b)
        v = (v[:, :, None, :] + step[:, :, :, None]).min(axis=1)
    return v.reshape(-1)


def _digits(L: int) -> np.ndarray:
    """(4**L, L): the cut index of every sequence at every bisection."""
    s = np.arange(4 ** L)
    return np.stack([(s // 4 ** (L - 1 - t)) % 4 for t in range(L)], axis=1)


def chain_dp_sequences(graph: Graph, p: int, mu: float = MU, rho: float = RHO) -> list:
    """The optimal cut sequences of a chain (edges (0, 1), (1, 2), ...), by dynamic programming."""
    n = len(graph.ops)
    if list(graph.edges) != [(t, t + 1) for t in range(n - 1)]:
        raise ValueError(f"chain_dp needs a chain's edges (t, t+1), got {list(graph.edges)[:6]}")
    L = log2_devices(p)
    check_graph(graph)
    values, all_inputs = [], []
    for n_op, op in enumerate(graph.ops):
        intra, inputs = _sequence_tables(op, L, mu)
        v = intra if n_op == 0 else intra + _transition(values[-1], inputs, L, rho)
        values.append(v)
        all_inputs.append(inputs)
    digits = _digits(L)
    best = [int(np.argmin(values[-1]))]
    for n_op in range(n - 1, 0, -1):                      # walk back: the producer's best for b
        b = best[-1]
        moves = np.zeros(4 ** L)
        for t in range(L):
            prefix = b // 4 ** (L - t)
            moves += rho * all_inputs[n_op][t][prefix] * MOVES[digits[:, t], digits[b, t]]
        best.append(int(np.argmin(values[n_op - 1] + moves)))
    return ["".join(CUTS[c] for c in digits[s]) for s in reversed(best)]


def chain_dp(graph: Graph, p: int, mu: float = MU, rho: float = RHO):
    """(list of Cut, SAPP cost) of the chain dynamic program (optimal for chains)."""
    return _plan(graph, p, chain_dp_sequences(graph, p, mu, rho), mu, rho)


def exhaustive_sequences(graph: Graph, p: int, mu: float = MU, rho: float = RHO,
                         max_plans: int = 100_000) -> list:
    """The cheapest combination of cut sequences, trying every legal one (first found on ties).

    ValueError when there are more than ``max_plans`` combinations of legal sequences.
    """
    L = log2_devices(p)
    check_graph(graph)
    legal = []
    for op in graph.ops:
        cost, _ = _sequence_tables(op, L, mu)
        names = ["".join(CUTS[c] for c in row) for row in _digits(L)]
        legal.append([names[s] for s in np.flatnonzero(np.isfinite(cost))])
    count = math.prod(len(x) for x in legal)
    if count > max_plans:
        raise ValueError(f"exhaustive search over {count} plans > max_plans ({max_plans})")
    best, best_cost = None, math.inf
    for combo in itertools.product(*legal):
        c = sapp_cost(graph, combo, mu, rho)
        if c < best_cost:
            best, best_cost = list(combo), c
    return best


def exhaustive(graph: Graph, p: int, mu: float = MU, rho: float = RHO, max_plans: int = 100_000):
    """(list of Cut, SAPP cost) of the exhaustive search."""
    return _plan(graph, p, exhaustive_sequences(graph, p, mu, rho, max_plans), mu, rho)


def cut_options(p: int) -> list:
    """Every Cut of one Matmul over p = 2**L devices whose parts are powers of two dividing p
    (the rest replicated): the choices :func:`least_price` combines."""
    L = log2_devices(p)
    return [to_cut("i" * a + "k" * b + "j" * c + "r" * (L - a - b - c), p)
            for a in range(L + 1) for b in range(L + 1 - a) for c in range(L + 1 - a - b)]


def least_price(graph: Graph, p: int, machine, dtype: str = "float32", limit: int = 20_000):
    """(list of Cut, seconds) of the strategy of least BSP price
    (:func:`hpcnn.plan.cost.strategy_cost` on ``machine``, p devices) among every combination
    of one Cut per Matmul whose parts are powers of two dividing p; None when there are more
    than ``limit`` combinations (then the DRA's greedy choice is the planner's).

    The SAPP total the three searches minimise weighs volumes only; the BSP price adds the
    machine's rates and the gradient reductions, and on the measured MLPs of
    experiments/plan_validation.py it ranked the layouts better: the choice small device counts
    can afford."""
    options = cut_options(p)
    check_graph(graph)
    n = len(graph.ops)
    if len(options) ** n > limit:
        return None
    best = None
    for combo in itertools.product(options, repeat=n):
        try:
            seconds = strategy_cost(graph, list(combo), machine, dtype).seconds
        except ValueError:                  # a cut the extents do not allow
            continue
        if best is None or seconds < best[1]:
            best = (list(combo), seconds)
    return best

