"""The parallel layouts under the strict device backend (tests/mpi/strict_layouts.py): data,
tensor and pipeline parallelism on 2 ranks each equal the same layout on NumPy bit for bit, their
device buffers reaching MPI only through the host staging path."""
from mpi_util import run_mpi


def test_dp_tp_pp_under_strict_equal_numpy(tmp_path):
    out = run_mpi("strict_layouts", 2, str(tmp_path), "dp", "tp", "pp", timeout=240)
    for layout in ("dp", "tp", "pp"):
        assert f"strict {layout}=2 OK" in out, out
