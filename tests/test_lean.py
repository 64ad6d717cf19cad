"""The optional C allreduce path: built where the MPI's mpicc is at hand, and equal to Python's."""
import importlib
import os
import sys

import pytest

from mpi_util import run_mpi

MPICC = os.path.join(os.path.dirname(sys.executable), "mpicc")


def built() -> bool:
    try:
        importlib.import_module("hpcnn.parallel.collectives._lean")
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not os.path.exists(MPICC), reason="no mpicc next to this Python")
def test_make_builds_the_c_path_when_mpicc_is_there():
    assert built(), ("make test builds hpcnn/parallel/collectives/_lean "
                     "(python -m hpcnn.parallel.collectives.lean_build)")


@pytest.mark.parametrize("n", [2, 3])
def test_c_and_python_paths_agree(n):
    out = run_mpi("lean_path", n, "1" if built() else "0", timeout=120)
    assert f"lean_path OK on {n} ranks" in out


@pytest.mark.long     # ~5 s of pip; make test builds the extension itself (the Makefile's
# lean_build) and compares its path with Python's above
@pytest.mark.skipif(not os.path.exists(MPICC), reason="no mpicc next to this Python")
def test_an_installed_wheel_carries_the_c_source_and_builds_it(tmp_path):
    """A non-editable install: the wheel holds _lean.c, and lean_build compiles it in place
    (exit 0); with a compiler that fails, it says so and exits 1 (never a silent 0)."""
    import subprocess
    import zipfile
    import shutil
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = tmp_path / "src"              # a copy: the build writes build/ and egg-info beside it
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(root, name), src / name)
    shutil.copytree(os.path.join(root, "hpcnn"), src / "hpcnn",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", ".lean-built"))
    run = dict(capture_output=True, text=True, timeout=240)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)], **run)
    assert p.returncode == 0, p.stderr
    wheel, = (tmp_path / "dist").glob("hpcnn-*.whl")
    assert "hpcnn/parallel/collectives/_lean.c" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--target", str(site), str(wheel)], **run)
    assert p.returncode == 0, p.stderr
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run([sys.executable, "-m", "hpcnn.parallel.collectives.lean_build"],
                       cwd=tmp_path, env=env, **run)
    assert p.returncode == 0 and "built" in p.stdout, p.stdout + p.stderr
    built_in = site / "hpcnn" / "parallel" / "collectives"
    assert list(built_in.glob("_lean*.so")), "module not next to the package"
    p = subprocess.run([sys.executable, "-m", "hpcnn.parallel.collectives.lean_build",
                        "--mpicc=/bin/false"], cwd=tmp_path, env=env, **run)
    assert p.returncode == 1 and "not built" in p.stderr, p.stdout + p.stderr
