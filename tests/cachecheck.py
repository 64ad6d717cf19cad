"""Does a block's ``spec()`` describe the cache its ``forward`` really keeps? (memory accounting)"""
from hpcnn.memory.executor import _arrays, _root, live_bytes


def spec_matches_cache(block, x) -> None:
    """Assert ``cache_has_x``, ``cache_has_y``, ``bytes_cache_own``, ``bytes_x`` and ``bytes_y``
    of ``block.spec(x.shape)`` against one real forward of ``x``."""
    y, cache = block.forward(x)
    s = block.spec(x.shape)
    roots = {id(_root(a)) for a in _arrays(cache, [])}
    assert s.cache_has_x == (id(_root(x)) in roots), (block, "cache_has_x", s.cache_has_x)
    assert s.cache_has_y == (id(_root(y)) in roots), (block, "cache_has_y", s.cache_has_y)
    own = live_bytes(*[a for a in _arrays(cache, [])
                       if _root(a) is not _root(x) and _root(a) is not _root(y)])
    assert s.bytes_cache_own == own, (block, "bytes_cache_own", s.bytes_cache_own, own)
    assert s.bytes_y == y.nbytes and s.bytes_x == x.nbytes, (block, s.bytes_x, s.bytes_y)
