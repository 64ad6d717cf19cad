"""TEST DOUBLE of ``cupy.cuda.nccl`` (not shipped, tests only): the part of its interface hpcnn
calls (``get_unique_id``, ``NcclCommunicator(ndev, commId, rank)`` with ``allReduce``,
``allGather``, ``reduceScatter``, ``destroy``; the ``NCCL_*`` enums of nccl.h), implemented over
mpi4py on host memory, so that the NCCL path of hpcnn/parallel/collectives/device_paths.py runs
under the strict backend (whose device arrays are host memory: ``a.data.ptr`` is a real
address). It checks the call sites as NCCL would see them and records every call in
:data:`CALLS` (pointers, counts, datatype codes, stream handles) for the scenario to inspect.

Constraint of the double (not of NCCL): every world rank makes its communicators in the same
order, since each is a split of ``MPI.COMM_WORLD`` by its unique id (hpcnn's context does: dp,
then tp, on every rank). Install it with ``hpcnn.strict.cuda.nccl = nccl_double``.
"""
import ctypes
import os

import numpy as np
from mpi4py import MPI

available = True
NCCL_SUM = 0                                           # ncclRedOp_t
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8     # ncclDataType_t
_DTYPES = {NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
CALLS = []                 # ("allReduce", sendptr, recvptr, count, datatype, stream), ...
UIDS = []                  # the ids this process made


def get_unique_id():
    """A fresh id: a tuple of 128 small ints, as CuPy returns ncclUniqueId's bytes."""
    uid = tuple(int(b) for b in os.urandom(128))
    UIDS.append(uid)
    return uid


def _view(ptr: int, count: int, code: int) -> np.ndarray:
    """``count`` elements of NCCL type ``code`` at address ``ptr`` (no copy)."""
    if code not in _DTYPES:
        raise TypeError(f"nccl double: datatype code {code} not handled (float32 = 7, "
                        f"float64 = 8)")
    dt = np.dtype(_DTYPES[code])
    return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(ptr), dt, count)


class NcclCommunicator:
    """One rank of an NCCL communicator of ``ndev`` ranks joined with id ``commId``."""

    def __init__(self, ndev: int, commId, rank: int):
        if not (isinstance(commId, tuple) and len(commId) == 128):
            raise TypeError(f"nccl double: commId must be get_unique_id()'s 128-tuple, got "
                            f"{type(commId).__name__}")
        color = int.from_bytes(bytes(commId[:4]), "little") & 0x3FFFFFFF
        self.comm = MPI.COMM_WORLD.Split(color, rank)
        if (self.comm.Get_size(), self.comm.Get_rank()) != (ndev, rank):
            raise RuntimeError(f"nccl double: joined as rank {rank} of {ndev}, found rank "
                               f"{self.comm.Get_rank()} of {self.comm.Get_size()}")
        if len(set(self.comm.allgather(commId))) != 1:
            raise RuntimeError("nccl double: the ranks joined with different unique ids")
        CALLS.append(("init", ndev, rank))

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        assert op == NCCL_SUM, op
        CALLS.append(("allReduce", sendbuf, recvbuf, count, datatype, stream))
        r = _view(recvbuf, count, datatype)
        s = MPI.IN_PLACE if sendbuf == recvbuf else _view(sendbuf, count, datatype)
        self.comm.Allreduce(s, r, op=MPI.SUM)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        CALLS.append(("allGather", sendbuf, recvbuf, count, datatype, stream))
        self.comm.Allgather(_view(sendbuf, count, datatype),
                            _view(recvbuf, count * self.comm.Get_size(), datatype))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        assert op == NCCL_SUM, op
        CALLS.append(("reduceScatter", sendbuf, recvbuf, recvcount, datatype, stream))
        self.comm.Reduce_scatter_block(
            _view(sendbuf, recvcount * self.comm.Get_size(), datatype),
            _view(recvbuf, recvcount, datatype), op=MPI.SUM)

    def destroy(self):
        CALLS.append(("destroy",))
        self.comm.Free()
