"""The object collectives of a :class:`~.comm.Communicator`: small picklable metadata (shapes,
error messages, timings) gathered, broadcast, sent and exchanged, each call counted like the
buffer collectives (its pickled size) and recorded for the watchdog. A mixin: the methods use the
Communicator's ``comm``, ``rank``, ``size``, ``name``, ``stats`` and ``_timed``."""
from __future__ import annotations

import pickle
import time

from hpcnn.parallel.collectives.mpi_base import Request
from hpcnn.parallel.collectives.watchdog import started

_perf = time.perf_counter


def _pickled_size(obj) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class ObjectCalls:
    """Collectives of small picklable objects, mixed into :class:`~.comm.Communicator`."""

    def _check_root(self, op: str, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"{op}: root {root} is not a rank of {self.name} (size {self.size})")

    def allgather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable, small), in rank order. Counted under
        ``allgather_objects``: this rank's pickled size times p-1 (the all-gather convention)."""
        if self.size == 1:
            return [obj]
        return self._timed("allgather_objects", _pickled_size(obj) * (self.size - 1),
                           lambda: self.comm.allgather(obj))

    def gather_objects(self, obj, root: int = 0) -> list | None:
        """Every rank's ``obj`` in rank order on ``root``, None elsewhere. Counted under
        ``gather_objects``: the pickled size on every rank but the root."""
        self._check_root("gather_objects", root)
        if self.size == 1:
            return [obj]
        nbytes = 0 if self.rank == root else _pickled_size(obj)
        return self._timed("gather_objects", nbytes, lambda: self.comm.gather(obj, root=root))

    def bcast_object(self, obj, root: int = 0):
        """``root``'s ``obj`` on every rank (what the others pass is ignored). Counted under
        ``bcast_object``: the pickled size on the root."""
        self._check_root("bcast_object", root)
        if self.size == 1:
            return obj
        nbytes = _pickled_size(obj) if self.rank == root else 0
        return self._timed("bcast_object", nbytes, lambda: self.comm.bcast(obj, root=root))

    def send_object(self, obj, dest: int, tag: int = 0) -> Request:
        """Start sending ``obj`` (picklable) to rank ``dest``; ``wait()`` the returned request
        before reusing what ``obj`` holds. Counted under ``send_object``: the pickled size."""
        t0 = _perf()
        if started("send_object", self.name, dest, 0):  # test-only fault hook
            return self._skipped("send_object")
        req = self.comm.isend(obj, dest=dest, tag=tag)
        return Request([req], self.stats, "send_object", _pickled_size(obj), t0).at(self.name,
                                                                                    dest)

    def recv_object(self, source: int, tag: int = 0):
        """The object rank ``source`` sends with ``tag`` (blocking). Counted under
        ``recv_object`` with 0 bytes (the sender counts them)."""
        return self._timed("recv_object", 0, lambda: self.comm.recv(source=source, tag=tag),
                           peer=source)

    def alltoall_objects(self, objs) -> list:
        """``objs[q]`` (picklable) to rank q; returns what every rank sent this one, in rank
        order. Counted under ``alltoall_objects``: the pickled size of what leaves this rank."""
        if len(objs) != self.size:
            raise ValueError(f"alltoall_objects: {len(objs)} objects for {self.size} ranks")
        if self.size == 1:
            return list(objs)
        nbytes = sum(_pickled_size(o) for q, o in enumerate(objs) if q != self.rank)
        return self._timed("alltoall_objects", nbytes, lambda: self.comm.alltoall(list(objs)))
