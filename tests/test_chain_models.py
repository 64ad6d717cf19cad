"""Whole chains: finite differences through every model, slicing, deterministic initialisation."""
import numpy as np
import pytest

from hpcnn.nn import models

F64 = np.float64


def _fd_chain(model, x, y, entries=6, eps=1e-6, seed=0):
    """Central differences of the chain's loss w.r.t. a few entries of every parameter."""
    model.zero_grad()
    _, caches = model.forward(x, y)
    model.backward(1.0, caches)
    rng = np.random.default_rng(seed)
    for p in model.params:
        flat, g = p.data.reshape(-1), p.grad.reshape(-1)
        for i in rng.choice(flat.size, size=min(entries, flat.size), replace=False):
            old = flat[i]
            flat[i] = old + eps
            lp = model.forward(x, y)[0]
            flat[i] = old - eps
            lm = model.forward(x, y)[0]
            flat[i] = old
            num = (lp - lm) / (2 * eps)
            assert abs(num - g[i]) <= 1e-7 + 1e-5 * abs(num), (p.name, i, num, g[i])


def test_mlp_chain_gradients():
    rng = np.random.default_rng(0)
    m = models.mlp(10, (12, 8), 5, seed=1, dtype=F64)
    _fd_chain(m, rng.standard_normal((7, 10)), rng.integers(0, 5, 7))


def test_cnn_chain_gradients():
    rng = np.random.default_rng(0)
    m = models.cnn(1, 8, (3, 4), hidden=6, n_out=4, seed=1, dtype=F64)
    _fd_chain(m, rng.standard_normal((3, 1, 8, 8)), rng.integers(0, 4, 3))


def test_gpt_chain_gradients():
    rng = np.random.default_rng(0)
    m = models.gpt(11, 6, n_layers=2, dim=8, n_heads=2, seed=1, dtype=F64)
    _fd_chain(m, rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6)), entries=4)


def test_gpt_with_dropout_is_reproducible():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))
    m = models.gpt(11, 6, n_layers=2, dim=8, n_heads=2, dropout=0.2, seed=1, dtype=F64)
    s = m.rng_state()
    l1 = m.forward(x, y)[0]
    l2 = m.forward(x, y)[0]
    m.set_rng_state(s)
    assert m.forward(x, y)[0] == l1 and l1 != l2


def test_init_is_keyed_by_block_index_not_by_chain_shape():
    a = models.gpt(11, 6, n_layers=2, dim=8, n_heads=2, seed=3)
    b = models.gpt(11, 6, n_layers=3, dim=8, n_heads=2, seed=3)
    for pa, pb in zip(a[:3].params, b[:3].params):       # embedding + two blocks
        assert pa.name == pb.name
        np.testing.assert_array_equal(pa.data, pb.data)
    c = models.gpt(11, 6, n_layers=2, dim=8, n_heads=2, seed=4)
    assert not np.array_equal(a.params[0].data, c.params[0].data)


def test_slices_share_blocks_and_compose():
    rng = np.random.default_rng(0)
    m = models.mlp(10, (12, 8), 5, seed=1, dtype=F64)
    x, y = rng.standard_normal((4, 10)), rng.integers(0, 5, 4)
    loss, caches = m.forward(x, y)
    m.backward(1.0, caches)
    full = [p.grad.copy() for p in m.params]
    m.zero_grad()
    head, tail = m[:2], m[2:]
    assert head.loss is None and tail.loss is m.loss and len(head) + len(tail) == len(m)
    h, hc = head.forward_blocks(x)
    l2, tc = tail.forward(h, y)
    assert l2 == loss
    dh = tail.backward(1.0, tc)
    assert head.backward_blocks(dh, hc, need_dx=False) is None
    for g, p in zip(full, m.params):
        np.testing.assert_array_equal(g, p.grad)


def test_chain_spec_propagates_shapes():
    m = models.cnn(1, 8, (4, 6), hidden=16, n_out=10)
    specs = m.spec((5, 1, 8, 8))
    assert specs[0].in_shape == (5, 1, 8, 8) and specs[-2].out_shape == (5, 10)
    y = m.predict(np.zeros((5, 1, 8, 8), np.float32))
    assert y.shape == specs[-2].out_shape
    assert sum(s.bytes_params for s in specs) == sum(p.data.nbytes for p in m.params)


def test_model_argument_errors():
    with pytest.raises(ValueError, match="dim \\(10\\) is not divisible by n_heads \\(4\\)"):
        models.gpt(11, 6, dim=10, n_heads=4)
    with pytest.raises(ValueError, match="image side 6"):
        models.cnn(1, 6, (4, 4))


def test_keep_gives_storage_to_the_named_parameters_only():
    import tracemalloc
    from hpcnn.nn.core import is_placeholder
    from hpcnn.parallel.tensor.linear import shard_array
    full = models.gpt(40, 16, 4, 32, 2, seed=2, dtype=np.float64)
    keep = {p.name for b in full.blocks[2:4] for p in b.params}
    part = models.gpt(40, 16, 4, 32, 2, seed=2, dtype=np.float64, keep=keep)
    assert [p.name for p in part.params] == [p.name for p in full.params]
    for a, b in zip(full.params, part.params):
        assert b.shape == a.shape and b.data.dtype == a.data.dtype
        if a.name in keep:
            np.testing.assert_array_equal(b.data, a.data)        # the same keyed initial values
            assert not is_placeholder(b.data)
        else:
            assert is_placeholder(b.data) and is_placeholder(b.grad) and np.isnan(b.data).all()
            with pytest.raises(ValueError, match="read-only"):
                b.data[...] = 0
    assert [s.out_shape for s in part.spec((3, 16))] == [s.out_shape for s in full.spec((3, 16))]
    held = {}
    for what in (None, ()):
        tracemalloc.start()
        alive = models.gpt(40, 16, 4, 32, 2, seed=2, dtype=np.float64, keep=what)
        held[what] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del alive
    stored = sum(p.data.nbytes for p in full.params) * 2          # parameters and gradients
    assert held[None] > stored > 8 * held[()], (held, stored)     # placeholders: Python objects
    tracemalloc.start()            # nor are their values drawn: the peak stays below one tensor
    alive = models.gpt(500, 16, 2, 128, 2, seed=2, dtype=np.float64, keep=())   # of 512 KiB
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < max(p.data.nbytes for p in alive.params) // 4, peak
    shard = shard_array(part.params[0].data, 0, 1, 2)            # a placeholder's shard is one
    assert is_placeholder(shard) and shard.shape == (20, 32)


def test_keep_reaches_every_parameter_of_the_tensor_parallel_factories():
    """``keep`` passed to parallel_gpt / parallel_cnn (one tp rank) gives storage to the named
    parameters only, with the values of a full build; the others are placeholders."""
    from hpcnn.nn.core import is_placeholder
    from hpcnn.parallel.tensor.factories import parallel_cnn, parallel_gpt
    from mpi_util import single
    comm = single("tp")
    for build in (lambda keep: parallel_gpt(comm, 40, 16, 2, 32, 2, sequence_parallel=True,
                                            seed=2, dtype=np.float64, keep=keep),
                  lambda keep: parallel_cnn(comm, 1, 8, (4, 4), seed=2, dtype=np.float64,
                                            keep=keep)):
        full = build(None)
        keep = {p.name for p in full.blocks[1].params} | {full.params[-1].name}
        part = build(keep)
        assert [p.name for p in part.params] == [p.name for p in full.params]
        for a, b in zip(full.params, part.params):
            if a.name in keep:
                np.testing.assert_array_equal(b.data, a.data)
                assert type(b) is type(a) and not is_placeholder(b.data)
            else:
                assert is_placeholder(b.data) and b.shape == a.shape, a.name
