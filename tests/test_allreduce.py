"""Allreduce algorithms (ring, rd, shm, auto, non-blocking) under mpiexec on 2, 3 and 4 ranks;
the compiled ``auto`` table and the counters serially."""
import math
import random

import numpy as np
import pytest

from hpcnn.parallel.allreduce import _split, compile_table
from hpcnn.parallel.comm import CommStats, Communicator

from mpi_util import run_mpi


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_algorithms(n):
    assert f"OK on {n} ranks" in run_mpi("allreduce_algos", n, timeout=90)


@pytest.mark.parametrize("n,parts", [(0, 3), (1, 4), (7, 3), (100003, 4), (8, 8)])
def test_split_is_exact(n, parts):
    b = _split(n, parts)
    sizes = [b[i + 1] - b[i] for i in range(parts)]
    assert b[0] == 0 and b[-1] == n and max(sizes) - min(sizes) <= 1


def _nearest_in_log2(table, nbytes):
    """The rule ``auto`` follows, spelled out: nearest size in log2, ties to the smaller."""
    x = math.log2(max(nbytes, 1))
    j = min(range(len(table["sizes"])),
            key=lambda j: (abs(math.log2(table["sizes"][j]) - x), table["sizes"][j]))
    return table["choice"][j]


def test_compiled_table_is_the_nearest_size_rule():
    rng = random.Random(0)
    algs = ["mpi", "ring", "rd", "shm"]
    for _ in range(200):
        sizes = sorted(rng.sample([1 << k for k in range(30)] + [3000, 5 << 20, 777],
                                  rng.randint(1, 6)))
        table = {"sizes": sizes, "choice": [rng.choice(algs) for _ in sizes]}
        bounds, choices, mpi_below = compile_table(table)
        probes = [0, 1, 2] + [s + d for s in sizes + bounds for d in (-1, 0, 1)] + \
                 [rng.randint(1, 1 << 31) for _ in range(30)]
        for n in probes:
            got = choices[np.searchsorted(bounds, n, side="left")]
            assert got == _nearest_in_log2(table, n), (table, n)
            if n < mpi_below:
                assert got == "mpi", (table, n, mpi_below)
        if mpi_below < 1 << 62:            # the first size not below picks something else
            assert _nearest_in_log2(table, mpi_below) != "mpi" or mpi_below == 0


def test_compiled_table_rejects_unknown_algorithms():
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        compile_table({"sizes": [1, 2], "choice": ["mpi", "tree"]})


def test_comm_stats_counters():
    s = CommStats()
    assert s.calls["allreduce"] == 0 and s.seconds["x"] == 0.0 and dict(s.calls) == {}
    s.add("bcast", 10, 0.5)
    s.add("bcast", 5, 0.25)
    ar = s.counter("allreduce", 4, 3)          # 3 ranks: 2(p-1)/p of the raw bytes
    assert s.counter("allreduce", 8, 6) is ar
    ar.calls, ar.raw, ar.seconds = 2, 30, 1.0
    s.add("allreduce", 7, 0.0)                 # another counter of the same op, ratio 1
    assert s.calls["allreduce"] == 3 and s.bytes["allreduce"] == 40 + 7
    assert s.bytes_sent == 15 + 47 and s.comm_seconds == 1.75
    assert s.snapshot() == {"bytes_sent": 62, "comm_s": 1.75, "calls": {"bcast": 2, "allreduce": 3}}
    assert set(s.calls) == {"bcast", "allreduce"} and len(s.bytes) == 2
    s.reset()
    assert s.bytes_sent == 0 and dict(s.calls) == {} and s.counter("allreduce", 4, 3) is ar


class _Single:
    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1


def test_one_rank_is_a_no_op():
    c = Communicator(_Single())
    a = np.arange(3.0)
    for alg in ("mpi", "auto", "ring", "shm"):
        assert c.allreduce(a, algorithm=alg) is a
        req = c.iallreduce(a, algorithm=alg)
        assert req.done and req.test()
    assert np.array_equal(a, np.arange(3.0)) and c.stats.calls["allreduce"] == 0
    stats = CommStats()
    c.stats = stats
    assert c.stats is stats
