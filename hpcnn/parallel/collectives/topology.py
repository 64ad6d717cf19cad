"""Which ranks share a node: the library's answer, or emulated nodes on one machine.

A node is the set of ranks that share memory: ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``.
Every node-local path (the shared-window allreduce, single-copy reads, the intra-node levels of
the hierarchical collectives) asks :func:`split_node`, never the library directly, so that
**emulated nodes** can stand for real ones in tests and experiments on one machine:
``HPCNN_NODES=k`` (or :func:`emulate`, which ``hpcnn train --nodes=k`` calls) cuts
``MPI_COMM_WORLD`` into k nodes of consecutive world ranks, node n holding world ranks
``[n P / k, (n + 1) P / k)`` of P; a communicator's ranks then share a node only if their world
ranks fall in one such range. Emulation only ever splits real nodes further: two ranks on
different real nodes are never put on one emulated node (checked by :func:`node_map`).

:func:`node_map` gives every rank's node index (collective), in order of each node's first rank;
the process grid's placement and ``hpcnn info`` read it.

Real nodes joined by an emulated network (``benchmarks/netns_cluster.py``: network namespaces
and a throttled link) set ``HPCNN_EMULATED_LINK`` to what they emulate; :func:`emulated_link`
reads it, so that the run header and log name the network as an emulation.

    HPCNN_NODES=2 mpiexec -n 4 python -m mpi4py -c "from mpi4py import MPI; \\
        from hpcnn.parallel.collectives import topology; print(topology.node_map(MPI.COMM_WORLD))"
"""
from __future__ import annotations

import os

ENV = "HPCNN_NODES"
LINK_ENV = "HPCNN_EMULATED_LINK"
_emulated: int | None = None          # emulate(k); None: read ENV


class TopologyError(ValueError):
    """Emulated nodes that do not fit the world (more nodes than ranks, or one spanning two
    real nodes)."""


def emulate(nodes: int | None) -> None:
    """Emulate ``nodes`` nodes (None or 0: as ``HPCNN_NODES`` says, else the real ones). Call it
    before any communicator asks for its node (every rank alike)."""
    global _emulated
    _emulated = int(nodes) if nodes else None


def emulated() -> int | None:
    """The number of emulated nodes, or None when nodes are the real ones."""
    return _emulated if _emulated is not None else from_env()


def emulated_link() -> str | None:
    """What ``HPCNN_EMULATED_LINK`` says the network between the nodes emulates (e.g. ``tbf
    500mbit, netns``), or None for a real network."""
    return os.environ.get(LINK_ENV, "").strip() or None


def from_env() -> int | None:
    """What ``HPCNN_NODES`` asks for (None: unset or 0); TopologyError if not a number >= 0."""
    raw = os.environ.get(ENV, "").strip()
    if not raw or raw == "0":
        return None
    try:
        k = int(raw)
    except ValueError:
        raise TopologyError(f"{ENV}={raw!r}: expected a positive number of nodes") from None
    if k < 1:
        raise TopologyError(f"{ENV}={raw!r}: expected a positive number of nodes")
    return k


def node_index(world_rank: int, world_size: int, nodes: int) -> int:
    """The emulated node of ``world_rank``: n such that n P / k <= rank < (n + 1) P / k."""
    return ((world_rank + 1) * nodes - 1) // world_size


def _world_ranks(comm) -> list[int]:
    """The world rank of every rank of ``comm`` (an mpi4py communicator)."""
    from hpcnn.parallel.collectives.mpi_base import _mpi
    MPI = _mpi()
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def split_node(comm, key: int | None = None):
    """A new mpi4py communicator of the ranks of ``comm`` on this rank's node, ordered by
    ``key`` (default: the rank in ``comm``); collective over ``comm``. The caller frees it."""
    from hpcnn.parallel.collectives.mpi_base import _mpi
    MPI = _mpi()
    key = comm.Get_rank() if key is None else key
    real = comm.Split_type(MPI.COMM_TYPE_SHARED, key=key)
    k = emulated()
    if k is None:
        return real
    size = MPI.COMM_WORLD.Get_size()
    if k > size:
        real.Free()
        raise TopologyError(f"{k} emulated nodes for {size} ranks: at most one node a rank")
    me = node_index(_world_ranks(comm)[comm.Get_rank()], size, k)
    node = real.Split(color=me, key=key)
    real.Free()
    return node


def node_map(comm) -> list[int]:
    """Every rank's node index in ``comm`` (an mpi4py communicator), nodes numbered in order of
    their first rank; collective. Under emulation, checks that no emulated node spans two real
    nodes (TopologyError on every rank)."""
    from hpcnn.parallel.collectives.mpi_base import _mpi
    MPI = _mpi()
    node = split_node(comm)
    try:
        first = node.allreduce(comm.Get_rank(), op=MPI.MIN)     # my node's first rank
        real = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        real_first = real.allreduce(comm.Get_rank(), op=MPI.MIN)
        real.Free()
    finally:
        node.Free()
    firsts = comm.allgather((first, real_first))
    by_node: dict = {}
    for f, r in firsts:
        if by_node.setdefault(f, r) != r:
            raise TopologyError(f"emulated node of rank {f} spans two real nodes: "
                                f"{ENV} must split each real node's consecutive ranks")
    order = sorted(by_node)
    return [order.index(f) for f, _ in firsts]


HW_KINDS = (("packages", "hwloc://Package"), ("NUMA domains", "hwloc://NUMANode"))


def hw_map(comm, kind: str) -> list[int] | None:
    """Every rank's group of the hardware resource ``kind`` (an ``mpi_hw_resource_type``:
    ``"hwloc://Package"``, ``"hwloc://NUMANode"``, ``"mpi_shared_memory"``), numbered in order
    of their first rank, from ``MPI_Comm_split_type(MPI_COMM_TYPE_HW_GUIDED)`` (MPI 4.0); None
    where the library does not offer it (no such split type, or no group on some rank: the
    standard's answer for a resource it does not know). Collective over ``comm``; real
    hardware, emulated nodes or not."""
    from hpcnn.parallel.collectives.mpi_base import _mpi
    MPI = _mpi()
    split = getattr(MPI, "COMM_TYPE_HW_GUIDED", None)
    if split is None:
        return None
    info = MPI.Info.Create()
    info.Set("mpi_hw_resource_type", kind)
    try:
        sub = comm.Split_type(split, key=comm.Get_rank(), info=info)
    finally:
        info.Free()
    first = -1
    if sub != MPI.COMM_NULL:
        first = sub.allreduce(comm.Get_rank(), op=MPI.MIN)
        sub.Free()
    firsts = comm.allgather(first)
    if min(firsts) < 0:
        return None
    order = sorted(set(firsts))
    return [order.index(f) for f in firsts]


def describe(nodes: list[int]) -> str:
    """``"2 nodes x 2 ranks (emulated)"``-like words for a node map."""
    counts = [nodes.count(n) for n in sorted(set(nodes))]
    shape = (f"{len(counts)} node{'s' if len(counts) > 1 else ''} x {counts[0]} rank"
             f"{'s' if counts[0] > 1 else ''}" if len(set(counts)) == 1
             else f"{len(counts)} nodes of {', '.join(map(str, counts))} ranks")
    return shape + (" (emulated)" if emulated() else "")
