"""Intra-node allreduce of private buffers by single-copy reads (``algorithm="cma"``).

Linux cross-memory attach (``process_vm_readv``) copies straight from a peer process's memory
into ours, one copy by the kernel, no shared window. For a buffer of n bytes on p ranks of one
node, slice q being the q-th of p near-equal parts:

1. every rank publishes its buffer's address and size (an ``Allgather`` of two integers, which
   also says that every rank's input is ready);
2. rank r sums slice r: chunk by chunk (:data:`CHUNK_BYTES`, cache-resident), the operands in
   rank order, its own straight from its buffer, the others read from the peers into scratch;
   the last add writes into its buffer;                                              barrier
3. rank r reads every other slice q, already summed, from rank q's buffer into its own; barrier
   (so that no rank returns, and its caller writes the buffer, while a peer still reads it).

Each slice is summed once, in rank order, and copied by the others: every rank ends with
bitwise the same array. Per rank about 2.5n bytes move through memory, against 5n for the shm
path's private pieces (:mod:`hpcnn.parallel.shm`), which must first copy the buffer into the
shared window. It needs permission to read the peers' memory (same user, and ptrace allowed by
the kernel's Yama setting or CAP_SYS_PTRACE): :func:`available` tests it once per communicator,
collectively, and ``auto`` only considers ``cma`` where it works. NumPy (host) buffers only.
"""
from __future__ import annotations

import ctypes
import os

import numpy

from hpcnn.parallel.comm import _mpi
from hpcnn.parallel.ring import split, state

CHUNK_BYTES = 1 << 20        # per scratch chunk of the reduce phase


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv = None


def _syscall():
    global _readv
    if _readv is None:
        _readv = False
        try:
            f = ctypes.CDLL(None, use_errno=True).process_vm_readv
            f.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                          ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
            f.restype = ctypes.c_ssize_t
            _readv = f
        except (OSError, AttributeError):
            pass
    return _readv or None


def _read(pid: int, remote: int, dst) -> None:
    """Copy ``dst.nbytes`` bytes at address ``remote`` of process ``pid`` into ``dst``."""
    n = dst.nbytes
    if n == 0:
        return
    local = _IoVec(dst.__array_interface__["data"][0], n)
    far = _IoVec(remote, n)
    got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0)
    if got != n:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_readv of {n} bytes from pid {pid} read {got}: "
                           f"{os.strerror(err)}")


def available(comm) -> bool:
    """True if every rank of ``comm`` (a Communicator, all on one node) can read its peers'
    memory; collective on the first call per communicator, cached."""
    st = state(comm)
    if getattr(st, "cma_pids", None) is None:
        from hpcnn.parallel import shm
        ok, pids = 0, []
        if comm.size > 1 and _syscall() is not None and shm.node_of(comm) is not None:
            probe = numpy.array([comm.rank + 1], numpy.int64)
            pids = st.pcomm.allgather((os.getpid(), probe.__array_interface__["data"][0]))
            got = numpy.zeros(1, numpy.int64)
            q = (comm.rank + 1) % comm.size
            try:
                _read(pids[q][0], pids[q][1], got)
                ok = int(got[0] == q + 1)
            except OSError:
                ok = 0
            st.pcomm.Barrier()                              # the probes stay alive until read
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
                         f"the peers' memory (process_vm_readv); not so on these {comm.size} "
                         f"ranks")
    st, p, r = state(comm), comm.size, comm.rank
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
            ops = [mine if q == r else None for q in range(p)]      # rank order

            def operand(q, into):
                if ops[q] is not None:
                    return ops[q]
                _read(pids[q], int(addr[q]) + a * item, into[:m])
                return into[:m]
            total = operand(0, acc)                          # rank 0: its own chunk, in place
            for q in range(1, p):
                x = operand(q, tmp)
                numpy.add(total, x, out=mine if q == p - 1 else total)
    finally:
        st.pool.append(tmp)
    st.pcomm.Barrier()                                     # every slice is summed
    for q in range(p):
        if q != r and b[q + 1] > b[q]:
            _read(pids[q], int(addr[q]) + b[q] * item, flat[b[q]:b[q + 1]])
    st.pcomm.Barrier()                                     # peers are done reading my slice
