"""The scripts under experiments/, benchmarks/ and analysis/ share one harness (hpcnn.scripts):
each answers ``--help``, none edits ``sys.path`` or finds mpiexec on its own; and the harness
itself: boolean options spelled as ``hpcnn train`` spells them, refusals, the mpiexec command."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from hpcnn import scripts
from mpi_util import ROOT

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py"))
                 + glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                 + glob.glob(os.path.join(ROOT, "analysis", "*.py")))


def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_every_script_answers_help():
    """``SCRIPT --help`` prints a usage and exits 0, for every script: run as ``__main__`` by
    tests/_help_all.py, all in one process (NumPy, hpcnn and MPI imported once), in 2 processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runner = os.path.join(ROOT, "tests", "_help_all.py")
    halves = [SCRIPTS[0::2], SCRIPTS[1::2]]
    jobs = [subprocess.Popen([sys.executable, runner, *half], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            for half in halves]
    done = {}
    for job in jobs:
        stdout, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr[-3000:]
        done.update(json.loads(stdout.strip().splitlines()[-1]))
    assert len(SCRIPTS) >= 40 and sorted(done) == SCRIPTS
    bad = {os.path.relpath(k, ROOT): (code, err) for k, (code, out, err) in done.items()
           if code != 0 or not out.startswith("usage:")}
    assert not bad, bad


def test_no_script_edits_sys_path_or_finds_mpiexec_itself():
    for path in SCRIPTS:
        text = _source(path)
        name = os.path.relpath(path, ROOT)
        assert not re.search(r"sys\.path\.(insert|append)", text), name
        assert not re.search(r"def mpiexec\b|[\"']mpiexec[\"']\)|\(BIN, [\"']mpiexec", text), name
        assert "import plan_validation" not in text, name      # hpcnn.plan.validation now
        assert "parse_args(" not in text or "def main(" in text, name


def test_boolean_options_read_as_hpcnn_train_reads_them():
    ap = scripts.parser("A test.\n\nMore text.")
    scripts.flag(ap, "tiny", False, "small")
    scripts.flag(ap, "overlap", True, "overlap")
    ap.add_argument("path", nargs="?")
    assert vars(ap.parse_args([])) == {"tiny": False, "overlap": True, "path": None}
    assert vars(ap.parse_args(["--tiny", "p.h5"])) == {"tiny": True, "overlap": True,
                                                       "path": "p.h5"}
    for raw, want in (("true", True), ("1", True), ("yes", True), ("ON", True),
                      ("false", False), ("0", False), ("no", False), ("off", False)):
        assert ap.parse_args([f"--tiny={raw}"]).tiny is want
        assert ap.parse_args([f"--overlap={raw}"]).overlap is want
    assert ap.parse_args(["--no-overlap"]).overlap is False
    assert "More text." in ap.format_help() and "A test." in ap.format_help()


def test_refusals_name_the_value_and_exit_2(capsys):
    ap = scripts.parser("A test.")
    scripts.flag(ap, "tiny")
    ap.add_argument("--rounds", type=int, default=3)
    for argv, words in ((["--tiny=maybe"], "'maybe'"), (["--rounds=x"], "'x'"),
                        (["--bogus=1"], "--bogus=1")):
        with pytest.raises(SystemExit) as e:
            ap.parse_args(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        scripts.refuse("no such file: x.h5")
    assert e.value.code == 2 and capsys.readouterr().err == "no such file: x.h5\n"


def test_list_types_and_the_figure_parser():
    assert scripts.ints("1,2,8") == [1, 2, 8] and scripts.floats("0,0.5") == [0.0, 0.5]
    assert scripts.words("a, b,") == ["a", "b"]
    a = scripts.figure_parser("Figure.").parse_args(["r.h5", "f.png"])
    assert (a.results, a.figure) == ("r.h5", "f.png")
    assert scripts.figure_parser("Figure.", optional=True).parse_args(["r.h5"]).figure is None


def test_mpi_command_is_the_mpiexec_next_to_python_else_on_path(monkeypatch, tmp_path):
    cmd = scripts.mpi_command(2, ["x.py", "--a=1"])
    assert cmd[0] == scripts.mpiexec() and os.path.exists(cmd[0])
    assert cmd[cmd.index("-n"):] == ["-n", "2", sys.executable, "-m", "mpi4py", "x.py", "--a=1"]
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError):
        scripts.mpiexec()
    (tmp_path / "mpiexec").write_text("#!/bin/sh\n")
    (tmp_path / "mpiexec").chmod(0o755)
    assert scripts.mpiexec() == str(tmp_path / "mpiexec")


def test_write_tables_makes_the_folder(tmp_path):
    from hpcnn.log.results import load_table
    path = scripts.write_tables(str(tmp_path / "a" / "b.h5"), {"t": [{"x": 1}, {"x": 2}]},
                                {"command_line": scripts.command_line()})
    t, attrs = load_table(path, "t")
    assert list(t["x"]) == [1, 2] and "command_line" in attrs
