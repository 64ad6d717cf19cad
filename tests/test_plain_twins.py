"""The plain twins written for reading (``hpcnn/engine/plain_pipeline.py``,
``hpcnn/parallel/collectives/plain_ring.py``): equal to their fast paths under mpiexec
(tests/mpi/plain_twins.py), serial answers on one rank, and never used by the package."""
import numpy as np
import pytest

from hpcnn import datasets as data
from hpcnn.engine import plain_pipeline
from hpcnn.nn import models
from hpcnn.parallel.collectives import plain_ring
from mpi_util import run_mpi, single
from test_imports import import_graph

TWINS = ("hpcnn.engine.plain_pipeline", "hpcnn.parallel.collectives.plain_ring")


def test_no_module_of_the_package_uses_the_twins():
    g = import_graph()
    users = {a for twin in TWINS for a in g.predecessors(twin)}
    assert not users, f"the plain twins are for reading, not for the training path: {users}"


def test_one_rank_ring_and_pipeline_are_serial():
    a = np.arange(5.0)
    assert plain_ring.allreduce(single(), a) is a and np.array_equal(a, np.arange(5.0))
    d = data.digits()
    x, y = d.x_train[:10].astype(np.float64), d.y_train[:10]
    ref = models.mlp(64, (16,), 10, seed=1, dtype=np.float64)
    loss_ref, caches = ref.forward(x, y)
    ref.zero_grad()
    ref.backward(1.0, caches, need_dx=False)
    for name in ("gpipe", "1f1b"):
        model = models.mlp(64, (16,), 10, seed=1, dtype=np.float64)
        stage, loss = plain_pipeline.train_step(name, model, single(), x, y, 3)
        assert abs(loss - loss_ref) < 1e-12 * abs(loss_ref), name
        for p, q in zip(stage.params, ref.params):
            np.testing.assert_allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14, err_msg=name)
    with pytest.raises(ValueError, match="gpipe or 1f1b"):
        plain_pipeline.train_step("zb_h1", model, single(), x, y, 2)


@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.long)])
def test_plain_twins_equal_the_fast_paths_mpi(n):
    """The ring at 2, 3 and 4 ranks (4: make test-long), the pipeline at 2 and 3."""
    out = run_mpi("plain_twins", n, timeout=240)
    assert f"plain_twins OK on {n} ranks" in out
    if n in (2, 3):
        assert "pipeline 24 steps" in out
