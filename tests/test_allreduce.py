"""Allreduce algorithms (ring, rd, auto, non-blocking ring) under mpiexec on 2, 3 and 4 ranks."""
import pytest

from hpcnn.parallel.allreduce import _split

from mpi_util import run_mpi


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_algorithms(n):
    assert f"OK on {n} ranks" in run_mpi("allreduce_algos", n, timeout=90)


@pytest.mark.parametrize("n,parts", [(0, 3), (1, 4), (7, 3), (100003, 4), (8, 8)])
def test_split_is_exact(n, parts):
    b = _split(n, parts)
    sizes = [b[i + 1] - b[i] for i in range(parts)]
    assert b[0] == 0 and b[-1] == n and max(sizes) - min(sizes) <= 1
