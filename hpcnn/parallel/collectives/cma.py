"""Intra-node allreduce of private buffers by single-copy transfers (``algorithm="cma"``).

Linux cross-memory attach (``process_vm_readv``/``process_vm_writev``) copies straight between
our memory and a peer process's, one copy by the kernel, no shared window. For a buffer of n
bytes on p ranks of one node, slice q being the q-th of p near-equal parts:

1. every rank publishes its buffer's address and size (an ``Allgather`` of two integers, which
   also says that every rank's input is ready);
2. rank r sums slice r chunk by chunk (:data:`CHUNK_BYTES`, cache-resident), the operands in
   rank order, its own straight from its buffer, the others read from the peers into scratch;
   the last add writes into its buffer, and the summed chunk, still in cache, is written into
   every peer's buffer;                                                              barrier
   (so that no rank returns, and reads its buffer, before every slice has been written).

Nobody but rank r touches slice r of any buffer, so one barrier suffices. Each slice is summed
once, in rank order, and copied to the others: every rank ends with bitwise the same array.
Per rank n/p * (p reads + p writes) go through memory, against about 5n for the shm path's
private pieces (:mod:`.shm`), which must first copy the buffer into the shared
window (timings: docs/results/collectives.md). It needs permission to read and write the peers'
memory (same user, and ptrace allowed by the kernel's Yama setting or CAP_SYS_PTRACE):
:func:`available` tests both once per communicator, collectively, and ``auto`` only considers
``cma`` where it works. NumPy (host) buffers only.
"""
from __future__ import annotations

import ctypes
import os

import numpy

from hpcnn.parallel.collectives.mpi_base import _mpi
from hpcnn.parallel.collectives.ring import split

CHUNK_BYTES = 256 << 10      # summed and pushed chunk by chunk (measured: 64 KiB-1 MiB)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_calls = None


def _syscall():
    """(process_vm_readv, process_vm_writev) from the C library, or None."""
    global _calls
    if _calls is None:
        _calls = False
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fs = (libc.process_vm_readv, libc.process_vm_writev)
            for f in fs:
                f.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                              ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
                f.restype = ctypes.c_ssize_t
            _calls = fs
        except (OSError, AttributeError):
            pass
    return _calls or None


def _move(write: bool, pid: int, remote: int, local) -> None:
    """Copy ``local.nbytes`` bytes between address ``remote`` of process ``pid`` and the
    contiguous array ``local``: into ``local`` (read), or from it (``write``)."""
    n = local.nbytes
    if n == 0:
        return
    mine = _IoVec(local.__array_interface__["data"][0], n)
    far = _IoVec(remote, n)
    got = _calls[write](pid, ctypes.byref(mine), 1, ctypes.byref(far), 1, 0)
    if got != n:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_{'writev' if write else 'readv'} of {n} bytes "
                           f"{'to' if write else 'from'} pid {pid} moved {got}: "
                           f"{os.strerror(err)}")


def _read(pid: int, remote: int, dst) -> None:
    """Copy ``dst.nbytes`` bytes at address ``remote`` of process ``pid`` into ``dst``."""
    _move(False, pid, remote, dst)


def _write(pid: int, remote: int, src) -> None:
    """Copy the contiguous array ``src`` to address ``remote`` of process ``pid``."""
    _move(True, pid, remote, src)


def available(comm) -> bool:
    """True if every rank of ``comm`` (a Communicator, all on one node) can read and write its
    peers' memory; collective on the first call per communicator, cached."""
    st = comm.collectives.get_workspace()
    if st.cma_pids is None:
        from hpcnn.parallel.collectives import shm
        ok, pids = 0, []
        if comm.size > 1 and _syscall() is not None and shm.node_of(comm) is not None:
            probe = numpy.array([comm.rank + 1, 0], numpy.int64)
            pids = st.pcomm.allgather((os.getpid(), probe.__array_interface__["data"][0]))
            got = numpy.zeros(1, numpy.int64)
            q = (comm.rank + 1) % comm.size
            try:
                _read(pids[q][0], pids[q][1], got)
                _write(pids[q][0], pids[q][1] + 8, numpy.array([comm.rank + 1], numpy.int64))
                ok = int(got[0] == q + 1)
            except OSError:
                ok = 0
            st.pcomm.Barrier()                      # the probes stay alive until read and written
            ok &= int(probe[1] == (comm.rank - 1) % comm.size + 1)
            MPI = _mpi()
            flag = numpy.array([ok], numpy.int64)
            st.pcomm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MIN)
            ok = int(flag[0])
        st.cma_pids = [p for p, _ in pids] if ok else []
    return bool(st.cma_pids)


def allreduce(comm, flat) -> None:
    """Sum the 1-d NumPy array ``flat`` over ``comm``'s ranks in place (blocking, collective)."""
    if not available(comm):
        raise ValueError(f"allreduce 'cma' needs every rank on one node and permission to read "
                         f"and write the peers' memory (process_vm_readv/writev); not so on "
                         f"these {comm.size} ranks")
    st, p, r = comm.collectives.get_workspace(), comm.size, comm.rank
    me = numpy.array([flat.__array_interface__["data"][0], flat.nbytes], numpy.int64)
    everyone = numpy.empty((p, 2), numpy.int64)
    st.pcomm.Allgather(me, everyone)
    if not (everyone[:, 1] == flat.nbytes).all():
        raise ValueError(f"allreduce 'cma': rank {r} passed {flat.nbytes} bytes, the ranks "
                         f"passed {everyone[:, 1].tolist()}")
    pids, addr, item = st.cma_pids, everyone[:, 0], flat.itemsize
    b = split(flat.size, p)
    lo, hi = b[r], b[r + 1]
    step = max(1, CHUNK_BYTES // item)
    acc = st.blocking_scratch(flat.dtype, min(step, max(hi - lo, 1)))
    tmp = st.take(flat.dtype, min(step, max(hi - lo, 1)))
    try:
        for a in range(lo, hi, step):
            e = min(a + step, hi)
            mine, m = flat[a:e], e - a

            def operand(q, into):
                if q == r:
                    return mine
                _read(pids[q], int(addr[q]) + a * item, into[:m])
                return into[:m]
            total = operand(0, acc)                  # rank order; rank 0 sums in place
            for q in range(1, p):
                numpy.add(total, operand(q, tmp), out=mine if q == p - 1 else total)
            for q in range(p):                       # pushed while the sum is in cache
                if q != r:
                    _write(pids[q], int(addr[q]) + a * item, mine)
    finally:
        st.pool.append(tmp)
    st.pcomm.Barrier()                               # every slice is in every buffer
