"""Docstrings stay short: no module docstring of ``hpcnn/`` and no function or class docstring
over :data:`MAX_LINES` lines.

A module docstring says what the module owns and how to use it; measured figures, this machine's
timings and history belong on the pages of docs/results/, with the command and the machine that
gave them. Lines are counted from the opening to the closing quotes, read with ``ast`` (nothing
is imported).
"""
import ast
import os

from mpi_util import ROOT

PACKAGE = os.path.join(ROOT, "hpcnn")
MAX_LINES = 40

# Docstrings allowed over the limit, path relative to the repository root (with ":name" for a
# function or class) -> why. Any entry whose docstring is no longer over the limit (or whose file
# is gone) fails the test too, so that the list stays exact.
ALLOWED: dict = {}


def docstring_lengths():
    """(where, lines) for every module, function and class docstring of the package."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), filename=path)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                                         ast.ClassDef)):
                    continue
                if ast.get_docstring(node, clean=False) is None:
                    continue
                first = node.body[0]
                where = rel if isinstance(node, ast.Module) else f"{rel}:{node.name}"
                found.append((where, first.end_lineno - first.lineno + 1))
    return found


def test_the_package_has_docstrings_to_check():
    lengths = docstring_lengths()
    assert sum(1 for where, _ in lengths if ":" not in where) > 50     # module docstrings seen


def test_no_docstring_over_the_limit():
    over = {where: n for where, n in docstring_lengths() if n > MAX_LINES}
    unexpected = {w: n for w, n in over.items() if w not in ALLOWED}
    assert not unexpected, (
        f"docstrings over {MAX_LINES} lines: {unexpected}; say what the module owns and how to use "
        "it, and move measurements and history to docs/results/")
    stale = sorted(set(ALLOWED) - set(over))
    assert not stale, f"ALLOWED entries no longer over {MAX_LINES} lines (remove them): {stale}"
