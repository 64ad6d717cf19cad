"""Lab 7, reference solution: the BSP cost of an MLP's layouts, by hand.

A layout gives each Linear y[i, j] = x[i, k] @ W[k, j] a cut (nb, nk, nj): the batch rows i in
nb parts, the reduction k in nk parts, the output features j in nj parts, over nb * nk * nj of
the p devices (the rest replicate). A training step is a sequence of BSP supersteps that add up
(no overlap), priced on a machine ``m`` with fields ``p`` (devices), ``flops`` (FLOP/s of one
device), ``latency`` (L, seconds a message), ``g`` (seconds a byte) and ``mem_bw`` (bytes/s of
memory), ``word`` bytes per number. It is the model of hpcnn's planner
(:func:`hpcnn.plan.cost.strategy_cost`, H. Wang's HSM2DL) on a machine of one level, with no
per-call overheads, for SGD and without the loss's gather.

Graded by ``python labs/07-planning/grade.py labs/07-planning/solution.py``.
"""


def ring_allreduce(n, nbytes, latency, g):
    """Seconds of a ring allreduce of ``nbytes`` over ``n`` devices: a reduce-scatter and an
    all-gather, 2 (n - 1) steps, each one message of nbytes / n: 2 (n-1) (L + nbytes / n * g).
    Zero when n == 1 or nbytes == 0 (nothing to do)."""
    if n == 1 or nbytes == 0:
        return 0.0
    return 2 * (n - 1) * (latency + nbytes / n * g)


def operator_terms(op, cut, m, word):
    """The supersteps of one Linear ``op = (i, k, j)`` under ``cut = (nb, nk, nj)`` on machine
    ``m``, as {name: seconds}:

    - "compute": forward, input gradient and weight gradient, 3 * 2 i k j / (nb nk nj) FLOPs;
    - "update": SGD on the local weight and bias parts, (k / nk + 1) * j / nj numbers, 4 passes
      of 3 words each (two read, one written) at ``mem_bw``;
    - "reduce y": the forward's partial outputs y[i/nb, j/nj] summed over the nk devices that
      split k (a ring allreduce);
    - "reduce dx": the backward's partial input gradients dx[i/nb, k/nk] summed over the nj
      devices that split j;
    - "grad allreduce": the weight and bias gradients, one buffer of the local parts, summed
      over the nb devices that computed them on different rows.
    """
    i, k, j = op
    nb, nk, nj = cut
    rows, local = i / nb, (k / nk + 1) * j / nj
    ring = lambda n, nbytes: ring_allreduce(n, nbytes, m.latency, m.g)   # noqa: E731
    return {"compute": 3 * 2 * i * k * j / (nb * nk * nj) / m.flops,
            "update": 4 * 3 * local * word / m.mem_bw,
            "reduce y": ring(nk, rows * j / nj * word),
            "reduce dx": ring(nj, rows * k / nk * word),
            "grad allreduce": ring(nb, local * word)}


def layout_cost(ops, cuts, m, word):
    """Seconds of one training step: the sum of every operator's supersteps. (The layouts
    graded here need no redistribution between operators: each one's output is laid out as the
    next one's input.)"""
    return sum(sum(operator_terms(op, c, m, word).values()) for op, c in zip(ops, cuts))
