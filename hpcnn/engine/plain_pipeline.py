"""GPipe and 1F1B written as plain loops, for reading: the textbook twin of the pipelined step.

The training path runs a pipeline as data: a schedule's per-rank instruction list
(:mod:`hpcnn.schedule.pipeline`) run by the generic executor (:func:`hpcnn.engine.execute.run`),
through :func:`hpcnn.engine.pipelined.train_step`. Here the same two schedules are the loops a
textbook draws, one stage per rank (stage s on pipeline rank s):

    GPipe   for each micro-batch: forward, send the activation on;
            then for each micro-batch: backward, send the gradient back
    1F1B    S-1-s forwards to fill the pipeline, then one forward and one backward at a time,
            then the backwards left

The blocks, the loss factors (micro-batch rows / batch rows) and the order of the backwards
(micro-batch 0 first) are the fast path's, so the gradients are equal
(``tests/mpi/plain_twins.py``). Nothing in the package uses this module; it has no remat, no
zero-bubble W, no virtual stages, no dropout draws and no timeline.
"""
from __future__ import annotations

from hpcnn import backend
from hpcnn.engine.stage import boundary_shapes
from hpcnn.engine.step import split_batch
from hpcnn.schedule import stages

ACT, GRAD = 0, 1        # tags: activations go down the pipeline (s -> s+1), gradients up


def train_step(schedule: str, chain, pp, x, y, n_micro: int, layout=None):
    """One GPipe or 1F1B step of ``chain`` cut into ``pp.size`` stages (``layout`` "2|5", else
    uniform) over the pipeline Communicator ``pp``; accumulates this rank's stage's gradients
    (zeroed first) and returns ``(stage chain, loss)``, the loss on the last stage only."""
    S, s = pp.size, pp.rank
    ranges = (stages.parse_layout(layout, len(chain)) if layout is not None
              else stages.uniform(len(chain), S))
    stage = stages.stage_chains(chain, ranges)[s]
    first, last = s == 0, s == S - 1
    xs, ys = split_batch(x, y, n_micro)                     # (b_mb, ...) each, b_mb ~ B / M
    factor = [a.shape[0] / x.shape[0] for a in xs]          # dL/dloss_mb: the batch mean
    shapes = boundary_shapes(chain, ranges, [a.shape for a in xs])   # [mb][stage] input shapes
    dtype, caches, losses, sends = chain.params[0].data.dtype, {}, {}, []
    stage.zero_grad()

    def receive(shape, peer, tag):
        buf = backend.xp.empty(shape, dtype=dtype)
        pp.irecv(buf, peer, tag).wait()                     # receives block
        return buf

    def send(a, peer, tag):                                 # sends do not: waited at the end
        a = backend.xp.ascontiguousarray(a)
        sends.append((pp.isend(a, peer, tag), a))

    def forward(mb):
        h = xs[mb] if first else receive(shapes[mb][s], s - 1, ACT)     # stage input (b_mb, ...)
        if last:
            losses[mb], caches[mb] = stage.forward(h, ys[mb])          # scalar loss
        else:
            h, caches[mb] = stage.forward_blocks(h)                    # activation (b_mb, ...)
            send(h, s + 1, ACT)

    def backward(mb):
        if last:                                                        # from dL/dloss_mb
            dx = stage.backward(factor[mb], caches.pop(mb), need_dx=not first)
        else:                                                           # dL/dy (b_mb, ...)
            dy = receive(shapes[mb][s + 1], s + 1, GRAD)
            dx = stage.backward_blocks(dy, caches.pop(mb), need_dx=not first)
        if not first:
            send(dx, s - 1, GRAD)                                       # dL/dx (b_mb, ...)

    loops = {"gpipe": gpipe, "1f1b": one_f_one_b}
    if schedule not in loops:
        raise ValueError(f"plain pipeline: schedule {schedule!r}: gpipe or 1f1b")
    loops[schedule](forward, backward, n_micro, S, s)
    for req, _ in sends:
        req.wait()
    return stage, (sum(losses[mb] * factor[mb] for mb in range(n_micro)) if last else None)


def gpipe(forward, backward, M: int, S: int, s: int) -> None:
    """GPipe on stage s of S: every forward (M micro-batches held), then every backward."""
    for mb in range(M):
        forward(mb)
    for mb in range(M):
        backward(mb)


def one_f_one_b(forward, backward, M: int, S: int, s: int) -> None:
    """1F1B on stage s of S: at most S - s micro-batches held."""
    warm = min(S - 1 - s, M)                 # warm-up: fill the stages after this one
    for mb in range(warm):
        forward(mb)
    for mb in range(M - warm):               # steady state: one forward, one backward
        forward(warm + mb)
        backward(mb)
    for mb in range(M - warm, M):            # cool-down: the backwards left
        backward(mb)
