"""The optional C allreduce path: built where the MPI's mpicc is at hand, and equal to Python's."""
import importlib
import os
import sys

import pytest

from mpi_util import run_mpi

MPICC = os.path.join(os.path.dirname(sys.executable), "mpicc")


def built() -> bool:
    try:
        importlib.import_module("hpcnn.parallel._lean")
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not os.path.exists(MPICC), reason="no mpicc next to this Python")
def test_make_builds_the_c_path_when_mpicc_is_there():
    assert built(), "make test builds hpcnn/parallel/_lean (python -m hpcnn.parallel.lean_build)"


@pytest.mark.parametrize("n", [2, 3])
def test_c_and_python_paths_agree(n):
    out = run_mpi("lean_path", n, "1" if built() else "0", timeout=120)
    assert f"lean_path OK on {n} ranks" in out
