"""Two-level collectives over the nodes of a communicator (``algorithm="hier"``).

When a communicator's P ranks sit on N > 1 nodes of q > 1 ranks each (real nodes, or the
emulated ones of :mod:`.topology`), the allreduce is done in three steps (as NCCL's and
Horovod's hierarchical allreduce do):

1. inside each node, a reduce-scatter (``MPI_Reduce_scatter`` on the node's communicator): local
   rank l gets slice l (of q, sizes differing by at most one) of its node's sum;
2. across nodes, an allreduce of slice l among the ranks of local rank l (one per node, the
   "rail"), by hpcnn's segmented ring (:mod:`.ring`): every rail rank ends with the same bits;
3. inside each node, an all-gather of the slices (``MPI_Allgatherv``).

The inter-node links carry 2 (N - 1)/N of the bytes of one slice per rank, 1/q of a flat
allreduce's; each element is summed once per node, then once across nodes, so every rank ends
with bitwise the same array (the sum's order differs from the library's: results agree with
``mpi`` to rounding). :func:`HierRequest` is the non-blocking form, a state machine
(:class:`Staged`) whose ``test()`` advances as far as its current step allows (the backward's
buckets call it after every block), like the ring's. Where the nodes differ in size, or there
is one node, or one rank a node, ``hier`` is the library's Allreduce.

ZeRO's collectives of parts (rank r's part of a flat buffer, in rank order) have two-level
forms too, where node n holds ranks [n q, (n + 1) q): :func:`ireduce_scatter_parts` packs the
parts by local rank, reduce-scatters in the node, then across the rail;
:func:`iallgather_parts` gathers across the rail, then in the node, and unpacks.

    HPCNN_NODES=2 mpiexec -n 4 python -m mpi4py -c "import numpy as np; from mpi4py import MPI; \\
        from hpcnn.parallel.collectives import Communicator; c = Communicator(MPI.COMM_WORLD); \\
        a = np.arange(6.0) * (c.rank + 1); c.allreduce(a, algorithm='hier'); print(a)"
"""
from __future__ import annotations

import time
from collections import deque

import numpy

from hpcnn.parallel.collectives.mpi_base import Request, _mpi
from hpcnn.parallel.collectives.ring import RingRequest, flat_view, split


class Line:
    """The requests of one two-level collective in flight on a communicator, in call order.
    Each starts its step k's collective only after the request before it has started its
    own, so every rank starts them in the same order whatever order it tests them in."""

    def __init__(self):
        self.queue: deque = deque()

    def advance(self, until=None) -> None:
        """Advance the requests, each no further than the one before it; without blocking, or
        until ``until`` is done."""
        ahead = None
        for req in list(self.queue):
            req._advance(until is not None, ahead)
            ahead = req._step
            if req is until:
                break
        while self.queue and self.queue[0].finished:
            self.queue.popleft()

    def drain(self) -> None:
        if self.queue:
            self.advance(until=self.queue[-1])


class Levels:
    """A communicator's two levels: ``node`` (mpi4py, this rank's node), ``rail`` (a
    Communicator of the ranks of this local rank on every node), ``q`` ranks a node. Each
    collective has its own communicators, one per step (``comms[kind]``: duplicates of the
    two), and its :class:`Line` (``lines[kind]``): a later step of one request starts after an
    earlier step of requests made after it, and collectives on one communicator must start in
    the same order on every rank. ``consecutive``: node n holds ranks [n q, (n + 1) q) (what the parts' forms need)."""

    KINDS = ("allreduce", "reduce_scatter", "allgather")

    def __init__(self, node, rail, q: int, consecutive: bool):
        self.node, self.rail, self.q, self.consecutive = node, rail, q, consecutive
        # (the allreduce uses the node twice: its reduce-scatter and its all-gather each on one)
        self.comms = {"allreduce": (node.Dup(), node.Dup()),
                      "reduce_scatter": (node.Dup(), rail.comm.Dup()),
                      "allgather": (node.Dup(), rail.comm.Dup())}
        self.lines = {k: Line() for k in self.KINDS}

    def free(self) -> None:
        for line in self.lines.values():
            line.drain()
        for a, b in self.comms.values():
            a.Free()
            b.Free()
        self.rail.free()
        self.node.Free()


def levels_of(comm) -> Levels | None:
    """The :class:`Levels` of ``comm`` (a Communicator), or None where the two-level form does
    not apply (one node, one rank a node, nodes of different sizes). Collective on first call;
    kept in the communicator's workspace, freed with it."""
    ws = comm.collectives.get_workspace()
    if ws.levels is None:
        from hpcnn.parallel.collectives.topology import split_node
        ws.levels = False
        node = split_node(ws.pcomm, key=comm.rank)
        q = node.Get_size()
        sizes = set(ws.pcomm.allgather(q))
        if len(sizes) == 1 and 1 < q < comm.size:
            rail = ws.pcomm.Split(color=node.Get_rank(), key=comm.rank)
            first = ws.pcomm.allgather(comm.rank - node.Get_rank())   # my node's first rank
            consecutive = all(f == r // q * q for r, f in enumerate(first))
            # (the rail a Communicator of comm's own class: its ring, its counters)
            ws.levels = Levels(node, type(comm)(rail, name=f"{comm.name}.rail"), q, consecutive)
        else:
            node.Free()
    return ws.levels or None


class Staged(Request):
    """A two-level collective as a state machine: ``starts[k](block)`` starts step k's request
    (an MPI request or a :class:`Request`; step 0 at once), each when the step before it is
    complete; ``done_fn`` runs when the last is. ``test()`` goes as far as it can without
    blocking, ``wait()`` to the end; both advance the earlier requests of the same
    :class:`Line` first."""

    def __init__(self, comm, line: Line, op: str, nbytes: int, starts, done_fn=None,
                 on_done=None):
        super().__init__([], comm.stats, op, nbytes, time.perf_counter(), on_done)
        self.where, self._line, self._starts, self._done_fn = comm.name, line, starts, done_fn
        self._step, self._busy = 0, 0.0
        self._req = starts[0](False)
        line.queue.append(self)

    @property
    def finished(self) -> bool:
        return self._step == len(self._starts)

    def _advance(self, block: bool, limit) -> None:
        """Go through the steps whose requests are complete (all of them when ``block``),
        starting step k only where the request before it has (``limit`` >= k; None: first)."""
        n = len(self._starts)
        while self._step < n:
            nxt = self._step + 1
            if nxt < n and limit is not None and nxt > limit:
                return                     # the request before it has not started that step
            r, ours = self._req, isinstance(self._req, Request)
            if block:
                r.wait() if ours else r.Wait()
            elif not (r.test() if ours else r.Test()):
                return
            self._step = nxt
            if nxt < n:
                self._req = self._starts[nxt](block)
            elif self._done_fn is not None:
                self._done_fn()

    def test(self) -> bool:
        if not self.done:
            t = time.perf_counter()
            self._line.advance()
            self._busy += time.perf_counter() - t
            if self.finished:
                self._finish(self._busy)
        return self.done

    def wait(self) -> None:
        if not self.done:
            prev = self._enter_wait()
            t = time.perf_counter()
            try:
                self._line.advance(until=self)
            finally:
                from hpcnn.parallel.collectives.watchdog import leave
                leave(prev)
            self._finish(self._busy + time.perf_counter() - t)


def HierRequest(comm, levels: Levels, buf, on_done=None) -> Staged:
    """The two-level allreduce of ``buf`` in place (module docstring): the node's
    ``Ireduce_scatter``, the rail's ring (:class:`~.ring.RingRequest`), the node's
    ``Iallgatherv``."""
    flat = flat_view(buf)
    cut = split(flat.size, levels.q)
    counts, displs = [cut[i + 1] - cut[i] for i in range(levels.q)], cut[:-1]
    part = numpy.empty(counts[levels.node.Get_rank()], flat.dtype)
    scatter, gather = levels.comms["allreduce"]
    SUM = _mpi().SUM
    starts = [lambda block: scatter.Ireduce_scatter(flat, part, counts, op=SUM),
              lambda block: RingRequest(levels.rail, part, blocking=block),
              lambda block: gather.Iallgatherv(part, [flat, (counts, displs)])]
    return Staged(comm, levels.lines["allreduce"], "iallreduce",
                  2 * (comm.size - 1) * flat.nbytes // comm.size, starts, on_done=on_done)


def _offsets(counts) -> list[int]:
    """Where each of consecutive blocks of ``counts`` elements starts."""
    return [0, *numpy.cumsum(counts[:-1]).astype(int).tolist()] if len(counts) else []


def _packed(levels: Levels, counts) -> tuple:
    """For parts ``counts`` in rank order (rank r = node r // q, local r % q): each part's
    offset in the flat buffer (``displs``), the order that puts the parts of one local rank
    together (local 0 of every node, then local 1, ...), their offsets in that packed order
    (``at``), per local rank the elements it gathers (``by_local``), and the parts of this
    rank's local rank on every node (``rail_counts``)."""
    q, nodes, l = levels.q, len(counts) // levels.q, levels.node.Get_rank()
    order = [j * q + k for k in range(q) for j in range(nodes)]
    at = dict(zip(order, _offsets([counts[r] for r in order])))
    by_local = [sum(counts[j * q + k] for j in range(nodes)) for k in range(q)]
    rail_counts = [counts[j * q + l] for j in range(nodes)]
    return _offsets(counts), order, at, by_local, rail_counts


def ireduce_scatter_parts(comm, levels: Levels, sendbuf, recvbuf, counts) -> Staged:
    """``recvbuf`` = this rank's part of the sum of every rank's ``sendbuf`` (parts
    ``counts`` in rank order), in two levels: the parts packed by local rank, a reduce-scatter
    in the node (local rank l gets the node's sum of every node's part l), then one across the
    rail (each rank its own part). Each element is summed once per level."""
    displs, order, at, by_local, rail_counts = _packed(levels, counts)
    send = flat_view(sendbuf)
    pack = numpy.empty_like(send)
    for r in order:
        pack[at[r]:at[r] + counts[r]] = send[displs[r]:displs[r] + counts[r]]
    mine = numpy.empty(by_local[levels.node.Get_rank()], send.dtype)
    node, rail = levels.comms["reduce_scatter"]
    SUM = _mpi().SUM
    starts = [lambda block: node.Ireduce_scatter(pack, mine, by_local, op=SUM),
              lambda block: rail.Ireduce_scatter(mine, recvbuf, rail_counts, op=SUM)]
    return Staged(comm, levels.lines["reduce_scatter"], "ireduce_scatter",
                  (send.size - counts[comm.rank]) * send.itemsize, starts)


def iallgather_parts(comm, levels: Levels, buf, counts) -> Staged:
    """In place: every rank's part of ``buf`` (``counts`` in rank order) in every rank's, in two
    levels: an all-gather across the rail (the parts of this local rank on every node), then
    one in the node (every local rank's), unpacked into ``buf``."""
    displs, order, at, by_local, rail_counts = _packed(levels, counts)
    flat = flat_view(buf)
    mine = flat[displs[comm.rank]:displs[comm.rank] + counts[comm.rank]].copy()
    rail_part = numpy.empty(by_local[levels.node.Get_rank()], flat.dtype)
    pack = numpy.empty_like(flat)
    node, rail = levels.comms["allgather"]
    rail_displs, node_displs = _offsets(rail_counts), _offsets(by_local)

    def unpack():
        for r in order:
            flat[displs[r]:displs[r] + counts[r]] = pack[at[r]:at[r] + counts[r]]

    starts = [lambda block: rail.Iallgatherv(mine, [rail_part, (rail_counts, rail_displs)]),
              lambda block: node.Iallgatherv(rail_part, [pack, (by_local, node_displs)])]
    return Staged(comm, levels.lines["allgather"], "iallgather",
                  (flat.size - counts[comm.rank]) * flat.itemsize, starts, done_fn=unpack)


def allreduce(comm, levels: Levels, buf) -> None:
    """The blocking two-level allreduce of ``buf`` (a host array) in place."""
    HierRequest(comm, levels, buf).wait()
