"""Lab 7: the BSP cost of an MLP's layouts, by hand.

A layout gives each Linear y[i, j] = x[i, k] @ W[k, j] a cut (nb, nk, nj): the batch rows i in
nb parts, the reduction k in nk parts, the output features j in nj parts, over nb * nk * nj of
the p devices (the rest replicate). A training step is a sequence of BSP supersteps that add up
(no overlap), priced on a machine ``m`` with fields ``p`` (devices), ``flops`` (FLOP/s of one
device), ``latency`` (L, seconds a message), ``g`` (seconds a byte) and ``mem_bw`` (bytes/s of
memory), ``word`` bytes per number. It is the model of hpcnn's planner
(:func:`hpcnn.plan.cost.strategy_cost`, H. Wang's HSM2DL) on a machine of one level, with no
per-call overheads, for SGD and without the loss's gather.

Copy this file to student.py in this folder, write the functions that raise
NotImplementedError, then grade it: ``make lab N=7`` (or ``python labs/07-planning/grade.py``).
"""


def ring_allreduce(n, nbytes, latency, g):
    """Seconds of a ring allreduce of ``nbytes`` over ``n`` devices: a reduce-scatter and an
    all-gather, 2 (n - 1) steps, each one message of nbytes / n: 2 (n-1) (L + nbytes / n * g).
    Zero when n == 1 or nbytes == 0 (nothing to do)."""
    raise NotImplementedError


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
    raise NotImplementedError


def layout_cost(ops, cuts, m, word):
    """Seconds of one training step: the sum of every operator's supersteps. (The layouts
    graded here need no redistribution between operators: each one's output is laid out as the
    next one's input.)"""
    raise NotImplementedError
