"""The training loop with --pp (every schedule, uneven stages, dp x pp, tp x pp) vs serial."""
import pytest

from hpcnn.config import ConfigError, parse_overrides
from mpi_util import CaseRuns

LAYOUTS = [(2, 1, 2)]                     # make test: dp x pp (pp's cases, each with dp = 2)
# make test-long: pp alone (the same cases at dp = 1), 4 stages, and tp x pp
LONG_LAYOUTS = [(1, 1, 2), (1, 1, 4), (1, 2, 2)]


def _case_runs(tmp_path_factory, layouts, name):
    return CaseRuns([(dp * tp * pp, "train_pp", (CaseRuns.FOLDER, dp, tp, pp))
                     for dp, tp, pp in layouts],
                    folder=tmp_path_factory.mktemp(name), timeout=400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _case_runs(tmp_path_factory, LAYOUTS, "train_pp")


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """The layouts of make test-long (those of 4 ranks share one job: one start-up per rank),
    apart from make test's, so that make test does not start them."""
    return _case_runs(tmp_path_factory, LONG_LAYOUTS, "train_pp_long")


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS + [pytest.param(*layout, marks=pytest.mark.long)
                                                for layout in LONG_LAYOUTS])
def test_training_loop_pipeline_equals_serial(dp, tp, pp, request):
    n = dp * tp * pp
    runs = request.getfixturevalue("long_runs" if (dp, tp, pp) in LONG_LAYOUTS else "runs")
    out = runs.stdout(n, "train_pp", CaseRuns.FOLDER, dp, tp, pp)
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
