"""Build the optional C fast path of ``Communicator.allreduce`` (``_lean.c``) in place.

    python -m hpcnn.parallel.collectives.lean_build [--mpicc=PATH] [--quiet]

It compiles with the MPI compiler wrapper of the MPI that mpi4py uses (``mpicc`` next to this
Python, else on ``PATH``, else ``$MPICC``), against Python's and mpi4py's headers, into
``hpcnn/parallel/collectives/_lean<EXT_SUFFIX>``. ``make test`` runs it after installing; on a
cluster, run it once in the environment that has the site's MPI loaded. Without the module hpcnn works the
same, with the allreduce wrapper written in Python (a little slower per call:
docs/results/collectives.md). Exit status 0 when built, 1 when it could not be (the reason is
printed).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))


def _mpicc(explicit: str | None) -> str | None:
    for cand in (explicit, os.path.join(os.path.dirname(sys.executable), "mpicc"),
                 os.environ.get("MPICC"), "mpicc"):
        path = cand if cand and os.path.isabs(cand) else shutil.which(cand) if cand else None
        if path and os.path.exists(path):
            return path
    return None


def target() -> str:
    return os.path.join(HERE, "_lean" + sysconfig.get_config_var("EXT_SUFFIX"))


def build(mpicc: str | None = None, quiet: bool = False) -> str:
    """Compile ``_lean.c``; returns the module path, raises RuntimeError with the reason."""
    import mpi4py
    cc = _mpicc(mpicc)
    if cc is None:
        raise RuntimeError("no MPI compiler wrapper (mpicc) found next to Python, in $MPICC "
                           "or on PATH")
    out = target()
    cmd = [cc, "-O2", "-shared", "-fPIC", "-Wall",
           "-I" + sysconfig.get_paths()["include"], "-I" + mpi4py.get_include(),
           os.path.join(HERE, "_lean.c"), "-o", out + ".tmp"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
    os.replace(out + ".tmp", out)
    if not quiet and proc.stderr.strip():
        print(proc.stderr.strip(), file=sys.stderr)
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    mpicc = next((a.split("=", 1)[1] for a in args if a.startswith("--mpicc=")), None)
    quiet = "--quiet" in args
    try:
        path = build(mpicc, quiet)
    except Exception as e:   # noqa: BLE001 - any failure means: run without the fast path
        print(f"hpcnn: optional C allreduce path not built ({e}); the Python path is used",
              file=sys.stderr)
        return 1
    if not quiet:
        print(f"hpcnn: built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
