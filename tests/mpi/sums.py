"""What the allreduce scenarios check sums with (imported by them; not a scenario itself): an
integer-valued pattern whose sum over ranks is exact in every dtype, and bitwise agreement."""
import numpy as np
from mpi4py import MPI


def pattern(n, dtype):
    """Rank r contributes (r + 1) * pattern: the sum is p (p + 1) / 2 * pattern, exactly."""
    return ((np.arange(n) * 7919) % 97 - 48).astype(dtype)


def same_everywhere(a, what, comm=MPI.COMM_WORLD):
    """Assert ``a`` has the same bytes on every rank of ``comm``."""
    b = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    allb = np.empty((comm.Get_size(), b.size), np.uint8)
    comm.Allgather(b, allb)
    assert (allb == allb[0]).all(), f"{what}: results differ across ranks"
