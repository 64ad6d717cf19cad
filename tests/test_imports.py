"""The package's import graph has no cycle, and ``hpcnn/log/`` stays below the parallel layers.

The graph is read statically from the source (``ast``), not by importing: a node is a module of
``hpcnn/`` (``hpcnn.parallel.tensor``; a package is its ``__init__``), and an edge A -> B is an
``import B`` / ``from B import x`` / ``from . import B`` written anywhere in A, at module level or
inside a function or a class. Function-level (lazy) imports count: they hide a cycle from the
interpreter at load time, but the two modules still depend on each other, and "no import cycle"
means that no module needs, however late, a module that needs it back.

Not counted: the implicit import of the parent packages (``import hpcnn.nn.core`` also runs
``hpcnn/nn/__init__.py``). A package that re-exports its submodules would otherwise be in a
cycle with each of them, which is the normal shape of a package, not a layering fault.
"""
import ast
import os

import networkx as nx

from mpi_util import ROOT

PACKAGE = os.path.join(ROOT, "hpcnn")

# The cycles the code still has, each as its sorted module names: none. Any cycle fails the test,
# and so does an entry here whose cycle has gone, so that the list stays exact.
ALLOWED_CYCLES: set = set()


def module_name(path: str) -> str:
    """``hpcnn/parallel/tensor.py`` -> ``hpcnn.parallel.tensor``; a package's ``__init__.py`` ->
    the package's name."""
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-len(".py")]
    parts = rel.split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict:
    """Every module of the package: name -> path."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                found[module_name(path)] = path
    return found


def imported_modules(name: str, path: str, modules) -> set:
    """The package modules that module ``name`` imports, at any depth of its syntax tree.

    ``from P import x`` is an edge to ``P.x`` when that is a module (``from hpcnn import
    backend``), else to ``P`` (``x`` is a name defined in P). Relative imports are resolved
    against the module's package."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = os.path.basename(path) == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def import_graph() -> nx.DiGraph:
    modules = source_modules()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        g.add_edges_from((name, dep) for dep in imported_modules(name, path, modules))
    return g


def cycles(g: nx.DiGraph) -> set:
    """The groups of modules that import each other (strongly connected components of more than
    one module), each as its sorted names."""
    return {tuple(sorted(c)) for c in nx.strongly_connected_components(g) if len(c) > 1}


def describe(g: nx.DiGraph, groups) -> str:
    """One line per group: its modules and one concrete import loop through them."""
    lines = []
    for group in sorted(groups):
        loop = nx.find_cycle(g.subgraph(group))
        lines.append(f"{', '.join(group)}\n    e.g. " + " -> ".join([a for a, _ in loop]
                                                                  + [loop[0][0]]))
    return "\n".join(lines)


def test_graph_is_read_from_the_source():
    """The reader finds edges of each kind (guards against a parser that finds nothing)."""
    g = import_graph()
    assert g.has_edge("hpcnn.train", "hpcnn.config")                 # module level
    assert g.has_edge("hpcnn.parallel.tensor", "hpcnn.backend")      # from hpcnn import backend
    assert g.has_edge("hpcnn.log", "hpcnn.log.runlog")               # relative import
    assert g.has_edge("hpcnn.cli", "hpcnn.checkpoint")               # inside a function


def test_no_import_cycle():
    g = import_graph()
    found = cycles(g)
    new, gone = found - ALLOWED_CYCLES, ALLOWED_CYCLES - found
    assert not new, ("import cycles in hpcnn/ (move the shared code down a layer):\n"
                     + describe(g, new))
    assert not gone, f"allowed cycles no longer present, remove them from ALLOWED_CYCLES: {gone}"


def test_log_does_not_import_the_layers():
    """``hpcnn/log/`` records runs: it must not depend on the model or parallel code."""
    g = import_graph()
    bad = [(a, b) for a in g if a == "hpcnn.log" or a.startswith("hpcnn.log.")
           for b in g.successors(a) if b.startswith(("hpcnn.parallel", "hpcnn.nn"))]
    assert not bad, f"hpcnn/log/ imports model or parallel code: {bad}"


def test_the_loop_stays_small_and_no_function_is_long():
    """The sizes the architecture promises (docs/architecture.md): ``train.py`` at most 250 lines,
    no function or method in ``hpcnn/`` over 60 lines."""
    with open(os.path.join(PACKAGE, "train.py")) as f:
        assert len(f.read().splitlines()) <= 250
    long = []
    for name, path in source_modules().items():
        with open(path) as f:
            tree = ast.parse(f.read())
        long += [f"{name}.{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
