"""The naive data-parallel twin: equal to the bucketed engine (1e-12) and the serial run (1e-10)."""
import pytest

from mpi_util import run_mpi


@pytest.mark.parametrize("n", [2, 3])
def test_naive_equals_bucketed_and_serial_mpi(n):
    assert f"dp_naive OK on {n} ranks" in run_mpi("dp_naive", n, timeout=120)
