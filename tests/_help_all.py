"""Run each script given on the command line as ``SCRIPT --help`` in this one process (as
``python SCRIPT --help`` would: ``__main__``, its folder first on sys.path) and print one JSON
line {script: [exit code, stdout, the end of stderr and of any traceback]}; one interpreter
imports NumPy, hpcnn and MPI once for all of them (tests/test_scripts.py)."""
import contextlib
import io
import json
import os
import runpy
import sys
import traceback

got = {}
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    before = set(sys.modules)
    sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            code, _ = 1, traceback.print_exc()
    for name in set(sys.modules) - before:          # a script's sibling (graph_features) is its
        if not name.startswith(("hpcnn", "mpi4py", "numpy", "scipy", "h5py", "matplotlib")):
            del sys.modules[name]                   # own: experiments/ and analysis/ have one each
    got[path] = [code, out.getvalue(), err.getvalue()[-1500:]]
print(json.dumps(got))
