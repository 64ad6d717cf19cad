"""The block contract that memory accounting and the schedules rest on, checked on real arrays.

- :func:`spec_matches_cache`: a block's ``spec()`` counts exactly the bytes its forward's cache
  adds to the input and output, in the executor's own measure
  (:func:`hpcnn.memory.executor.live_bytes`: the bytes the arrays address, a buffer and its views
  once); its alias flags say whether the cache holds the input / output; and neither the cache
  nor the output keeps a part of a larger buffer alive (the rest would be memory nobody counts).
- :func:`grads_accumulate`: backward adds into the parameter gradients (twice = 2x once) and
  leaves its cache and ``dy`` as they were (a second backward gives the same dx).

Used by tests/test_block_contract.py (serial blocks, sharded ones on one rank) and
tests/mpi/tp_specs.py (sharded blocks on several ranks).
"""
import numpy as np

from hpcnn.memory.executor import _arrays, _root, extent, live_bytes


def _overlap(a, b) -> bool:
    """``a`` and ``b`` address some of the same bytes."""
    if _root(a) is not _root(b):
        return False
    (lo_a, hi_a), (lo_b, hi_b) = extent(a), extent(b)
    return lo_a < hi_b and lo_b < hi_a


def _is_array(a) -> bool:
    return hasattr(a, "nbytes") and hasattr(a, "shape")


def spec_matches_cache(block, x, targets=None) -> None:
    """Assert ``block.spec(x.shape)`` against one real forward of ``x``: ``bytes_x``,
    ``bytes_y``, ``cache_has_x``, ``cache_has_y`` and ``bytes_cache_own`` (the cache's bytes
    beyond x and y, counted as the executor's account counts them). With ``targets`` the block
    is a loss: ``forward(x, targets)`` returns a number, and its spec takes x's dtype."""
    if targets is None:
        y, cache = block.forward(x)
        s = block.spec(x.shape)
        assert s.bytes_y == y.nbytes, (block, "bytes_y", s.bytes_y, y.nbytes)
    else:
        y, cache = block.forward(x, targets)        # y: the loss value, not an array
        s = block.spec(x.shape, x.dtype)
        y = None
    assert s.bytes_x == x.nbytes, (block, "bytes_x", s.bytes_x, x.nbytes)
    arrays = _arrays(cache, [])
    has_x = any(_overlap(a, x) for a in arrays)
    has_y = y is not None and any(_overlap(a, y) for a in arrays)
    assert s.cache_has_x == has_x, (block, "cache_has_x", s.cache_has_x)
    assert s.cache_has_y == has_y, (block, "cache_has_y", s.cache_has_y)
    ends = [x] + ([y] if y is not None else [])
    own = live_bytes(ends, cache) - live_bytes(ends)
    assert s.bytes_cache_own == own, (block, "bytes_cache_own", s.bytes_cache_own, own)
    # nothing held unseen: a buffer the forward made is addressed whole by its cache and output
    made = {}
    for a in arrays + ([y] if y is not None else []):
        if _root(a) is not _root(x):
            made.setdefault(id(_root(a)), (_root(a), []))[1].append(a)
    for root, views in made.values():
        assert live_bytes(views) == root.nbytes, \
            (block, "keeps a part of a larger buffer", live_bytes(views), root.nbytes)


def _grads(block):
    return [np.array(p.grad, copy=True) for p in block.params]


def grads_accumulate(block, x, seed: int = 0) -> None:
    """Assert that two backwards of one forward's cache with the same ``dy`` leave twice the
    parameter gradients of one (to 1e-12: backward adds, never overwrites), give the same dx both
    times, and do not modify ``dy``. The block's gradients are zeroed before and after."""
    y, cache = block.forward(x)
    dy = np.random.default_rng(seed).standard_normal(y.shape).astype(y.dtype)
    keep = dy.copy()
    block.zero_grad()
    dx1 = block.backward(dy, cache)
    once = _grads(block)
    block.zero_grad()
    block.backward(dy, cache)
    dx2 = block.backward(dy, cache)
    twice = _grads(block)
    block.zero_grad()
    np.testing.assert_array_equal(dy, keep, err_msg=f"{block}: backward modified dy")
    if dx1 is None:
        assert dx2 is None, block
    else:
        np.testing.assert_array_equal(dx2, dx1, err_msg=f"{block}: backward changed its cache")
    assert len(once) == len(block.params) > 0, block
    for p, g1, g2 in zip(block.params, once, twice):
        assert np.any(g1 != 0), (block, p.name, "no gradient")
        # equal but for rounding: a scatter-add of repeated tokens adds one row at a time
        np.testing.assert_allclose(g2, 2 * g1, rtol=1e-12, atol=1e-14 * np.abs(g1).max(),
                                   err_msg=f"{block}: {p.name} does not accumulate")


def block_kinds(*packages) -> set:
    """Every block kind (a class with ``forward``, ``backward`` and ``spec``: the blocks and the
    losses) defined in the modules of ``packages``, but for the base class, chains and private
    helpers: what the contract tests must cover."""
    import importlib
    import inspect
    import pkgutil
    from hpcnn.nn.chain import Chain
    from hpcnn.nn.core import Block
    kinds = set()
    for pkg in packages:
        for info in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for name, cls in inspect.getmembers(mod, inspect.isclass):
                if (cls.__module__ == mod.__name__ and not name.startswith("_")
                        and cls not in (Block, Chain)
                        and all(hasattr(cls, m) for m in ("forward", "backward", "spec"))):
                    kinds.add(cls)
    return kinds
