"""Test configuration: the tests folder is importable (gradcheck helpers, MPI launcher), and no
test may leave files in the working tree (run logs belong in pytest's ``tmp_path``)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def _listing(folder: str) -> dict:
    """{name: modification time} of the files directly in ``folder`` ({} if it is absent)."""
    if not os.path.isdir(folder):
        return {}
    return {e.name: e.stat().st_mtime_ns for e in os.scandir(folder)}


@pytest.fixture(autouse=True)
def _no_runs_in_the_tree():
    """Fail the test that creates ``runs/`` (the default log folder) in the checkout."""
    runs = os.path.join(ROOT, "runs")
    before = _listing(runs)
    yield
    after = _listing(runs)
    if after != before:
        new = sorted(k for k, t in after.items() if before.get(k) != t)
        pytest.fail(f"this test wrote into the working tree: {runs} now holds {new}; "
                    f"pass --log (or a path) under tmp_path")


@pytest.fixture(scope="session")
def _docs_session(tmp_path_factory):
    from test_docs import DocsRun
    return DocsRun(tmp_path_factory.mktemp("docs"))


@pytest.fixture
def docs_run(_docs_session, request):
    """The documented commands (README.md and docs/), run once each per session in one
    scratch directory (:class:`test_docs.DocsRun`): the docs test and the experiments' tests
    share it. It is told whether the asking test is long: a test of make test may not ask for
    a command that tests/test_docs.py leaves to make test-long (its LONG)."""
    _docs_session.asker_is_long = request.node.get_closest_marker("long") is not None
    return _docs_session
