"""The ``hpcnn`` command line: the list of commands, ``--version``, each command's ``--help``,
true/false options written alone (``--json``, ``--no-progress``) in every command, a bare option
that needs a value refused by name, and ``hpcnn plan`` on this machine's file by default."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

import hpcnn
from hpcnn import cli, cli_tools
from hpcnn.config import TrainConfig, parse_overrides
from mpi_util import ROOT

TOOLS = {"plan": cli_tools.PLAN, "simulate": cli_tools.SIMULATE, "calibrate": cli_tools.CALIBRATE}
SMALL_GPT = ["--n_layers=2", "--dim=64", "--n_heads=4", "--seq=32", "--vocab=65", "--batch=8",
             "--top=2"]


def _hpcnn(*args, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "hpcnn", *args], capture_output=True, text=True,
                          env=e, timeout=120, cwd=ROOT)


def test_help_lists_every_command_and_version_exits_0():
    p = _hpcnn("--help")
    assert p.returncode == 0 and p.stderr == ""
    listed = {}
    for line in p.stdout.splitlines():
        words = line.split()
        if line.startswith("  ") and words and words[0] in cli.COMMANDS:
            listed[words[0]] = line
    assert set(listed) == set(cli.COMMANDS) == {name for name, _, _ in cli.SUBCOMMANDS}
    assert all(len(line.split("  ")[-1].strip()) > 10 for line in listed.values()), listed
    p = _hpcnn("--version")
    assert (p.returncode, p.stdout, p.stderr) == (0, f"hpcnn {hpcnn.__version__}\n", "")
    p = _hpcnn()                                       # no command: the list, and an error
    assert p.returncode == 2 and "commands:" in p.stderr


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_has_help(name, capsys):
    assert cli.main([name, "--help"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("usage:") and f"hpcnn {name}" in out.out.splitlines()[0], out.out
    assert out.err == ""


def test_info_refuses_arguments(capsys):
    assert cli.main(["info", "--json"]) == 2
    assert "usage: hpcnn info" in capsys.readouterr().err


def _bools(cls=TrainConfig):
    return [f.name for f in dataclasses.fields(cls) if f.type in (bool, "bool")]


def test_train_flags_alone_are_true_and_no_flag_false():
    names = _bools()
    assert {"overlap", "progress", "show_schedule", "half_layers"} <= set(names)
    for name in names:
        default = getattr(TrainConfig(), name)
        assert getattr(parse_overrides([f"--{name}"]), name) is True, name
        assert getattr(parse_overrides([f"--no-{name}"]), name) is False, name
        assert getattr(parse_overrides([f"--{name}=false"]), name) is False, name
        assert getattr(parse_overrides([f"--{name}=true"]), name) is True, name
        assert getattr(parse_overrides([]), name) is default, name
    c = parse_overrides(["--show-schedule", "--no-overlap", "--no_progress"])
    assert (c.show_schedule, c.overlap, c.progress) == (True, False, False)


def test_train_refuses_a_bare_valued_option_in_one_line():
    p = _hpcnn("train", "--model=mlp", "--steps")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "hpcnn train: --steps needs a value (--steps=VALUE)\n"


def test_tools_read_flags_as_train_does():
    """Every true/false option of the tools is typed bool (so it stands alone), and a bare
    option that takes a value is refused by name."""
    for command, spec in TOOLS.items():
        for key, (default, typ, _) in spec.items():
            assert isinstance(default, bool) == (typ is bool), (command, key)
            if typ is bool:
                assert cli_tools._options([f"--{key}"], spec, command)[0][key] is True
                assert cli_tools._options([f"--no-{key}"], spec, command)[0][key] is False
                assert cli_tools._options([f"--{key}=false"], spec, command)[0][key] is False
            else:
                out, err = cli_tools._options([f"--{key}"], spec, command)
                assert out is None and err == (f"hpcnn {command}: --{key} needs a value "
                                               f"(--{key}=VALUE)")
    out, err = cli_tools._options(["--json=maybe"], cli_tools.PLAN, "plan")
    assert out is None and err == "hpcnn plan: --json='maybe' is not a bool"


def test_plan_json_alone_and_this_machine_by_default():
    """``hpcnn plan --json`` prints JSON (it once answered 'unknown option'); without
    ``--machine`` it plans on the file ``hpcnn train`` would use ($HPCNN_MACHINE here)."""
    gpu = os.path.join(ROOT, "machines", "dgx-a100-cluster.toml")
    p = _hpcnn("plan", "--json", "--devices=8", *SMALL_GPT, env={"HPCNN_MACHINE": gpu})
    assert p.returncode == 0, p.stderr
    bare = json.loads(p.stdout)
    assert bare["machine"] == "dgx-a100-cluster" and bare["devices"] == 8
    named = _hpcnn("plan", "--json=true", f"--machine={gpu}", "--devices=8", *SMALL_GPT)
    assert named.returncode == 0, named.stderr
    named = json.loads(named.stdout)
    assert [r["layout"] for r in named["ranked"]] == [r["layout"] for r in bare["ranked"]]
    text = _hpcnn("plan", "--no-json", "--devices=8", *SMALL_GPT, env={"HPCNN_MACHINE": gpu})
    assert text.returncode == 0 and "winner:" in text.stdout, text.stderr


def test_plan_without_machine_uses_this_machine(monkeypatch, capsys):
    from hpcnn.plan import machine
    monkeypatch.delenv(machine.ENV, raising=False)
    assert cli_tools.cmd_plan(["--json", *SMALL_GPT]) == 0
    out = json.loads(capsys.readouterr().out)
    here = machine.this_machine()
    assert out["machine"] == here.name and out["devices"] == here.p
    assert cli_tools.cmd_plan(["--top"]) == 2
    assert capsys.readouterr().err == "hpcnn plan: --top needs a value (--top=VALUE)\n"
