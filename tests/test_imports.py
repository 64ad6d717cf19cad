"""The rules of the house: the package's layers, no import cycle, MPI in one place, no two modules
a reader would confuse by name, and the sizes docs/architecture.md promises.

The graph is read statically from the source (``ast``), not by importing: a node is a module of
``hpcnn/`` (``hpcnn.parallel.tensor.linear``; a package is its ``__init__``), and an edge A -> B is an
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
    """``hpcnn/parallel/tensor/linear.py`` -> ``hpcnn.parallel.tensor.linear``; a package's ``__init__.py`` ->
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
    assert g.has_edge("hpcnn.parallel.tensor.linear", "hpcnn.backend")      # from hpcnn import backend
    assert g.has_edge("hpcnn.log", "hpcnn.log.runlog")               # relative import
    assert g.has_edge("hpcnn.cli", "hpcnn.checkpoint")               # inside a function


def test_no_import_cycle():
    g = import_graph()
    found = cycles(g)
    new, gone = found - ALLOWED_CYCLES, ALLOWED_CYCLES - found
    assert not new, ("import cycles in hpcnn/ (move the shared code down a layer):\n"
                     + describe(g, new))
    assert not gone, f"allowed cycles no longer present, remove them from ALLOWED_CYCLES: {gone}"


# The package order, bottom first (the same list as docs/architecture.md's "Layers"): a module
# imports only modules of its own layer or of the layers below it. A module belongs to the
# longest prefix listed; one row may hold several packages that do not import each other.
LAYERS = (
    ("hpcnn", "hpcnn.backend"),
    ("hpcnn.schedule",),
    ("hpcnn.log",),
    ("hpcnn.parallel.collectives",),
    ("hpcnn.signals",),
    ("hpcnn.graph",),
    ("hpcnn.nn",),
    ("hpcnn.parallel",),
    ("hpcnn.parallel.data",),
    ("hpcnn.parallel.tensor",),
    ("hpcnn.parallel.layout",),
    ("hpcnn.memory",),
    ("hpcnn.config",),
    ("hpcnn.datasets",),
    ("hpcnn.engine",),
    ("hpcnn.plan",),
    ("hpcnn.memory_check",),
    ("hpcnn.task",),
    ("hpcnn.checkpoint",),
    ("hpcnn.preflight",),
    ("hpcnn.train",),
    ("hpcnn.plan.calibrate",),
    ("hpcnn.cli_tools",),
    ("hpcnn.cli", "hpcnn.__main__"),
    ("hpcnn.scripts",),
    ("hpcnn.validation_runs",),
)
# The imports that still go up a layer, as (importer, imported): none, and an entry here whose
# import has gone fails too, so that the list stays exact.
ALLOWED_UPWARD: set = set()
# Where MPI may be named: the collectives package (every MPI call of hpcnn) and the CLI entry
# (MPI_Abort of a failed run, the library's version in ``hpcnn info``).
MPI_ALLOWED = ("hpcnn/parallel/collectives/", "hpcnn/cli.py")


def layer_of(module: str) -> int:
    """The row of :data:`LAYERS` whose longest prefix names ``module``."""
    best, row = -1, None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best:
                best, row = len(n), i
    assert row is not None, f"{module} is in no layer of LAYERS: place it"
    return row


def test_every_module_has_a_layer_and_imports_only_below_it():
    g = import_graph()
    up = {(a, b) for a, b in g.edges() if layer_of(b) > layer_of(a)}
    new, gone = up - ALLOWED_UPWARD, ALLOWED_UPWARD - up
    assert not new, "imports up the layers (docs/architecture.md, Layers):\n" + "\n".join(
        f"  {a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})" for a, b in sorted(new))
    assert not gone, f"allowed upward imports no longer present, remove them: {gone}"


def test_layers_match_the_architecture_page():
    """The order is written twice, here and in docs/architecture.md; they must agree."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    block = text.split("<!-- layers -->")[1]
    rows = [r.strip() for r in block.strip().splitlines() if r.strip().startswith("|")][2:]
    listed = [tuple(c.strip(" `") for c in row.split("|")[2].split(",")) for row in rows]
    assert listed == [tuple(n) for n in LAYERS][::-1], listed


def test_mpi_only_in_the_collectives_and_the_cli_entry():
    """No line outside the collectives package and the CLI entry names mpi4py or ``MPI.``, code,
    comment or docstring, but for the launcher in a command (``mpiexec ... python -m mpi4py``,
    which makes an exception on one rank abort the job)."""
    bad = []
    for name, path in source_modules().items():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel.startswith(MPI_ALLOWED):
            continue
        with open(path) as f:
            for i, line in enumerate(f, 1):
                line = line.replace("python -m mpi4py", "")
                if "mpi4py" in line or "MPI." in line:
                    bad.append(f"{rel}:{i}: {line.strip()}")
    assert not bad, "MPI named outside the collectives package:\n" + "\n".join(bad)


def test_no_two_modules_share_a_name():
    """``parallel/data/bucketed.py`` beside ``hpcnn/datasets/`` and ``graph/graphs.py`` read alike: every module
    and package of hpcnn has a name of its own."""
    seen = {}
    for name in source_modules():
        last = name.rsplit(".", 1)[-1]
        if last in ("hpcnn", "__main__"):
            continue
        seen.setdefault(last, []).append(name)
    same = {k: v for k, v in seen.items() if len(v) > 1}
    assert not same, same


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
