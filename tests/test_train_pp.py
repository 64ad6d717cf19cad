"""The training loop with --pp (every schedule, uneven stages, dp x pp, tp x pp) vs serial."""
import pytest

from mpi_util import run_mpi


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)])
def test_training_loop_pipeline_equals_serial(dp, tp, pp, tmp_path):
    n = dp * tp * pp
    out = run_mpi("train_pp", n, str(tmp_path), dp, tp, pp, timeout=400)
    assert f"train_pp OK on {n} ranks (dp={dp}, tp={tp}, pp={pp})" in out
