"""The training loop with --pp (every schedule, uneven stages, dp x pp, tp x pp) vs serial."""
import pytest

from hpcnn.config import ConfigError, parse_overrides
from mpi_util import run_mpi


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)])
def test_training_loop_pipeline_equals_serial(dp, tp, pp, tmp_path):
    n = dp * tp * pp
    out = run_mpi("train_pp", n, str(tmp_path), dp, tp, pp, timeout=400)
    assert f"train_pp OK on {n} ranks (dp={dp}, tp={tp}, pp={pp})" in out


def test_zb_v_config_errors():
    """ZB-V needs its two stages per rank, and splits backwards that remat cannot run."""
    ok = parse_overrides(["--pp=2", "--schedule=zb_v", "--virtual=2"]).resolved()
    assert ok.schedule == "zb_v"
    with pytest.raises(ConfigError, match=r"schedule='zb_v' with pp=2, virtual=1, microbatches=1: "
                                          r"the V placement \(zb_v\) puts two stages on each of "
                                          r"the 2 ranks: 2 stages given, 4 needed \(virtual=2\)"):
        parse_overrides(["--pp=2", "--schedule=zb_v"]).resolved()
    with pytest.raises(ConfigError, match=r"remat='sqrt' with schedule='zb_v': a rematerialized "
                                          r"stage runs its backward whole"):
        parse_overrides(["--pp=2", "--schedule=zb_v", "--virtual=2", "--remat=sqrt"]).resolved()
