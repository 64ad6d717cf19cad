"""Lab 5: pipeline schedules as instruction lists, executed on MPI.

A pipeline of S stages runs one stage per rank (stage s on rank s). A schedule is, per stage,
the order of its compute instructions on the M micro-batches: ``("F", mb)`` the forward,
``("B", mb)`` the backward (or only its input-gradient half when the schedule splits it),
``("W", mb)`` the weight-gradient half. :func:`schedule` turns the orders into hpcnn's
instruction lists (:class:`hpcnn.schedule.ops.Op`, with the SEND/RECV messages between
neighbouring stages), which :func:`hpcnn.schedule.pipeline.validate` checks and
:func:`hpcnn.schedule.pipeline.simulate` costs; :func:`execute` runs one rank's list.

Copy this file to student.py in this folder, write the functions that raise
NotImplementedError, then grade it: ``make lab N=5`` (or ``python labs/05-pipelines/grade.py``).
"""
import numpy as np
from mpi4py import MPI

from hpcnn.schedule.pipeline import with_comm


def gpipe_order(s, S, M):
    """GPipe (Huang et al. 2019) on stage s of S: the M forwards in micro-batch order, then the
    M backwards in micro-batch order. Returns [("F", 0), ..., ("B", M - 1)]."""
    raise NotImplementedError


def one_f_one_b_order(s, S, M):
    """1F1B (PipeDream-Flush, Narayanan et al. 2021) on stage s of S: a warm-up of
    w = min(S - 1 - s, M) forwards (micro-batches 0 .. w-1); then the steady state, for
    b = 0 .. M-w-1, the forward of micro-batch w + b followed by the backward of b; then the
    cool-down, the backwards of the last w micro-batches in order."""
    raise NotImplementedError


def zb_h1_order(s, S, M):
    """ZB-H1 (Qi et al. 2024, Sec. 3.1) on stage s of S: 1F1B's order with the backward split
    into B (input gradient) and W (weight gradient). Warm-up: w = min(S - 1 - s, M) forwards.
    Then for k = 0 .. M-1: if w + k < M (steady), the forward of micro-batch w + k; then B of k;
    then, if k >= s or the step is not steady, the W of the oldest micro-batch whose W has not
    run yet. At the end, the W's still pending, in order."""
    raise NotImplementedError


def schedule(order, S, M):
    """The instruction lists (one per rank, stage s on rank s) of ``order(s, S, M)``, with the
    SEND/RECV messages inserted around each F and B (hpcnn's ``with_comm``)."""
    compute = [[(kind, mb, s) for kind, mb in order(s, S, M)] for s in range(S)]
    return with_comm(compute, S, S)


def tag_of(op, S):
    """The MPI tag of a message: a SEND and its RECV have the same kind, mb and stage."""
    return 2 * (op.mb * S + op.stage) + (0 if op.kind.endswith("ACT") else 1)


class Stage:
    """One pipeline stage, y = tanh(x @ w + b), with its backward split in two halves."""

    def __init__(self, w, b, index, n_stages):
        self.w, self.b, self.index, self.last = w, b, index, index == n_stages - 1
        self.dw, self.db = np.zeros_like(w), np.zeros_like(b)

    def forward(self, x):
        """Returns (y, cache); the cache holds what the backward needs: (x, y)."""
        y = np.tanh(x @ self.w + self.b)          # (rows, D)
        return y, (x, y)

    def backward_input(self, dy, cache):
        """B: the input gradient dx = (dy * (1 - y**2)) @ w.T. Touches no parameter gradient."""
        raise NotImplementedError

    def backward_weight(self, dy, cache):
        """W: add this micro-batch's weight and bias gradients to ``dw`` and ``db``
        (dz = dy * (1 - y**2); dw += x.T @ dz; db += the column sums of dz)."""
        raise NotImplementedError

    def backward(self, dy, cache):
        """The whole backward: W's accumulation, then B's input gradient."""
        self.backward_weight(dy, cache)
        return self.backward_input(dy, cache)


def execute(comm, ops, stage, inputs, loss_grad, shape, S):
    """Run this rank's instruction list ``ops`` on ``stage`` (stage ``stage.index`` of S).

    F(mb): the input is ``inputs[mb]`` on stage 0, else the activation received for mb; keep
    the cache; on the last stage the output gradient is ``loss_grad(mb, y)``. B(mb): the output
    gradient (from ``loss_grad`` or received); ``stage.backward`` if the list has no W,
    else ``stage.backward_input``, keeping (dy, cache) for W(mb), which calls
    ``stage.backward_weight``. SEND_ACT / SEND_GRAD: ``comm.Isend`` of the F's output / the B's
    input gradient to ``op.peer`` with tag ``tag_of(op, S)`` (keep the request and its buffer);
    RECV_ACT / RECV_GRAD: ``comm.Recv`` of a (rows, D) = ``shape`` float64 array. At the end,
    wait for every send. The parameter gradients are left in ``stage.dw``, ``stage.db``."""
    raise NotImplementedError


def measured_bubble(spans):
    """The bubble of a measured run: ``spans[r]`` lists rank r's compute instructions as
    (start, end) seconds on one clock. The makespan T runs from the earliest start to the
    latest end over all ranks; the bubble is 1 - (sum of all durations) / (ranks * T)."""
    raise NotImplementedError
