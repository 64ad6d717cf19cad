"""The parallel layouts under the strict device backend (tests/mpi/strict_layouts.py): data,
tensor and pipeline parallelism and ZeRO-1/2/3 on 2 ranks each equal the same layout on NumPy bit
for bit, their device buffers reaching MPI only through the host staging path."""
from mpi_util import run_mpi


def test_dp_tp_pp_zero_under_strict_equal_numpy(tmp_path):
    layouts = ("dp", "tp", "pp", "zero1", "zero2", "zero3")
    out = run_mpi("strict_layouts", 2, str(tmp_path), *layouts, timeout=240,
                  env={"HPCNN_STRICT_DEVICES": "2"})          # a device each
    for layout in layouts:
        assert f"strict {layout}=2 OK" in out, out
