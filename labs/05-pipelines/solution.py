"""Lab 5, reference solution: pipeline schedules as instruction lists, executed on MPI.

A pipeline of S stages runs one stage per rank (stage s on rank s). A schedule is, per stage,
the order of its compute instructions on the M micro-batches: ``("F", mb)`` the forward,
``("B", mb)`` the backward (or only its input-gradient half when the schedule splits it),
``("W", mb)`` the weight-gradient half. :func:`schedule` turns the orders into hpcnn's
instruction lists (:class:`hpcnn.schedule.ops.Op`, with the SEND/RECV messages between
neighbouring stages), which :func:`hpcnn.schedule.pipeline.validate` checks and
:func:`hpcnn.schedule.pipeline.simulate` costs; :func:`execute` runs one rank's list.

Graded by ``python labs/05-pipelines/grade.py labs/05-pipelines/solution.py``.
"""
import numpy as np
from mpi4py import MPI

from hpcnn.schedule.pipeline import with_comm


def gpipe_order(s, S, M):
    """GPipe (Huang et al. 2019) on stage s of S: the M forwards in micro-batch order, then the
    M backwards in micro-batch order. Returns [("F", 0), ..., ("B", M - 1)]."""
    return [("F", mb) for mb in range(M)] + [("B", mb) for mb in range(M)]


def one_f_one_b_order(s, S, M):
    """1F1B (PipeDream-Flush, Narayanan et al. 2021) on stage s of S: a warm-up of
    w = min(S - 1 - s, M) forwards (micro-batches 0 .. w-1); then the steady state, for
    b = 0 .. M-w-1, the forward of micro-batch w + b followed by the backward of b; then the
    cool-down, the backwards of the last w micro-batches in order."""
    warm = min(S - 1 - s, M)
    ops = [("F", mb) for mb in range(warm)]                         # warm-up
    for b in range(M - warm):                                       # steady 1F1B
        ops += [("F", warm + b), ("B", b)]
    return ops + [("B", b) for b in range(M - warm, M)]             # cool-down


def zb_h1_order(s, S, M):
    """ZB-H1 (Qi et al. 2024, Sec. 3.1) on stage s of S: 1F1B's order with the backward split
    into B (input gradient) and W (weight gradient). Warm-up: w = min(S - 1 - s, M) forwards.
    Then for k = 0 .. M-1: if w + k < M (steady), the forward of micro-batch w + k; then B of k;
    then, if k >= s or the step is not steady, the W of the oldest micro-batch whose W has not
    run yet. At the end, the W's still pending, in order."""
    warm = min(S - 1 - s, M)
    ops, w = [("F", mb) for mb in range(warm)], 0
    for k in range(M):
        steady = warm + k < M
        if steady:
            ops.append(("F", warm + k))
        ops.append(("B", k))
        if k >= s or not steady:            # W trails its B by s rounds in the steady state
            ops.append(("W", w))
            w += 1
    return ops + [("W", mb) for mb in range(w, M)]


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
        x, y = cache
        return (dy * (1 - y * y)) @ self.w.T

    def backward_weight(self, dy, cache):
        """W: add this micro-batch's weight and bias gradients to ``dw`` and ``db``
        (dz = dy * (1 - y**2); dw += x.T @ dz; db += the column sums of dz)."""
        x, y = cache
        dz = dy * (1 - y * y)
        self.dw += x.T @ dz
        self.db += dz.sum(axis=0)

    def backward(self, dy, cache):
        """The whole backward: W's accumulation, then B's input gradient."""
        self.backward_weight(dy, cache)
        return self.backward_input(dy, cache)


def _send(comm, sends, buf, op, S):
    sends.append((comm.Isend(buf, dest=op.peer, tag=tag_of(op, S)), buf))


def _recv(comm, op, shape, S):
    buf = np.empty(shape)
    comm.Recv(buf, source=op.peer, tag=tag_of(op, S))
    return buf


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
    split = any(op.kind == "W" for op in ops)
    acts, caches, dys, out, held, sends = {}, {}, {}, {}, {}, []
    for op in ops:
        mb = op.mb
        if op.kind == "RECV_ACT":
            acts[mb] = _recv(comm, op, shape, S)
        elif op.kind == "RECV_GRAD":
            dys[mb] = _recv(comm, op, shape, S)
        elif op.kind == "F":
            y, caches[mb] = stage.forward(inputs[mb] if stage.index == 0 else acts.pop(mb))
            if stage.last:
                dys[mb] = loss_grad(mb, y)
            else:
                out[mb] = y
        elif op.kind == "B":
            dy, cache = dys.pop(mb), caches.pop(mb)
            if split:
                out[mb], held[mb] = stage.backward_input(dy, cache), (dy, cache)
            else:
                out[mb] = stage.backward(dy, cache)
        elif op.kind == "W":
            stage.backward_weight(*held.pop(mb))
        elif op.kind in ("SEND_ACT", "SEND_GRAD"):
            _send(comm, sends, out.pop(mb), op, S)
    MPI.Request.Waitall([req for req, _ in sends])


def measured_bubble(spans):
    """The bubble of a measured run: ``spans[r]`` lists rank r's compute instructions as
    (start, end) seconds on one clock. The makespan T runs from the earliest start to the
    latest end over all ranks; the bubble is 1 - (sum of all durations) / (ranks * T)."""
    starts = [a for rank in spans for a, _ in rank]
    ends = [b for rank in spans for _, b in rank]
    busy = sum(b - a for rank in spans for a, b in rank)
    return 1.0 - busy / (len(spans) * (max(ends) - min(starts)))
