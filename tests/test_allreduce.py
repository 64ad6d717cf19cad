"""Allreduce algorithms (ring, rd, shm, auto, non-blocking) under mpiexec on 2, 3 and 4 ranks;
the compiled ``auto`` table and the counters serially; the run-time calibration and its saved
file (under mpiexec on 2 and 3 ranks, its file handling serially)."""
import json
import math
import os
import random
import re

import numpy as np
import pytest

from hpcnn.parallel.collectives import autotune as calibration
from hpcnn.parallel.collectives.algorithms import MARGIN, _split, compile_table, table_from_times
from hpcnn.parallel.collectives import CommStats, Communicator

from mpi_util import CaseRuns, single


@pytest.fixture(scope="module")
def allreduce_runs(tmp_path_factory):
    """The algorithms and the calibration on the same number of ranks share one job (the
    calibration scenario second: it leaves its calibration file set in the environment)."""
    return CaseRuns([(n, "allreduce_algos", ()) for n in (2, 3, 4)]
                    + [(n, "calibration_cache", (CaseRuns.FOLDER,)) for n in (2, 3)],
                    folder=tmp_path_factory.mktemp("allreduce"), timeout=120)


# (3 ranks stay in make test: their job runs anyway, for the calibration cache's test)
@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.long)])
def test_allreduce_algorithms(n, allreduce_runs):
    assert f"allreduce_algos OK on {n} ranks" in allreduce_runs.stdout(n, "allreduce_algos")


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


# -- the run-time calibration and its file -------------------------------------------------------
def test_calibration_measured_saved_reused_and_keyed_by_ranks(allreduce_runs):
    """Only the engine's bucket sizes are timed; a saved file is reused without timing; bad files
    are ignored with a note; a training run loads what the previous one measured (see the
    scenario). The key differs between 2 and 3 ranks, so does the default file."""
    names = {}
    for n in (2, 3):
        out = allreduce_runs.stdout(n, "calibration_cache", CaseRuns.FOLDER)
        assert f"calibration_cache OK on {n} ranks" in out
        names[n] = re.search(r"key file (calibration-[0-9a-f]{16}\.json)", out).group(1)
    assert names[2] != names[3]


KEY = {"hosts": ["h"], "node_of_rank": [0, 0], "cpus_of_rank": [2, 2], "ranks": 2,
       "mpi": "MPICH Version: 4", "mpi4py": "4", "dtype": "float32",
       "algorithms": ["mpi", "ring", "rd", "shm"], "backend": "cpu", "segment_bytes": 1,
       "piece_bytes": 1, "hpcnn": "0"}


def _timings(sizes, base=1e-4):
    """Medians and quartiles (10 % either side) as a calibration saves them."""
    times = {a: [base * (j + 1) * (i + 1) for i in range(len(sizes))]
             for j, a in enumerate(KEY["algorithms"])}
    return {"sizes": sizes, "times": times,
            **{k: {a: [f * x for x in col] for a, col in times.items()}
               for k, f in (("low", 0.875), ("high", 1.125))}}


def test_calibration_file_round_trip_merge_and_replace(tmp_path):
    path = str(tmp_path / "sub" / "c.json")
    assert calibration.load(path, KEY) == (None, "")                    # no file: no note
    assert calibration.save(path, KEY, _timings([1000, 4000])) == ""    # makes the folder
    got, note = calibration.load(path, KEY)
    assert note == "" and got == _timings([1000, 4000])
    assert calibration.save(path, KEY, _timings([2000], base=1.0)) == ""       # merged in, sorted
    got, _ = calibration.load(path, KEY)
    assert got["sizes"] == [1000, 2000, 4000] and got["times"]["mpi"][1] == 1.0
    assert got["low"]["mpi"][1] == 0.875 and got["high"]["rd"] == [3.375e-4, 3.375, 6.75e-4]
    assert calibration.save(path, KEY, _timings([8000]), replace=True) == ""
    assert calibration.load(path, KEY)[0]["sizes"] == [8000]
    assert os.listdir(tmp_path / "sub") == ["c.json"]           # no temporary left behind
    blocked = tmp_path / "file"
    blocked.write_text("")
    # a file where a folder goes
    note = calibration.save(str(blocked / "c.json"), KEY, _timings([1]))
    assert note.startswith("could not save") and "\n" not in note


@pytest.mark.parametrize("content,why", [
    ("{oops", "unreadable"), ("[" * 100000, "unreadable"), ("[1, 2]", "not an hpcnn calibration file"),
    (json.dumps({"format": "x"}), "not an hpcnn calibration file"),
    (json.dumps({"format": calibration.FORMAT, "key": dict(KEY, ranks=3), **_timings([1])}),
     "made for another ranks"),
    (json.dumps({"format": calibration.FORMAT, "key": dict(KEY, mpi="Open MPI", dtype="float64"),
                 **_timings([1])}), "made for another dtype, mpi"),
    (json.dumps({"format": calibration.FORMAT, "key": KEY, "sizes": [1, 2],
                 "times": {"mpi": [1, 1]}}),
     "malformed"),
    (json.dumps({"format": calibration.FORMAT, "key": KEY,
                 **dict(_timings([1, 2]), sizes=[1, -2])}),
     "malformed"),
    (json.dumps({"format": calibration.FORMAT, "key": KEY,
                 **_timings([1, 2]) | {"times": {a: [1e-4, float("nan")]
                                                 for a in KEY["algorithms"]}}}), "malformed"),
    (json.dumps({"format": calibration.FORMAT, "key": KEY,
                 **{k: v for k, v in _timings([1, 2]).items() if k != "high"}}), "malformed"),
    (json.dumps({"format": calibration.OLD_FORMATS[0], "key": KEY,       # medians only
                 **{k: v for k, v in _timings([1, 2]).items() if k in ("sizes", "times")}}),
     "an older calibration (hpcnn-allreduce-calibration/1: medians without their spread), "
     "measured again"),
])
def test_a_bad_calibration_file_is_ignored_with_one_line(tmp_path, content, why):
    path = tmp_path / "c.json"
    path.write_text(content)
    got, note = calibration.load(str(path), KEY)
    assert got is None and note.startswith(f"ignored {path}: ") and why in note, note
    assert "\n" not in note


def test_calibration_path_and_coverage(monkeypatch, tmp_path):
    monkeypatch.delenv(calibration.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = calibration.path_for(KEY)
    assert re.fullmatch(re.escape(str(tmp_path / "hpcnn")) + r"/calibration-[0-9a-f]{16}\.json",
                        default)
    assert calibration.path_for(dict(KEY, ranks=4)) != default           # another key, another file
    assert calibration.path_for(dict(KEY)) == default
    monkeypatch.setenv(calibration.ENV, "~/mine.json")
    assert calibration.path_for(KEY) == os.path.expanduser("~/mine.json")
    for off in ("off", "0", "OFF"):
        monkeypatch.setenv(calibration.ENV, off)
        assert calibration.path_for(KEY) is None
    assert calibration.covered(1000, [500]) and calibration.covered(1000, [2000])
    assert calibration.covered(7, [7])
    assert not calibration.covered(1000, [499, 2001]) and not calibration.covered(1000, [])


def test_table_from_times_keeps_mpi_unless_clearly_beaten():
    c = single()                       # one rank: the prior is the several-nodes default table
    t = {"mpi": [1.0, 1.0, 1.0], "ring": [1.0 - MARGIN / 2, 0.5, 2.0], "rd": [3.0, 0.6, 0.95]}
    table = table_from_times(c, [100, 200, 300], t)
    assert table["choice"] == ["mpi", "ring", "mpi"] and table["times"] == t
    assert table["sizes"] == [100, 200, 300]


# rounds of a noisy host, seconds. shm: a lower median than mpi's (0.85 against 1.05), quartiles
# overlapping mpi's; fast: every round beats mpi's; tight: a small spread, but 10 % from mpi;
# burst: mpi's rounds 3-7 hit by load (median 1.9), a steady 0.95 against mpi's unloaded 1.0
NOISY = {"mpi": [1.0, 1.3, 0.9, 1.6, 1.05, 1.2, 0.95],
         "shm": [0.7, 1.2, 0.8, 1.4, 0.75, 1.1, 0.85],
         "fast": [0.5, 0.52, 0.55, 0.6, 0.51, 0.7, 0.53],
         "tight": [0.9, 0.92, 0.95, 0.91, 0.93, 0.9, 0.94],
         "burst": [1.0, 1.0, 2.0, 2.1, 1.0, 2.2, 1.9]}


def test_auto_leaves_mpi_only_for_a_clear_win_spread_included():
    from hpcnn.parallel.collectives import algorithms
    assert algorithms.spread([3.0, 1.0, 2.0, 5.0, 4.0]) == (2.0, 3.0, 4.0)
    assert algorithms.wins(1.0, 1 / (1 + MARGIN)) and not algorithms.wins(1.0, 0.95)
    c = single()
    n = NOISY
    cases = [({"mpi": n["mpi"], "shm": n["shm"]}, "mpi"),           # overlapping: undecided
             ({"mpi": n["mpi"], "shm": n["fast"]}, "shm"),          # separated: shm
             ({"mpi": n["mpi"], "ring": n["tight"]}, "mpi"),        # not by MARGIN
             ({"mpi": n["burst"], "cma": [0.95] * 7}, "mpi"),       # medians 2x, quartiles not
             ({"mpi": n["mpi"], "rd": n["shm"], "ring": n["fast"]}, "ring")]
    for samples, want in cases:
        got = algorithms.summarize([1 << 24], {a: [x] for a, x in samples.items()})
        table = table_from_times(c, got["sizes"], got["times"], got["low"], got["high"])
        assert table["choice"] == [want], (samples, table)
        for a in samples:
            assert table["low"][a][0] <= table["times"][a][0] <= table["high"][a][0]
    # medians alone (no quartiles): the medians stand for them
    med = {a: [float(np.median(n[k]))] for a, k in (("mpi", "mpi"), ("shm", "shm"), ("rd", "fast"))}
    assert table_from_times(c, [1 << 24], med)["choice"] == ["rd"]
    del med["rd"]
    assert table_from_times(c, [1 << 24], med)["choice"] == ["mpi"]         # 0.85 against 1.05


def test_describe_says_where_the_table_came_from():
    info = {"source": "file", "path": "/x/c.json", "sizes": [340 << 10], "measured": [],
            "seconds": 0.01, "choice": {340 << 10: "shm"}, "notes": []}
    assert calibration.describe(info) == ["allreduce auto: loaded from /x/c.json (340 KiB shm)"]
    info.update(source="measured", measured=[340 << 10], seconds=0.123,
                notes=["ignored /x/c.json: unreadable (JSONDecodeError: x)"])
    assert calibration.describe(info) == [
        "allreduce auto: measured 1 size in 0.12 s, saved to /x/c.json (340 KiB shm)",
        "allreduce auto: ignored /x/c.json: unreadable (JSONDecodeError: x)"]
    info.update(source="file+measured", measured=[600], choice={600: "mpi", 2 << 20: "cma"},
                notes=[])
    assert calibration.describe(info) == [
        "allreduce auto: measured 1 size in 0.12 s, the rest loaded, "
        "saved to /x/c.json (600 B mpi, 2.0 MiB cma)"]
    info.update(source="measured", measured=[600, 2 << 20], path=None)
    assert calibration.describe(info) == ["allreduce auto: measured 2 sizes in 0.12 s, "
                                  "no file (HPCNN_CALIBRATION=off) (600 B mpi, 2.0 MiB cma)"]
    info.update(source="none")
    assert calibration.describe(info) == []
