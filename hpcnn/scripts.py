"""The harness of the scripts in experiments/, benchmarks/ and analysis/.

Every script builds its command line with :func:`parser` (argparse: ``--help``, and an
unknown option or a bad value refused as :func:`refuse` does), parses it in its ``main`` (never at
import), prints on rank 0 with :func:`say`, launches MPI jobs with :func:`mpi_command` and writes
its tables with :func:`write_tables`. The package is installed (``pip install -e .``), so a script
imports ``hpcnn`` like any other module, without editing ``sys.path``.

A boolean option follows ``hpcnn train``'s spelling (:func:`hpcnn.config.convert`): a bare
``--flag`` is true, ``--flag=false`` (or 0, no, off) and ``--no-flag`` are false.

MPI stays out of this module except through :mod:`hpcnn.cli` (a refusal under mpiexec).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
from hpcnn import to_stderr


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose refusal of the command line is :func:`refuse`'s: the usage and one
    line naming the bad value on every rank, exit 2 (under mpiexec, once every rank has printed).
    Its boolean options (:func:`flag`) also read ``--flag=true`` and ``--flag=false``."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.flags = set()

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        end = args.index("--") if "--" in args else len(args)
        return super().parse_known_args([self._spelled(a) for a in args[:end]] + args[end:],
                                        namespace)

    def _spelled(self, arg: str) -> str:
        """``--flag=false`` as ``--no-flag``, ``--flag=true`` as ``--flag``."""
        name, eq, raw = arg.partition("=")
        if not (eq and name.startswith("--") and name[2:] in self.flags):
            return arg
        try:
            return name if boolean(raw) else f"--no-{name[2:]}"
        except argparse.ArgumentTypeError as e:
            self.error(f"argument {name}: {e}")

    def error(self, message):
        refuse(f"{self.format_usage().rstrip()}\n{self.prog}: error: {message}")


def parser(doc: str | None, **kw) -> Parser:
    """A parser described by the first paragraph of ``doc`` (a script's ``__doc__``), its
    ``--help`` followed by the rest of ``doc`` as written."""
    head, _, rest = (doc or "").strip().partition("\n\n")
    kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return Parser(description=head or None, epilog=rest or None, **kw)


def figure_parser(doc: str | None, optional: bool = False) -> Parser:
    """:func:`parser` of an analysis script: positional ``results`` (an experiment's HDF5 file)
    and ``figure`` (the PNG to write; with ``optional``, may be left out)."""
    ap = parser(doc)
    ap.add_argument("results", help="the experiment's results (HDF5)")
    ap.add_argument("figure", nargs="?" if optional else None, default=None,
                    help="the figure to write (PNG)" + (" (optional)" if optional else ""))
    return ap


def boolean(raw: str) -> bool:
    """``true``/``false`` as ``hpcnn train`` reads them (1, yes, on / 0, no, off)."""
    from hpcnn.config import ConfigError, convert
    try:
        return convert("flag", str(raw), bool)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {raw!r}") from None


def flag(ap: Parser, name: str, default: bool = False, help: str = "") -> None:
    """A boolean option ``--name`` of ``ap``: bare or ``=true`` true, ``=false`` or ``--no-name``
    false (``hpcnn train``'s spellings of true and false: :func:`boolean`)."""
    dest = name.replace("-", "_")
    ap.add_argument(f"--{name}", dest=dest, action="store_true", default=default,
                    help=f"{help} (default {str(default).lower()}; --{name}=false or "
                         f"--no-{name}: false)".lstrip())
    ap.add_argument(f"--no-{name}", dest=dest, action="store_false", help=argparse.SUPPRESS)
    ap.flags.add(name)


def ints(raw: str) -> list[int]:
    """``1,2,8`` -> [1, 2, 8] (an argparse type)."""
    return [int(v) for v in raw.split(",") if v.strip()]


def floats(raw: str) -> list[float]:
    """``0,0.5,1`` -> [0.0, 0.5, 1.0] (an argparse type)."""
    return [float(v) for v in raw.split(",") if v.strip()]


def words(raw: str) -> list[str]:
    """``a,b`` -> ['a', 'b'] (an argparse type)."""
    return [v.strip() for v in raw.split(",") if v.strip()]


# ---------------------------------------------------------------- MPI jobs

def mpiexec() -> str:
    """The mpiexec next to this Python (the MPICH wheel's), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = local if os.path.exists(local) else shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec next to this Python nor on PATH: install the "
                                "'localmpi' extra or a system MPI")
    return found


@functools.lru_cache(maxsize=None)
def mpiexec_flags() -> tuple[str, ...]:
    """What :func:`mpiexec` needs to start more ranks than cores: ``--oversubscribe`` (and
    ``--allow-run-as-root``) for Open MPI's, nothing for MPICH's."""
    version = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout
    return ("--oversubscribe", "--allow-run-as-root") if "Open MPI" in version else ()


def mpi_command(ranks: int, args: list) -> list:
    """``mpiexec -n ranks python`` under the MPI launcher (``cli.LAUNCHER``) ``args...``: an
    exception on one rank ends the job."""
    from hpcnn import cli
    return [mpiexec(), *mpiexec_flags(), "-n", str(ranks), sys.executable, *cli.LAUNCHER,
            *map(str, args)]


def checkout_modules(root: str, *names: str) -> tuple:
    """The modules ``names`` (``hpcnn.log.runlog``, ...) of the hpcnn checkout at ``root``,
    imported afresh: the hpcnn modules loaded before are forgotten (the objects a caller holds
    keep working), so that two checkouts' copies can be timed side by side in one process."""
    for name in [m for m in sys.modules if m == "hpcnn" or m.startswith("hpcnn.")]:
        del sys.modules[name]
    spec = importlib.machinery.PathFinder.find_spec("hpcnn", [os.path.abspath(root)])
    if spec is None:
        raise ImportError(f"no hpcnn package in {root}")
    package = importlib.util.module_from_spec(spec)
    sys.modules["hpcnn"] = package
    spec.loader.exec_module(package)
    return tuple(importlib.import_module(name) for name in names)


# ---------------------------------------------------------------- output

def say(*parts, rank: int = 0, **kw) -> None:
    """``print`` on rank 0 only (``rank``: the caller's), flushed."""
    if rank == 0:
        print(*parts, flush=True, **kw)


def refuse(message: str, code: int = 2):
    """Refuse the input: ``message`` on stderr and exit ``code``. Under MPI (several ranks)
    through :func:`hpcnn.cli.refuse`, so that every rank's line is out before any rank exits;
    alike on every rank and before any collective. Never returns."""
    from hpcnn import cli
    if cli.mpi_ranks() > 1:
        cli.refuse(message, code)
    to_stderr(message)
    sys.exit(code)


def command_line() -> str:
    """The command line as run (for a results file's attributes)."""
    return " ".join(sys.argv)


def write_tables(path: str, tables: dict, attrs: dict | None = None) -> str:
    """Each ``name: rows`` of ``tables`` as a table of the HDF5 file ``path`` (its folder made),
    with ``attrs`` (:func:`hpcnn.log.results.save_table`); returns ``path``."""
    from hpcnn.log.results import save_table
    for name, rows in tables.items():
        save_table(path, name, rows, attrs)
    return path
