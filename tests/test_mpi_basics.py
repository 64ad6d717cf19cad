"""Grid and collectives under mpiexec on 2 and 4 ranks."""
import pytest

from mpi_util import run_mpi


@pytest.mark.parametrize("n", [2, 4])
def test_grid_and_collectives(n):
    assert f"OK on {n} ranks" in run_mpi("grid_collectives", n)
