"""The training loop with --tp (and dp x tp) against the serial loop, under mpiexec."""
import pytest

from mpi_util import run_mpi


@pytest.mark.parametrize("n,tp", [(2, 2), pytest.param(4, 2, marks=pytest.mark.long)])
def test_training_loop_tensor_parallel_equals_serial(n, tp, tmp_path):
    out = run_mpi("train_tp", n, str(tmp_path), tp, timeout=300)
    assert f"train_tp OK on {n} ranks (dp={n // tp}, tp={tp})" in out
