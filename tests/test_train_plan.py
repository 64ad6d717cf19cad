"""hpcnn train --plan (per-layer layouts of the MLP over the --tp ranks) against the serial run,
and its refusals."""
import pytest

from hpcnn.config import ConfigError, parse_overrides
from hpcnn.train import train
from mpi_util import run_mpi


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.long),
                               pytest.param(4, marks=pytest.mark.long)])
def test_planned_layouts_equal_the_serial_run(tmp_path, n):
    out = run_mpi("train_plan", n, str(tmp_path), timeout=300)
    assert f"train_plan OK on {n} ranks" in out


@pytest.mark.parametrize("extra,match", [
    (["--model=cnn"], "per-layer layouts are built for model='mlp'"),
    (["--dp=2"], "dp=1 and pp=1"),
    (["--tp=3", "--plan=auto"], "tp must be a power of two"),
    (["--clip=1"], "without clipping, checkpoints and remat"),
])
def test_refusals(tmp_path, extra, match):
    args = ["--model=mlp", "--plan=auto", f"--log={tmp_path / 'x.h5'}", "--progress=false"]
    with pytest.raises(ConfigError, match=match):
        train(parse_overrides(args + extra))


def test_a_bad_plan_file_is_refused_before_training(tmp_path):
    args = ["--model=mlp", f"--log={tmp_path / 'x.h5'}", "--progress=false"]
    with pytest.raises(ConfigError, match="nope.json.*cannot read the plan file"):
        train(parse_overrides(args + [f"--plan={tmp_path / 'nope.json'}"]))
    two = tmp_path / "two.json"
    two.write_text('{"devices": 1, "layers": [{"batch": 1, "reduce": 1, "out": 1}]}')
    with pytest.raises(ConfigError, match="1 layouts for the MLP's 3 Linear layers"):
        train(parse_overrides(args + [f"--plan={two}"]))
    assert not (tmp_path / "x.h5").exists()              # refused before the log was opened
