"""Tests of the offload channel (hpcnn.memory.offload): exact round trips, ordering, freeing,
errors naming the key, cleanup, emulated bandwidth, memory accounting (NumPy file channel)."""
import collections
import gc
import os
import time
import tracemalloc
import weakref

import numpy as np
import pytest

from hpcnn.memory import offload as off
from hpcnn.memory.offload import OffloadChannel, OffloadError

Pair = collections.namedtuple("Pair", "x meta")


def make_cache(rng):
    base = rng.standard_normal((6, 5))                                      # (6, 5) float64
    return {
        "x": rng.standard_normal((4, 3)).astype(np.float32),                # (4, 3)
        "idx": rng.integers(-2**40, 2**40, size=(7,), dtype=np.int64),      # (7,)
        "mask": rng.random((3, 2, 2)) > 0.5,                                # (3, 2, 2) bool
        "bytes": rng.integers(0, 256, size=(5,), dtype=np.uint8),
        "t": base.T,                                                        # (5, 6) transposed view
        "strided": base[::2, 1:4],                                          # (3, 3) strided view
        "scalar0d": np.array(3.25, dtype=np.float64),                       # ()
        "empty": np.empty((0, 4), dtype=np.float32),                        # (0, 4)
        "leaves": (None, 3, 2.5, (4, 3), np.float32(1.5), "name", True),
        "nested": [Pair(np.arange(6, dtype=np.int32).reshape(2, 3), {"shape": (2, 3)}), None],
        "dd": collections.defaultdict(list, {"g": np.full((2, 2), -0.0, dtype=np.float16)}),
    }


def assert_same(a, b):
    """Same structure, types of containers, and arrays equal bit for bit with dtype and shape."""
    if isinstance(a, np.ndarray):
        assert type(b) is np.ndarray and not isinstance(b, np.memmap)
        assert b.dtype == a.dtype and b.shape == a.shape and b.flags.c_contiguous
        np.testing.assert_array_equal(b, a)
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, (tuple, list)):
        assert type(b) is type(a) and len(b) == len(a)
        for u, v in zip(a, b):
            assert_same(u, v)
    elif isinstance(a, dict):
        assert type(b) is type(a) and list(b) == list(a)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert type(b) is type(a) and (b == a or b is a)


def test_round_trip_nested_mixed_cache():
    rng = np.random.default_rng(0)
    cache = make_cache(rng)
    with OffloadChannel("file") as ch:
        ch.offload("c", cache)
        out = ch.fetch("c")
        assert_same(cache, out)
        assert out["x"] is not cache["x"]
        assert ch.stats["transfers"] == 2
        assert ch.stats["bytes_out"] == ch.stats["bytes_in"] > 0


def test_repeated_object_restored_once_views_independent():
    a = np.arange(12.0).reshape(3, 4)
    with OffloadChannel() as ch:
        ch.offload(0, (a, a, [a], a[1]))
        r = ch.fetch(0)
    assert r[0] is r[1] is r[2][0]
    np.testing.assert_array_equal(r[0], a)
    np.testing.assert_array_equal(r[3], a[1])
    assert not np.shares_memory(r[0], r[3])                 # a view is restored on its own


def test_several_keys_in_flight_prefetch_before_offload_ends():
    rng = np.random.default_rng(1)
    caches = {k: (rng.standard_normal((200, 100)), k) for k in range(5)}
    with OffloadChannel(bandwidth=50e6) as ch:              # ~3 ms per key: still in flight
        for k, c in caches.items():
            ch.offload(k, c)
        assert not ch.offloaded(4)
        for k in reversed(range(5)):
            ch.prefetch(k)                                  # runs after every offload, in order
        for k in (2, 4, 0, 3, 1):
            assert_same(caches[k], ch.fetch(k))
        assert ch.held_bytes() == 0


def test_source_freed_after_offload():
    a = np.ones((256, 256))
    ref = weakref.ref(a)
    with OffloadChannel() as ch:
        ch.offload("k", {"a": a, "n": 1})
        del a
        ch.wait_offload("k")
        assert ch.offloaded("k")
        gc.collect()
        assert ref() is None
        out = ch.fetch("k")
        assert type(out["a"]) is np.ndarray and np.all(out["a"] == 1)


def test_traced_memory_drops_after_offload():
    n = 4 << 20
    tracemalloc.start()
    try:
        a = np.ones(n // 8)                                 # 4 MiB
        with OffloadChannel() as ch:
            before = tracemalloc.get_traced_memory()[0]
            ch.offload("k", (a,))
            del a
            ch.wait_offload("k")
            after = tracemalloc.get_traced_memory()[0]
            assert before - after > 0.9 * n, (before, after)
            back = ch.fetch("k")[0]
            assert tracemalloc.get_traced_memory()[0] - after > 0.9 * n
            assert back.nbytes == n
    finally:
        tracemalloc.stop()


def test_held_bytes_up_then_zero():
    a, b = np.zeros((100, 10), np.float32), np.zeros(7, np.int64)
    with OffloadChannel() as ch:
        assert ch.held_bytes() == 0
        ch.offload("k", (a, b, 5))
        ch.wait_offload("k")
        assert ch.held_bytes() == a.nbytes + b.nbytes
        assert len(os.listdir(ch.directory)) == 1
        ch.fetch("k")
        assert ch.held_bytes() == 0
        assert os.listdir(ch.directory) == []


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="-5"):
        OffloadChannel(bandwidth=-5)
    with pytest.raises(ValueError, match="0"):
        OffloadChannel(bandwidth=0)
    with pytest.raises(ValueError, match="'tape'"):
        OffloadChannel("tape")
    with pytest.raises(ValueError, match="CuPy"):
        OffloadChannel("pinned")
    with OffloadChannel() as ch:
        ch.offload(("blk", 3), np.zeros(2))
        with pytest.raises(ValueError, match=r"\('blk', 3\)"):
            ch.offload(("blk", 3), np.zeros(2))
        with pytest.raises(KeyError, match="'nope'"):
            ch.fetch("nope")
        with pytest.raises(TypeError, match="object"):
            ch.offload("o", np.array([None, 1], dtype=object))
        ch.fetch(("blk", 3))
        with pytest.raises(KeyError, match="blk"):
            ch.fetch(("blk", 3))                            # forgotten after fetch


def test_worker_error_surfaces_with_key(monkeypatch):
    def broken(self, e):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(off._FileIO, "put", broken)
    a = np.ones(100)
    ref = weakref.ref(a)
    ch = OffloadChannel()
    ch.offload("layer7", (a,))
    ch.offload("layer8", (np.ones(3),))
    with pytest.raises(OffloadError, match="layer7.*No space left"):
        ch.fetch("layer7")
    with pytest.raises(KeyError, match="layer7"):          # a failed fetch forgets the key too
        ch.fetch("layer7")
    del a
    gc.collect()
    assert ref() is None                                   # even a failed copy drops the sources
    with pytest.raises(OffloadError, match="layer8"):      # unreported error: raised by close
        ch.close()
    ch.close()


def test_worker_error_on_read_and_wait(monkeypatch):
    def broken(self, e):
        raise OSError("disk gone")
    monkeypatch.setattr(off._FileIO, "get", broken)
    with OffloadChannel() as ch:
        ch.offload("k", (np.ones(3),))
        ch.wait_offload("k")                               # the copy out is fine
        with pytest.raises(OffloadError, match="copy in of key 'k'.*disk gone"):
            ch.fetch("k")
    monkeypatch.undo()
    monkeypatch.setattr(off._FileIO, "put", lambda self, e: 1 / 0)
    ch = OffloadChannel()
    ch.offload("w", (np.ones(3),))
    with pytest.raises(OffloadError, match="copy out of key 'w'.*ZeroDivisionError"):
        ch.wait_offload("w")
    ch.close()                                              # already reported: no raise


def test_close_removes_directory_idempotent_and_use_after_close(tmp_path):
    ch = OffloadChannel(directory=str(tmp_path))
    d = ch.directory
    assert os.path.dirname(d) == str(tmp_path) and os.path.isdir(d)
    ch.offload("a", (np.ones(1000),))
    ch.offload("b", (np.ones(10),))
    ch.prefetch("b")
    ch.close()                                              # waits for the queued transfers
    assert not os.path.exists(d) and os.path.isdir(tmp_path)
    ch.close()
    for call in (lambda: ch.offload("c", np.ones(1)), lambda: ch.fetch("a"),
                 lambda: ch.prefetch("a"), lambda: ch.wait_offload("a"),
                 lambda: ch.offloaded("a"), ch.held_bytes):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_garbage_collected_channel_cleans_up():
    ch = OffloadChannel()
    d = ch.directory
    ch.offload(1, np.ones(10))
    del ch
    gc.collect()
    assert not os.path.exists(d)


def test_emulated_bandwidth_lower_bound():
    a = np.random.default_rng(2).standard_normal(1_000_000)  # 8 MB
    with OffloadChannel(bandwidth=200e6) as ch:
        t0 = time.perf_counter()
        ch.offload("big", {"a": a})
        out = ch.fetch("big")
        elapsed = time.perf_counter() - t0
        assert elapsed >= 0.08 * 0.98, elapsed
        np.testing.assert_array_equal(out["a"], a)
        s = ch.stats
        assert s["bytes_out"] == s["bytes_in"] == 8_000_000 and s["transfers"] == 2
        assert s["seconds_out"] >= 0.039 and s["seconds_in"] >= 0.039
