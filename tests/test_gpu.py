"""GPUs without a GPU (hpcnn/parallel/collectives/gpu.py, device_paths.py), under the strict
backend: --gpu_comm's choice and refusals, the device binding by node-local rank and its
refusal, `hpcnn info`'s GPU lines, the operand layouts of the 16-bit GEMM; on 2 ranks
(tests/mpi/gpu_comm.py) every path's collectives and dp/tp training against NumPy, with their
host transfers counted, the NCCL path over a test double of cupy.cuda.nccl."""
import subprocess
import sys

import numpy as np
import pytest

from hpcnn import backend, strict
from hpcnn.config import ConfigError, parse_overrides
from hpcnn.parallel.collectives import gpu

from mpi_util import ROOT, mpiexec, run_mpi


def test_paths_and_their_refusals():
    assert gpu.choose("auto", "cpu", (False, "")) == "staged"
    with pytest.raises(gpu.DeviceRefusal, match="gpu_comm='nccl' with device='cpu'"):
        gpu.choose("nccl", "cpu", (True, ""))
    backend.set_device("strict")
    try:
        assert gpu.choose("auto", "strict", (False, "x")) == "staged"
        assert gpu.choose("auto", "strict", (True, "x")) == "mpi"
        with pytest.raises(gpu.DeviceRefusal, match="this CuPy has no NCCL"):
            gpu.choose("nccl", "strict", (True, "x"))
        with pytest.raises(gpu.DeviceRefusal, match=r"not CUDA-aware \(the library said no\)"):
            gpu.choose("mpi", "strict", (False, "the library said no"))
        strict.cuda.nccl = object()                  # any module there: NCCL "available"
        assert gpu.choose("auto", "strict", (False, "x")) == "nccl"
    finally:
        strict.cuda.nccl = None
        backend.set_device("cpu")
    with pytest.raises(ConfigError, match="gpu_comm='mpi' with device='cpu'"):
        parse_overrides(["--gpu_comm=mpi"]).resolved()


def test_cuda_aware_detection_and_its_override(monkeypatch):
    monkeypatch.setenv("HPCNN_CUDA_AWARE", "1")
    assert gpu.cuda_aware() == (True, "HPCNN_CUDA_AWARE=1")
    monkeypatch.setenv("HPCNN_CUDA_AWARE", "0")
    assert gpu.cuda_aware()[0] is False
    monkeypatch.delenv("HPCNN_CUDA_AWARE")
    aware, how = gpu.cuda_aware()        # this MPICH answers MPIX_Query_cuda_support: 0
    assert aware is False and "MPIX_Query_cuda_support" in how, how


def test_strict_devices_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("HPCNN_STRICT_DEVICES", "4")
    rt = strict.cuda.runtime
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert rt.getDeviceCount() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert rt.getDeviceCount() == 1 and strict.cuda.Device(0).pci_bus_id == "strict:2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,7,0")       # CUDA stops at 7
    assert rt.getDeviceCount() == 2 and strict.cuda.Device(1).pci_bus_id == "strict:1"


def test_a_serial_run_binds_device_0_and_info_names_the_devices(monkeypatch):
    monkeypatch.setenv("HPCNN_STRICT_DEVICES", "3")
    backend.set_device("strict")
    try:
        setup = gpu.start("strict", "auto", False, None)
        assert (setup["device"], setup["visible"], setup["gpu_comm"]) == (0, 3, "staged")
        lines = gpu.info_lines()
        assert lines[0].startswith("GPUs: 3 visible") and "GPU 2: strict device 2" in lines[3]
        assert lines[-1].startswith("CUDA-aware MPI: no"), lines
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        with pytest.raises(gpu.DeviceRefusal, match="no GPU visible"):
            gpu.start("strict", "auto", False, None)
    finally:
        backend.set_device("cpu")
    out = subprocess.run([sys.executable, "-m", "hpcnn", "info"], capture_output=True,
                         text=True, cwd=ROOT, check=True).stdout
    assert "GPUs: no CuPy" in out and "CUDA-aware MPI: no" in out, out


def _train(n, *args, env=None):
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcnn", "train",
           "--device=strict", "--model=mlp", "--hidden=8", "--steps=1", "--batch_size=8",
           "--progress=false", *args]
    import os
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=120)


@pytest.mark.long     # ~4 s of four 2-rank runs; make test binds devices serially, through
# jobs/gpu_bind.sh and under every --gpu_comm path (below)
def test_ranks_outnumbering_a_nodes_devices_are_refused_unless_shared(tmp_path):
    log = f"--log={tmp_path}/a.h5"
    p = _train(2, "--dp=2", log, env={"HPCNN_STRICT_DEVICES": "1"})
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [x for x in p.stderr.splitlines() if x.startswith("hpcnn train")]
    assert len(lines) == 1 and "2 ranks of a node (0, 1) on 1 GPU(s)" in lines[0] \
        and "--share_gpus=true" in lines[0], p.stderr
    for env, extra in (({"HPCNN_STRICT_DEVICES": "1"}, ["--share_gpus=true"]),
                       ({"HPCNN_STRICT_DEVICES": "2"}, [])):
        p = _train(2, "--dp=2", log, *extra, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
    p = _train(2, "--dp=2", log, "--gpu_comm=mpi", env={"HPCNN_STRICT_DEVICES": "2",
                                                          "HPCNN_CUDA_AWARE": "0"})
    assert p.returncode == 2 and "gpu_comm='mpi': this MPI is not CUDA-aware" in p.stderr, \
        p.stderr


def test_launcher_binding_one_visible_device_a_rank(tmp_path):
    """jobs/gpu_bind.sh gives each rank CUDA_VISIBLE_DEVICES=<its local rank>: one device each,
    different ones, so 2 ranks on a node of 2 devices run without --share_gpus."""
    cmd = [mpiexec(), "-n", "2", f"{ROOT}/jobs/gpu_bind.sh", sys.executable, "-m", "mpi4py",
           "-m", "hpcnn", "train", "--device=strict", "--model=mlp", "--hidden=8", "--steps=1",
           "--batch_size=8", "--progress=false", "--dp=2", f"--log={tmp_path}/b.h5"]
    import os
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HPCNN_STRICT_DEVICES="2")
    e.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_gemm_operand_layouts_give_the_product():
    """cuBLAS's column-major C^T = op(B^T) op(A^T), emulated on the operands' memory as
    backend.gemm_operand describes it, equals a @ b for C- and F-contiguous operands."""
    rng = np.random.default_rng(0)
    for a, b in [(rng.random((3, 4)), rng.random((4, 5))),
                 (rng.random((4, 3)).T, rng.random((5, 4)).T)]:
        ops = []
        for x in (b, a):
            op, ld = backend.gemm_operand(x.shape, x.flags.c_contiguous, x.flags.f_contiguous)
            mem = np.ascontiguousarray(x) if op == "N" else np.ascontiguousarray(x.T)
            cols = mem.reshape(-1, ld).T                 # the column-major matrix, ld rows
            ops.append(cols if op == "N" else cols.T)
        ct = ops[0] @ ops[1]                             # (n, m) column-major = C^T
        np.testing.assert_allclose(ct.T, a @ b)
    assert backend.gemm_operand((3, 4), False, False) is None


def test_every_gpu_comm_path_under_strict_on_2_ranks(tmp_path):
    out = run_mpi("gpu_comm", 2, str(tmp_path), "collectives", "train", timeout=240)
    assert "gpu_comm collectives OK" in out, out
    for layout in ("dp", "tp"):
        assert f"gpu_comm {layout}=2 OK" in out, out


@pytest.mark.long     # ~12 s: its checks, one by one, are this file's and test_strict*.py's
def test_the_gpu_check_runs_green_under_strict():
    """`make gpu-check` without a GPU: benchmarks/gpu_check.py under the strict backend, every
    check a PASS line (a FAIL makes it exit 1), the throughput line last."""
    import os
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"),
                        "--device=strict"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("gpu-check on strict"), p.stdout
    checks = [x for x in lines if x.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert len(checks) == 11 and all(x.startswith("PASS") for x in checks), p.stdout
    for name in ("blocks", "serial GPT", "dp=2", "tp=2", "pp=2", "zero=1", "zero=2", "zero=3",
                 "bf16", "fp16", "throughput"):
        assert any(name in x for x in checks), (name, p.stdout)
    assert "tokens/s" in checks[-1] and "of peak" in checks[-1], checks[-1]
    assert lines[-1].startswith("gpu-check: 11 passed, 0 failed"), lines[-1]
