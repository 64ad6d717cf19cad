"""Grid and collectives under mpiexec on 2 and 4 ranks (4: make test-long; tests/test_topology.py
runs them on 4 ranks over emulated nodes in make test)."""
import pytest

from mpi_util import run_mpi


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.long)])
def test_grid_and_collectives(n):
    assert f"OK on {n} ranks" in run_mpi("grid_collectives", n)
