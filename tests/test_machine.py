"""The machine files and the hierarchical symmetric machine (hpcnn/plan/machine.py); the level fit
of ``hpcnn calibrate --write`` (hpcnn/plan/calibrate/) and the command itself, on one rank and
(tests/mpi/machine_calibration.py) on two."""
import glob
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from hpcnn.plan import machine as hm
from hpcnn.plan.calibrate.links import fit_level
from mpi_util import ROOT, run_mpi

FILES = sorted(glob.glob(os.path.join(ROOT, "machines", "*.toml")))
GPU = os.path.join(ROOT, "machines", "dgx-a100-cluster.toml")


def small():
    """Two levels: 4 devices a node (1 us, 10 GB/s up to 1 MiB then 20), 8 nodes (5 us, 1 GB/s);
    transformer blocks at half the rate and 100 us a call, linear ones at the full rate."""
    dev = hm.Device("d", {"float32": 1e12, "float64": 5e11}, 1e11, 16e9,
                    {"transformer": 0.5}, {"transformer": 1e-4, "linear": 0.0},
                    {"transformer": 1e-9}, {"transformer": 0.4})
    return hm.Machine("m", (hm.Level("node", 4, 1e-6, ((2**20, 1e10), (math.inf, 2e10))),
                            hm.Level("cluster", 8, 5e-6, ((math.inf, 1e9),))), dev)


def test_every_machine_file_loads_and_reads_back_equal():
    names = {os.path.basename(f) for f in FILES}
    assert {"local-2vcpu.toml", "dgx-a100-cluster.toml", "archer2.toml"} <= names
    for f in FILES:
        m = hm.load(f)
        assert m.p == math.prod(lv.fanout for lv in m.levels) and m.p >= 2, f
        assert m.source and m.device.flops["float32"] > 0 and m.device.memory_bytes > 0, f
        for lv in m.levels:
            assert lv.fanout & (lv.fanout - 1) == 0, (f, lv)        # powers of two in the files
            assert math.isinf(lv.bandwidth[-1][0])
        assert hm.loads(m.to_toml()) == m, f
    local = hm.load(os.path.join(ROOT, "machines", "local-2vcpu.toml"))
    assert [(lv.name, lv.fanout) for lv in local.levels] == [("node", 2)]
    assert local.levels[0].latency_s == 1.9e-6 and local.device.flops["float64"] == 50e9
    gpu = hm.load(GPU)
    assert [(lv.name, lv.fanout) for lv in gpu.levels] == [("node", 8), ("cluster", 512)]
    assert gpu.p == 4096 and gpu.device.flops["bfloat16"] == 312e12
    assert gpu.device.compute_seconds(312e12, "bfloat16") == 1.0


def test_bisections_outermost_first():
    gpu = hm.load(GPU)
    at8 = gpu.with_devices(8)                        # one node: every cut inside it
    assert [lv.fanout for lv in at8.levels] == [8, 1] and at8.p == 8
    assert [at8.bisection_level(k).name for k in range(3)] == ["node"] * 3
    at32 = gpu.with_devices(32)                      # 4 nodes: the first two cuts between nodes
    assert [at32.bisection_level(k).name for k in range(5)] == ["cluster"] * 2 + ["node"] * 3
    assert [gpu.bisection_level(k).name for k in (0, 8, 9, 11)] == ["cluster"] * 2 + ["node"] * 2
    with pytest.raises(ValueError, match=r"bisection k = 5 out of range 0..4 \(p = 32\)"):
        at32.bisection_level(5)
    with pytest.raises(ValueError, match="p = 24 is not a power of two"):
        gpu.with_devices(24).bisection_level(0)
    arch = hm.load(os.path.join(ROOT, "machines", "archer2.toml")).with_devices(512)
    assert [arch.bisection_level(k).name for k in range(9)] == \
        ["cluster"] * 2 + ["node"] + ["socket"] * 6


def test_a_slowed_device_prices_every_one_of_its_seconds_that_much_longer():
    """Device.slowed(c): a Linear's pass (FLOPs, fixed and element-wise seconds), a ReLU's
    output, an optimizer step and a stream through memory each take c times as long; fractions
    and the tokens slowdown stay; c must be finite and > 0."""
    d = hm.Device("d", {"float32": 1e10, "float64": 5e9}, 1e10, 1e12,
                  efficiency={"linear": 0.5}, overhead={"linear": 1e-5},
                  elementwise={"linear": 2e-10}, activation={"linear": 3e-10},
                  forward={"linear": 0.4}, split={"linear": (0.6, 0.4)},
                  update={"adamw": ((1e4, 3e-9), (math.inf, 2e-9))},
                  tokens={"linear": ((32, 1.5), (math.inf, 1.0))})
    s = d.slowed(1.25)
    for fwd in (True, False):
        assert s.pass_seconds(1e9, "float64", "linear", 3, 1e6, fwd, tokens=32) == \
            pytest.approx(1.25 * d.pass_seconds(1e9, "float64", "linear", 3, 1e6, fwd, tokens=32),
                          rel=1e-12)
    assert s.activation["linear"] == pytest.approx(1.25 * 3e-10, rel=1e-12)
    assert s.update_seconds(5e4, "adamw") == pytest.approx(1.25 * d.update_seconds(5e4, "adamw"),
                                                            rel=1e-12)
    assert s.stream_seconds(1e6) == pytest.approx(1.25 * d.stream_seconds(1e6), rel=1e-12)
    assert (s.efficiency, s.forward, s.split, s.tokens) == (d.efficiency, d.forward, d.split,
                                                            d.tokens)
    assert s.memory_bytes == d.memory_bytes and d.slowed(1.0) == d
    for bad in (0, -1.0, math.inf, math.nan, "2"):
        with pytest.raises(ValueError, match="device slowdown factor"):
            d.slowed(bad)


def test_level_for_group_and_with_devices():
    m = small()
    assert m.p == 32
    assert [m.level_for_group(s).name for s in (1, 2, 4, 8, 16, 32)] == \
        ["node"] * 3 + ["cluster"] * 3
    assert m.level_for_group(3).name == "cluster"    # 3 consecutive devices straddle nodes
    for bad in (0, 33):
        with pytest.raises(ValueError, match=f"group size {bad} out of range 1..32"):
            m.level_for_group(bad)
    assert [lv.fanout for lv in m.with_devices(2).levels] == [2, 1]
    assert [lv.fanout for lv in m.with_devices(12).levels] == [4, 3]
    assert m.with_devices(32) == m
    cut = m.with_devices(8)
    assert cut.levels[0] == m.levels[0] and cut.levels[1].latency_s == 5e-6 and cut.p == 8
    with pytest.raises(ValueError, match="6 devices do not fit: the children of level 'cluster' hold 4 "):
        m.with_devices(6)
    with pytest.raises(ValueError, match=r"devices = 64: expected 1..32"):
        m.with_devices(64)


def test_message_seconds_piecewise():
    node, cluster = small().levels
    assert node.seconds_per_byte(0) == node.seconds_per_byte(2**20) == 1e-10
    assert node.seconds_per_byte(2**20 + 1) == 5e-11
    assert node.message_seconds(2**20) == pytest.approx(1e-6 + 2**20 / 1e10, rel=1e-15)
    assert node.message_seconds(2**24) == pytest.approx(1e-6 + 2**24 / 2e10, rel=1e-15)
    assert cluster.message_seconds(8) == pytest.approx(5e-6 + 8e-9, rel=1e-15)
    with pytest.raises(ValueError, match="nbytes = -1"):
        node.message_seconds(-1)
    dev = small().device
    assert dev.compute_seconds(1e12) == 1.0 and dev.compute_seconds(1e12, "float64") == 2.0
    with pytest.raises(ValueError, match="no rate for dtype 'bfloat16' \\(has float32, float64\\)"):
        dev.compute_seconds(1.0, "bfloat16")


def test_round_trip_through_a_file(tmp_path):
    m = small()
    path = tmp_path / "m.toml"
    path.write_text(m.to_toml())
    back = hm.load(path)
    assert back == m and back.levels[0].bandwidth == ((2.0**20, 1e10), (math.inf, 2e10))
    assert back.device.efficiency == {"transformer": 0.5}
    assert back.device.overhead == {"transformer": 1e-4, "linear": 0.0}
    # a kind's efficiency and fixed cost price exactly its blocks; other kinds run at the rate
    assert back.device.compute_seconds(1e12, "float32", "transformer", calls=3) == 2.0 + 3e-4
    assert back.device.compute_seconds(1e12, "float32", "transformer", 3, 1e6) == pytest.approx(
        2.0 + 3e-4 + 1e-3, rel=1e-12)
    assert back.device.elementwise == {"transformer": 1e-9}
    assert back.device.compute_seconds(1e12, "float32", "linear", calls=3) == 1.0
    assert back.device.compute_seconds(1e12, "float32") == 1.0
    # the forward share splits the fixed and element-wise seconds, not the FLOPs
    assert back.device.forward == {"transformer": 0.4}
    fwd = back.device.pass_seconds(1e12, "float32", "transformer", 3, 1e6, True)
    bwd = back.device.pass_seconds(2e12, "float32", "transformer", 3, 1e6, False)
    assert fwd == pytest.approx(2.0 + 0.4 * (3e-4 + 1e-3), rel=1e-12)
    assert bwd == pytest.approx(4.0 + 0.6 * (3e-4 + 1e-3), rel=1e-12)
    assert fwd + bwd == pytest.approx(back.device.compute_seconds(3e12, "float32", "transformer",
                                                                  3, 1e6), rel=1e-12)
    # a kind with no share splits as its FLOPs do: a third forward
    assert back.device.pass_seconds(0, "float32", "linear", 1, 0, True) == 0.0
    third = hm.Device("t", {"float32": 1.0}, 1.0, 1.0, overhead={"k": 3.0})
    assert third.pass_seconds(0, "float32", "k", 1, 0, True) == pytest.approx(1.0)
    odd = hm.Machine('a "quoted" name', (), hm.Device("x", {"f": 1 / 3}, 0.1, 3.5), source="s\\t")
    assert hm.loads(odd.to_toml()) == odd and odd.p == 1


GOOD = small().to_toml()


@pytest.mark.parametrize("old, new, message", [
    ('fanout = 4\n', '', r"levels\[0\]: missing key 'fanout'"),
    ('fanout = 8\n', 'fanout = 0\n', r"levels\[1\]: level 'cluster': fanout = 0: expected an "
                                     r"integer >= 1"),
    ('latency_s = 5e-06', 'latency_s = -5e-06', r"level 'cluster': latency_s = -5e-06: "
                                                r"expected a number >= 0"),
    ('[1048576, 10000000000], [inf', '[1048576, 10000000000], [1024, 1], [inf',
     r"bandwidth\[1\] max_bytes = 1024: the pieces' max_bytes must increase"),
    ('[inf, 20000000000]', '[4194304, 20000000000]', "the last piece's max_bytes must be inf"),
    ('[inf, 1000000000]', '[inf, -1]', r"bandwidth\[0\] bytes_per_s = -1"),
    ('memory_bytes = 16000000000', 'memory_bytes = -1', r"\[device\]: device memory_bytes = -1"),
    ('memory_bytes = 16000000000\n', '', r"\[device\]: missing key 'memory_bytes'"),
    ('"float64" = 500000000000', '"float64" = "fast"', r"device flops.float64 = 'fast'"),
    ('name = "m"\n', '', "missing key 'name'"),
    ('name = "cluster"', 'name = "node"', "level names repeat"),
    ('fanout = 4', 'fanout = [4', "not valid TOML"),
    ('[device.flops]', '[device.flops.x]', r"device flops.x = \{"),
    ('[[levels]]', '[[level]]', "missing key 'levels'"),
    ('bandwidth = [[1048576', 'bandwidth = 3 #', r"levels\[0\]: bandwidth = 3: expected a list"),
    ('"transformer" = 0.5', '"transformer" = 1.5', r"efficiency = \{'transformer': 1.5\}: a "
                                                   "fraction of the rate is at most 1"),
    ('"transformer" = 0.5', '"transformer" = 0', r"device efficiency.transformer = 0"),
    ('"linear" = 0\n', '"linear" = -1\n', r"device overhead.linear = -1: expected a number >= 0"),
    ('"transformer" = 1e-09', '"transformer" = -1e-09', r"device elementwise.transformer = -1e-09"),
    ('"transformer" = 0.4', '"transformer" = 1.0', r"forward = \{'transformer': 1.0\}: a share "
                                                   r"of a forward \+ backward is below 1"),
    ('"transformer" = 0.4', '"transformer" = 0', r"device forward.transformer = 0"),
])
def test_bad_files_name_the_file_and_key(tmp_path, old, new, message):
    assert old in GOOD
    path = tmp_path / "bad.toml"
    path.write_text(GOOD.replace(old, new))
    with pytest.raises(ValueError, match=message) as e:
        hm.load(path)
    assert str(e.value).startswith(str(path)), e.value
    with pytest.raises(ValueError, match="cannot read the machine file"):
        hm.load(tmp_path / "absent.toml")


def test_levels_that_are_not_tables():
    text = GOOD.split("[[levels]]")[0].replace('name = "m"', 'name = "m"\nlevels = [1]')
    with pytest.raises(ValueError, match=r"<string> levels\[0\] = 1: expected a table"):
        hm.loads(text)


# measured seconds per parameter of an optimizer step: points at 100 and 10000 parameters
UPDATE = {"adamw": ((100, 4e-9), (10_000, 2e-9), (math.inf, 1e-9)), "sgd": ((math.inf, 5e-10),)}


def timed():
    """small() with measured optimizer steps."""
    from dataclasses import replace
    m = small()
    return replace(m, device=replace(m.device, update=UPDATE))


def test_update_table_round_trips_and_files_without_it_load_unchanged(tmp_path):
    m = timed()
    text = m.to_toml()
    assert '"adamw" = [[100, 4e-09], [10000, 2e-09], [inf, 1e-09]]' in text
    path = tmp_path / "timed.toml"
    path.write_text(text)
    back = hm.load(path)
    assert back == m and back.device.update == {
        "adamw": ((100.0, 4e-9), (10000.0, 2e-9), (math.inf, 1e-9)), "sgd": ((math.inf, 5e-10),)}
    assert small().device.update == {} and "[device.update]" not in GOOD
    for f in FILES:                                   # the public files carry no table
        assert hm.load(f).device.update == {}, f


def test_update_seconds_interpolates_in_log_params():
    dev = timed().device
    at = dev.update_seconds
    assert at(100, "adamw") == pytest.approx(100 * 4e-9, rel=1e-12)          # at the points
    assert at(10_000, "adamw") == pytest.approx(10_000 * 2e-9, rel=1e-12)
    assert at(1000, "adamw") == pytest.approx(1000 * 3e-9, rel=1e-12)        # halfway in log
    # a quarter of the way in log (100 -> 316.2): 4e-9 - 0.25 x 2e-9
    assert at(10 ** 2.5, "adamw") == pytest.approx(10 ** 2.5 * 3.5e-9, rel=1e-12)
    assert at(10, "adamw") == pytest.approx(10 * 4e-9, rel=1e-12)            # below: the first
    assert at(0, "adamw") == 0.0
    assert at(10_001, "adamw") == pytest.approx(10_001 * 1e-9, rel=1e-12)    # above: the last
    assert at(1e9, "adamw") == pytest.approx(1.0, rel=1e-12)
    assert at(1e6, "sgd") == pytest.approx(5e-4, rel=1e-12)                  # one piece: flat
    assert at(1e6, "lion") is None and small().device.update_seconds(1e6, "adamw") is None
    for bad in (-1, math.inf, "10"):
        with pytest.raises(ValueError, match=rf"n_params = {bad!r}: expected a finite number"):
            at(bad, "adamw")


TIMED = timed().to_toml()


@pytest.mark.parametrize("old, new, message", [
    ("[10000, 2e-09]", "[50, 2e-09]", r"\[device\]: device update.adamw\[1\] max_params = 50: "
                                      r"the pieces' max_params must increase \(previous 100.0\)"),
    ("[inf, 1e-09]", "[20000, 1e-09]", r"update.adamw = .*: the last piece's max_params must "
                                       r"be inf"),
    ("[100, 4e-09]", "[100, -4e-09]", r"update.adamw\[0\] seconds_per_param = -4e-09: expected a "
                                      r"number > 0"),
    ("[100, 4e-09]", "[100, inf]", r"update.adamw\[0\] seconds_per_param = inf: expected a finite"),
    ("[100, 4e-09]", "[100, nan]", r"update.adamw\[0\] seconds_per_param = nan"),
    ("[100, 4e-09]", "[100]", r"update.adamw\[0\] = \[100\]: expected \[max_params, "
                              r"seconds_per_param\]"),
    ("[100, 4e-09]", '["many", 4e-09]', r"update.adamw\[0\] max_params = 'many': expected a "
                                        r"number"),
    ('"sgd" = [[inf, 5e-10]]', '"sgd" = 5e-10', r"update.sgd = 5e-10: expected a list of "
                                                r"\[max_params, seconds_per_param\]"),
    ('"sgd" = [[inf, 5e-10]]', '"sgd" = []', r"update.sgd = \[\]: the last piece's max_params"),
    ("[device.update]", "[device.update.x]", r"update.x = \{'adamw': .*: expected a list of"),
])
def test_bad_update_tables_name_the_file_and_values(tmp_path, old, new, message):
    assert TIMED.count(old) == 1
    path = tmp_path / "bad.toml"
    path.write_text(TIMED.replace(old, new))
    with pytest.raises(ValueError, match=message) as e:
        hm.load(path)
    assert str(e.value).startswith(f"{path} [device]: "), e.value
    with pytest.raises(ValueError, match=r"update = 3: expected a table optimizer ->"):
        hm.Device("d", {"float32": 1.0}, 1.0, 1.0, update=3)


def test_this_machine_prefers_the_named_file(tmp_path, monkeypatch):
    path = tmp_path / "here.toml"
    path.write_text(GOOD)
    monkeypatch.setenv(hm.ENV, str(path))
    assert hm.this_machine() == small()
    monkeypatch.setenv(hm.ENV, str(tmp_path / "none.toml"))
    with pytest.raises(ValueError, match="none.toml: cannot read"):
        hm.this_machine()
    monkeypatch.delenv(hm.ENV)
    local = os.path.join(hm.MACHINES, "local.toml")
    expected = local if os.path.exists(local) else os.path.join(hm.MACHINES, "local-2vcpu.toml")
    assert hm.this_machine() == hm.load(expected)


def test_fit_level_from_measured_times():
    sizes = [8, 1024, 2**20, 2**26]
    # one-way times of a link with 2 us latency, 1 GB/s to 1 KiB, 4 GB/s to 1 MiB, 10 GB/s beyond
    seconds = [2e-6, 2e-6 + 1024 / 1e9, 2e-6 + 2**20 / 4e9, 2e-6 + 2**26 / 1e10]
    lv = fit_level(sizes, seconds, fanout=4)
    assert lv.name == "node" and lv.fanout == 4 and lv.latency_s == 2e-6
    assert [m for m, _ in lv.bandwidth] == [1024, 2**20, math.inf]
    assert [r for _, r in lv.bandwidth] == pytest.approx([1e9, 4e9, 1e10], rel=1e-9)
    for n, t in zip(sizes[1:], seconds[1:]):
        assert lv.message_seconds(n) == pytest.approx(t, rel=1e-9)
    noisy = fit_level([8, 1024], [3e-6, 2.9e-6], fanout=2)   # no time above the latency
    assert noisy.bandwidth == ((math.inf, pytest.approx(1024 / 2.9e-7, rel=1e-12)),)
    with pytest.raises(ValueError, match="increasing sizes"):
        fit_level([1024, 8], [1e-6, 2e-6], fanout=2)
    # a stall while the smallest size was timed (the 4-rank calibration's 1.4 ms at 8 B against
    # 33 us at 1 KiB) is not taken as the latency: no size is priced above a larger one
    stalled = fit_level(sizes, [1.4e-3] + seconds[1:], fanout=4)
    assert stalled.latency_s == seconds[1]
    assert all(stalled.message_seconds(a) <= stalled.message_seconds(b)
               for a, b in zip(sizes, sizes[1:]))
    assert fit_level(sizes, seconds, fanout=4) == lv                 # monotone times: unchanged


def test_shared_figures_slow_cpu_time_by_the_sustained_ratio():
    """What a rank gets while every rank computes: rates divided by their own slowdown; without
    the kinds' own factors the fixed seconds multiplied by the float32 one and the element-wise
    seconds by the copy's; with them, by the kind's; ratios unchanged."""
    from hpcnn.plan.calibrate.shared import shared_figures
    alone = {"float32": 100.0, "float64": 50.0, "copy": 10.0, "efficiency.linear": 0.9,
             "overhead.linear": 2e-5, "elementwise.linear": 3e-10, "forward.linear": 0.45,
             "update.sgd": ((1024, 1e-9), (math.inf, 2e-9))}
    got = shared_figures(alone, {"float32": 120.0, "float64": 60.0, "copy": 12.0},
                         {"float32": 60.0, "float64": 20.0, "copy": 8.0})
    (top, per), (inf, per_inf) = got.pop("update.sgd")
    assert (top, inf) == (1024, math.inf) and (per, per_inf) == pytest.approx((2e-9, 4e-9))
    assert got == pytest.approx({"float32": 50.0, "float64": 50.0 / 3, "copy": 10.0 / 1.5,
                                 "efficiency.linear": 0.9, "overhead.linear": 4e-5,
                                 "elementwise.linear": 4.5e-10, "forward.linear": 0.45,
                                 "slowdown": 2.0}, rel=1e-12)
    # all at once no faster than alone: a ratio below 1 is the windows' noise and counts as 1
    faster = shared_figures(alone, {"float32": 100.0, "float64": 50.0, "copy": 10.0},
                            {"float32": 104.0, "float64": 50.0, "copy": 11.0})
    assert faster["slowdown"] == 1.0 and faster["float32"] == 100.0 and faster["copy"] == 10.0
    assert faster["elementwise.linear"] == 3e-10
    # with the kind's own reference blocks timed (block.linear), its fixed, element-wise and
    # ReLU-output seconds slow by their factor (2.5 here, not the copy's 1.5 or the matmul's 2)
    # and its efficiency by matmul / kind, so a block alone at t is priced 2.5 t
    own = shared_figures({**alone, "activation.linear": 5e-10},
                         {"float32": 120.0, "float64": 60.0, "copy": 12.0, "block.linear": 50.0},
                         {"float32": 60.0, "float64": 20.0, "copy": 8.0, "block.linear": 20.0})
    assert own["overhead.linear"] == pytest.approx(5e-5, rel=1e-12)
    assert own["elementwise.linear"] == pytest.approx(7.5e-10, rel=1e-12)
    assert own["activation.linear"] == pytest.approx(12.5e-10, rel=1e-12)
    assert own["efficiency.linear"] == pytest.approx(0.9 * 2 / 2.5, rel=1e-12)
    assert own["slowdown.linear"] == pytest.approx(2.5) and own["slowdown"] == 2.0
    flops = 1e9                           # the matmul part: rate / 2, efficiency x 2 / 2.5
    assert flops / (own["float32"] * own["efficiency.linear"]) == pytest.approx(
        2.5 * flops / (alone["float32"] * alone["efficiency.linear"]), rel=1e-12)
    # with the step engine's GPT timed (engine.transformer), that kind's element-wise and
    # ReLU-output seconds slow as its steps (1.25 here), not as the copy (1.5); others as before
    eng = shared_figures({**alone, "elementwise.transformer": 4e-10, "activation.linear": 5e-10},
                         {"float32": 120.0, "float64": 60.0, "copy": 12.0,
                          "engine.transformer": 10.0},
                         {"float32": 60.0, "float64": 20.0, "copy": 8.0, "engine.transformer": 8.0})
    assert eng["elementwise.transformer"] == pytest.approx(5e-10, rel=1e-12)
    assert eng["elementwise.linear"] == pytest.approx(4.5e-10, rel=1e-12)
    assert eng["activation.linear"] == pytest.approx(7.5e-10, rel=1e-12)
    assert eng["engine.transformer"] == pytest.approx(1.25) and eng["slowdown"] == 2.0
    # a kind slowing less than the matmul would be priced above 1: capped
    capped = shared_figures(alone, {"float32": 120.0, "float64": 60.0, "copy": 12.0,
                                    "block.linear": 50.0},
                            {"float32": 60.0, "float64": 20.0, "copy": 8.0, "block.linear": 40.0})
    assert capped["efficiency.linear"] == 1.0


def test_sustained_medians_alternate_alone_and_together_windows(monkeypatch):
    """Rank 0's window alone, then every rank's at once, alternated: each figure the median over
    its rounds (one burst of load on a window does not set the calibration)."""
    from mpi4py import MPI

    from hpcnn.plan.calibrate import shared
    calls = []
    script = iter([{"float32": 100.0}, {"float32": 50.0}, {"float32": 300.0},
                   {"float32": 10.0}, {"float32": 200.0}, {"float32": 60.0}])

    def fake(seconds, blocks=False, engine=False):
        calls.append((seconds, blocks, engine))
        return next(script)
    monkeypatch.setattr(shared, "sustained_rates", fake)
    alone, together = shared.sustained_medians(MPI.COMM_SELF, 0.25, True, 3)
    assert alone == {"float32": 200.0} and together == {"float32": 50.0}
    assert calls == [(0.25, True, False)] * 6


def test_fit_handoff_recovers_the_wait_at_the_given_bubble_weight():
    """The handoff fit: pipelines priced with a known wait per exchange at the given bubble
    weight give that wait back, one point per shape at its stage pass, and the weight."""
    from dataclasses import replace

    from hpcnn.plan.calibrate.contention import _fit_handoff
    from hpcnn.plan import hybrid
    base = hm.load(os.path.join(ROOT, "machines", "local-2vcpu.toml"))

    def step(model, layout, h):
        m = replace(base, levels=tuple(replace(lv, handoff=((0.0, h),), bubble_weight=0.5)
                                       for lv in base.levels))
        return hybrid.price(model, layout, m).step_s

    runs, waits = [], (2e-4, 5e-4)
    for dim, h in zip((64, 128), waits):
        pair = []
        for micro in (2, 8):
            model = hybrid.Transformer(2, dim, 4, 64, 16, micro, "float32")
            layout = hybrid.Layout(1, 1, 2, micro, "1f1b", "none")
            pair.append((step(model, layout, h), model, layout))
        runs.append(pair)
    points, weight = _fit_handoff(runs, base, 0.5)
    assert weight == 0.5 and [w for _, w in points] == pytest.approx(waits, rel=1e-6)
    assert [a for a, _ in points] == sorted(a for a, _ in points)


def test_calibrate_write_on_one_rank(tmp_path):
    """One rank writes a file without a network level (the figures themselves are timed and
    checked by the two-rank calibration below, the same function); the command refuses a
    missing directory and zero rounds before timing anything."""
    from hpcnn.plan.calibrate import machine_text
    alone = {"float32": 1e11, "float64": 5e10, "copy": 2e10, "efficiency.transformer": 0.9,
             "overhead.transformer": 1.5e-4, "elementwise.transformer": 8e-10,
             "forward.transformer": 0.5, "split.transformer": (0.6, 0.5),
             "tokens.transformer": ((64, 1.8), (512, 1.0), (math.inf, 1.0)),
             "update.adamw": ((16384.0, 1e-8), (math.inf, 3e-9))}
    meas = {"alone": alone, "together": {**alone, "slowdown": 1.0}, "sizes": [8],
            "seconds": None, "reduce_sizes": [], "reduce_seconds": None, "cold": True,
            "ranks_here": 1, "cpu": "cpu: test", "handoff": None, "update": None,
            "after_compute": None, "collective_scale": None}
    text = machine_text(meas, "one", 1)
    m = hm.loads(text)
    assert m.name == "one" and m.levels == () and m.p == 1
    assert m.device.tokens == {"transformer": alone["tokens.transformer"]}
    assert m.device.update == {"adamw": alone["update.adamw"]}
    assert "One rank: no network level" in text
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    bad = subprocess.run([sys.executable, "-m", "hpcnn", "calibrate",
                          f"--write={tmp_path / 'no' / 'x.toml'}"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "no such directory" in bad.stderr
    zero = subprocess.run([sys.executable, "-m", "hpcnn", "calibrate",
                           f"--write={tmp_path / 'x.toml'}", "--rounds=0"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert zero.returncode == 2 and "--rounds=0" in zero.stderr
    from hpcnn.cli_tools import CALIBRATE        # the CLI's default is the full calibration
    from hpcnn.plan.calibrate import FULL_ROUNDS
    assert CALIBRATE["rounds"][0] == FULL_ROUNDS


def test_layout_scale_fits_the_pairs_scale_apart_on_four_ranks():
    assert "layout_scale_pairs OK on 4 ranks" in run_mpi("layout_scale_pairs", 4, timeout=120)


@pytest.mark.long     # ~13 s, and its floors on small allreduces assume a machine not overloaded
def test_calibrate_write_on_two_ranks(tmp_path):
    out = run_mpi("machine_calibration", 2, tmp_path)
    assert "machine_calibration OK on 2 ranks" in out
    assert f"wrote {os.path.join(str(tmp_path), 'here.toml')}" in out      # rank 0 only
    assert out.count("wrote ") == 1


def test_a_machine_is_found_by_name_from_anywhere(tmp_path, monkeypatch):
    from hpcnn.plan.machine import MACHINES, load, resolve
    monkeypatch.chdir(tmp_path)                       # not the repository
    want = load(os.path.join(MACHINES, "archer2.toml"))
    for name in ("machines/archer2.toml", "archer2.toml", "archer2"):
        assert load(name) == want, name
    (tmp_path / "archer2.toml").write_text(want.to_toml().replace("archer2", "mine", 1))
    assert resolve("archer2.toml") == "archer2.toml"  # a file here wins
    with pytest.raises(ValueError, match="nope.toml: cannot read the machine file"):
        load("nope.toml")


def test_backward_halves_round_trip_and_default():
    dev = hm.Device("d", {"float32": 1.0}, 1.0, 1.0, split={"transformer": (0.66, 0.47)})
    m = hm.Machine("m", (hm.Level("node", 2, 1e-6, ((math.inf, 1e9),)),), dev)
    back = hm.loads(m.to_toml())
    assert back == m and back.device.backward_halves("transformer") == (0.66, 0.47)
    assert back.device.backward_halves("linear") == (0.5, 0.5)
    for bad, message in (({"t": 0.5}, r"split.t = 0.5: expected \[input, weight\]"),
                         ({"t": (0.5, -1)}, r"device split.t = -1"),
                         ({"t": (1, 2, 3)}, r"split.t = \(1, 2, 3\)")):
        with pytest.raises(ValueError, match=message):
            hm.Device("d", {"float32": 1.0}, 1.0, 1.0, split=bad)


def test_a_levels_reduce_rate_prices_the_ring_steps():
    """With ``reduce_bandwidth`` an allreduce's 2(n-1) steps go at its rate; without it a step is
    one message. The pieces round-trip through the file and are fitted from allreduce times."""
    from hpcnn.plan.calibrate.links import fit_reduce
    plain = hm.Level("node", 4, 1e-6, ((math.inf, 1e10),))
    assert plain.allreduce_seconds(4e6, 4) == pytest.approx(6 * (1e-6 + 1e6 / 1e10), rel=1e-12)
    assert plain.allreduce_seconds(4e6, 1) == plain.allreduce_seconds(0, 4) == 0.0
    lv = hm.Level("node", 4, 1e-6, ((math.inf, 1e10),), ((1e5, 5e8), (math.inf, 2e9)))
    assert lv.reduce_step_seconds(1e5) == pytest.approx(1e-6 + 1e5 / 5e8, rel=1e-12)
    assert lv.allreduce_seconds(4e6, 4) == pytest.approx(6 * (1e-6 + 1e6 / 2e9), rel=1e-12)
    assert lv.allreduce_seconds(4e6, 2) == pytest.approx(2 * (1e-6 + 2e6 / 2e9), rel=1e-12)
    m = hm.Machine("m", (lv,), hm.Device("d", {"float32": 1.0}, 1.0, 1.0))
    assert hm.loads(m.to_toml()) == m
    assert "reduce_bandwidth = [[100000, 500000000], [inf, 2000000000]]" in m.to_toml()
    with pytest.raises(ValueError, match=r"reduce_bandwidth\[0\] bytes_per_s = -1"):
        hm.Level("node", 2, 0.0, ((math.inf, 1.0),), ((math.inf, -1),))
    # the fit inverts the pricing: times made by a level's own steps give its pieces back
    sizes = [4096, 1 << 20, 1 << 24]
    times = [6 * (1e-6 + s / 4 / r) for s, r in zip(sizes, (1e9, 3e9, 2e9))]
    pieces = fit_reduce(sizes, times, 4, 1e-6)
    assert [p[0] for p in pieces] == [1024, 1 << 18, math.inf]
    assert [p[1] for p in pieces] == pytest.approx([1e9, 3e9, 2e9], rel=1e-9)
    with pytest.raises(ValueError, match="expected >= 2 ranks"):
        fit_reduce(sizes, times, 1, 1e-6)
    # a stalled small size is priced as the next larger one at most
    stalled = fit_reduce(sizes, [1.0, *times[1:]], 4, 1e-6)
    assert stalled[1:] == pieces[1:]
    assert stalled[0][1] == pytest.approx(1024 / (times[1] / 6 - 1e-6), rel=1e-12)


def test_activation_bytes_priced_apart_and_round_trip():
    """A ReLU's output bytes at the kind's activation figure, the cache at its element-wise one;
    without an activation figure both at the element-wise one (the files written before)."""
    dev = hm.Device("d", {"float32": 1e12}, 1.0, 1.0, elementwise={"linear": 1e-10},
                    activation={"linear": 5e-10})
    m = hm.Machine("m", (), dev)
    back = hm.loads(m.to_toml())
    assert back == m and back.device.activation == {"linear": 5e-10}
    assert back.device.compute_seconds(0, "float32", "linear", 0, 1e6, 2e6) == pytest.approx(
        1e-4 + 1e-3, rel=1e-12)
    plain = hm.Device("p", {"float32": 1e12}, 1.0, 1.0, elementwise={"linear": 1e-10})
    assert plain.compute_seconds(0, "float32", "linear", 0, 1e6, 2e6) == pytest.approx(3e-4)
    with pytest.raises(ValueError, match="activation.linear"):
        hm.Device("d", {"float32": 1.0}, 1.0, 1.0, activation={"linear": -1.0})


def test_a_calibration_round_separates_input_and_activation_bytes():
    """Three references whose times were made from known figures give those figures back; a
    round whose exact solution is not physical falls back to one figure for all bytes."""
    from hpcnn.plan.calibrate.blocks import _solve_round
    rate, inv_e, c, a = 1e11, 1.25, 1e-10, 5e-10
    refs = [(2e9, 1e6, 1e6), (3e8, 5e5, 5e5), (6e8, 2.5e5, 2e6)]     # square, square, rectangle
    rows = [(f, q, qa, f / rate * inv_e + q * c + qa * a) for f, q, qa in refs]
    assert _solve_round(rate, rows) == pytest.approx((inv_e, c, a), rel=1e-9)
    # times that would need a negative input figure: one figure from the two square blocks
    rows[2] = (6e8, 2.5e5, 2e6, 1e-4)
    u, w, v = _solve_round(rate, rows)
    assert w == v and u >= 1 and w >= 0
    assert _solve_round(rate, rows[:2]) == (u, w, v)


def test_a_levels_handoff_is_paid_once_per_message_and_per_allreduce():
    """``handoff`` (ranks sharing cores: a blocking exchange waits for its peer's core, longer
    after longer compute) adds H(c) once to a message and once to an allreduce, whatever its
    ring steps, c the compute before it: linear between the points, flat outside; it and the
    ``bubble_weight`` round-trip through the file, are written only when set, an older file's
    scalar ``handoff_s`` reads as one flat point, and bad values are named."""
    plain = hm.Level("node", 4, 1e-6, ((math.inf, 1e10),), ((math.inf, 2e9),))
    shared = replace(plain, handoff=((1e-4, 2e-5), (1e-3, 2e-4)))
    for after, h in ((0.0, 2e-5), (1e-4, 2e-5), (5.5e-4, 1.1e-4), (1e-3, 2e-4), (1.0, 2e-4)):
        assert shared.handoff_after(after) == pytest.approx(h, rel=1e-12), after
        assert shared.message_seconds(1000, after) == pytest.approx(
            plain.message_seconds(1000) + h, rel=1e-12)
        for n in (2, 4):
            assert shared.allreduce_seconds(4e6, n, after) == pytest.approx(
                plain.allreduce_seconds(4e6, n) + h, rel=1e-12)
    assert plain.handoff_after(1.0) == 0.0 and plain.bubble_weight == 1.0
    assert shared.reduce_step_seconds(1e5) == plain.reduce_step_seconds(1e5)
    assert shared.allreduce_seconds(4e6, 1) == shared.allreduce_seconds(0, 4) == 0.0
    dev = hm.Device("d", {"float32": 1.0}, 1.0, 1.0)
    m = hm.Machine("m", (replace(shared, bubble_weight=0.4),), dev)
    text = m.to_toml()
    assert hm.loads(text) == m and "handoff = [[0.0001, 2e-05], [0.001, 0.0002]]" in text
    assert "bubble_weight = 0.4" in text
    assert "handoff" not in hm.Machine("m", (plain,), dev).to_toml()
    assert "bubble_weight" not in hm.Machine("m", (plain,), dev).to_toml()
    old = hm.loads(hm.Machine("m", (plain,), dev).to_toml().replace(
        'latency_s', 'handoff_s = 3e-5\nlatency_s'))
    assert old.levels[0].handoff == ((0.0, 3e-5),) and old.levels[0].handoff_after(1.0) == 3e-5
    for field, bad, message in (
            ("handoff", ((0.0, -1e-4),), r"handoff\[0\] seconds = -0.0001: expected a number >= 0"),
            ("handoff", ((0.0, math.inf),), r"handoff\[0\] = \[0.0, inf\]: expected finite"),
            ("handoff", ((1e-3, 1e-4), (1e-4, 1e-4)), r"handoff\[1\] after_s = 0.0001: the "
             r"points' after_s must increase \(previous 0.001\)"),
            ("handoff", (("x", 1e-4),), r"handoff\[0\] after_s = 'x': expected a number"),
            ("handoff", 1e-4, r"handoff = 0.0001: expected a list of \[after_s, seconds\]"),
            ("bubble_weight", 0.0, "bubble_weight = 0.0: expected a number > 0"),
            ("bubble_weight", 1.5, r"bubble_weight = 1.5: expected a number in \(0, 1\]")):
        with pytest.raises(ValueError, match=f"level 'node': {message}"):
            replace(plain, **{field: bad})


def test_a_levels_collectives_after_compute_are_read_off_their_curves():
    """``after_compute`` (ranks sharing cores: what a collective took after a pass of compute)
    gives a collective's seconds: on the curve of the measured group size nearest n (in log n),
    linear in bytes between its sizes (the first size's seconds below, the last two sizes' slope
    past them), linear in the compute c between the measured c (flat outside); no curve of the
    kind: None. It round-trips through the file, is written only when set, and bad tables are
    named."""
    curves = {"allreduce.2": ((1e-3, 8, 1e-4), (1e-3, 1024, 2e-4), (1e-3, 2048, 4e-4),
                              (4e-3, 8, 3e-4), (4e-3, 1024, 4e-4), (4e-3, 2048, 8e-4)),
              "allreduce.8": ((1e-3, 8, 1e-3), (1e-3, 1024, 1e-3)),
              "alltoall.8": ((2e-3, 16, 5e-5), (2e-3, 32, 6e-5))}
    plain = hm.Level("node", 8, 1e-6, ((math.inf, 1e10),))
    lv = replace(plain, after_compute=curves)
    for n, nbytes, after, want in (
            (2, 8, 1e-3, 1e-4), (2, 0, 0.0, 1e-4),               # below the first size, c
            (2, 516, 1e-3, 1.5e-4), (2, 1536, 1e-3, 3e-4),       # between sizes
            (2, 4096, 1e-3, 8e-4),                               # past the last: its slope
            (2, 1024, 2.5e-3, 3e-4), (2, 1024, 1.0, 4e-4),       # between and past the c
            (3, 1024, 1e-3, 2e-4),                               # nearest: 2 (log 3/2 < log 8/3)
            (4, 1024, 1e-3, 1e-3),                               # a tie in log n: the larger
            (16, 1024, 1e-3, 1e-3), (8, 24, 0.0, 5.5e-5)):
        kind = "alltoall" if nbytes == 24 else "allreduce"
        assert lv.collective_seconds(kind, n, nbytes, after) == pytest.approx(want, rel=1e-12), \
            (n, nbytes, after)
    assert plain.collective_seconds("allreduce", 2, 8) is None
    assert replace(plain, after_compute={"alltoall.2": ((0, 8, 1e-4),)}).collective_seconds(
        "allreduce", 2, 8) is None
    dev = hm.Device("d", {"float32": 1.0}, 1.0, 1.0)
    m = hm.Machine("m", (lv,), dev)
    text = m.to_toml()
    assert hm.loads(text) == m and "[levels.after_compute]" in text
    assert '"alltoall.8" = [[0.002, 16, 5e-05], [0.002, 32, 6e-05]]' in text
    assert "after_compute" not in hm.Machine("m", (plain,), dev).to_toml()
    # collective_scale: every figure read off the curves times it; written only when not 1
    scaled = replace(lv, collective_scale=2.5)
    assert scaled.collective_seconds("allreduce", 2, 1536, 1e-3) == pytest.approx(7.5e-4)
    assert scaled.collective_seconds("alltoall", 8, 24) == pytest.approx(2.5 * 5.5e-5)
    m2 = hm.Machine("m", (scaled,), dev)
    assert hm.loads(m2.to_toml()) == m2 and "collective_scale = 2.5" in m2.to_toml()
    assert "collective_scale" not in text
    for bad, message in ((0.0, "expected a number > 0"), (-1.0, "expected a number > 0"),
                         (math.inf, "expected a finite number > 0"), ("x", "expected a number")):
        with pytest.raises(ValueError, match=f"level 'node': collective_scale = .*: {message}"):
            replace(plain, collective_scale=bad)
    # group_scales: the curves of that group size times their own scale, the others' as before
    own = replace(scaled, group_scales=((2, 0.5),))
    assert own.collective_seconds("allreduce", 2, 1536, 1e-3) == pytest.approx(1.5e-4)
    assert own.collective_seconds("alltoall", 8, 24) == pytest.approx(2.5 * 5.5e-5)
    assert own.scale_of(2) == 0.5 and own.scale_of(8) == 2.5
    assert own.curve_group("allreduce", 3) == 2
    assert own.curve_group("allreduce", 4) == 8 and own.curve_group("gather", 2) is None
    m3 = hm.Machine("m", (own,), dev)
    assert hm.loads(m3.to_toml()) == m3 and "group_scales = [[2, 0.5]]" in m3.to_toml()
    for bad, message in (([[3, 0.5]], r"\[0\] n = 3: expected the group size of an after_c"),
                         ([[2, 0.0]], r"\[0\] k = 0.0: expected a number > 0"),
                         ([[2, math.inf]], r"\[0\] k = inf: expected a finite number > 0"),
                         ([[8, 1.0], [2, 1.0]], r"\[1\] n = 2: the group sizes must increase"),
                         ([2, 0.5], r"\[0\] = 2: expected \[n, k\]")):
        with pytest.raises(ValueError, match=f"level 'node': group_scales{message}"):
            replace(lv, group_scales=bad)
    for bad, message in (
            ({"gather.2": ((0, 8, 1e-4),)}, r"after_compute: key 'gather.2': expected \"allr"),
            ({"allreduce.1": ((0, 8, 1e-4),)}, r"after_compute: key 'allreduce.1': expected"),
            ({"allreduce.x": ((0, 8, 1e-4),)}, r"after_compute: key 'allreduce.x': expected"),
            ({"allreduce.2": ()}, r"after_compute\['allreduce.2'\] = \(\): expected a list"),
            ({"allreduce.2": ((0, 8),)}, r"after_compute\['allreduce.2'\]\[0\] = \(0, 8\): "
             r"expected \[c, bytes, seconds\]"),
            ({"allreduce.2": ((0, 8, -1e-4),)},
             r"after_compute\['allreduce.2'\]\[0\] seconds = -0.0001: expected a number >= 0"),
            ({"allreduce.2": ((0, 8, math.inf),)},
             r"after_compute\['allreduce.2'\]\[0\] = \[0, 8, inf\]: expected finite"),
            ({"allreduce.2": ((0, 8, 1e-4), (0, 8, 2e-4))}, r"after_compute\['allreduce.2'\]"
             r"\[1\] bytes = 8: at c = 0 the bytes must increase \(previous 8.0\)"),
            ([1], r"after_compute = \[1\]: expected a table")):
        with pytest.raises(ValueError, match=f"level 'node': {message}"):
            replace(plain, after_compute=bad)


def test_tokens_slowdown_scales_flop_and_elementwise_seconds():
    """A kind's FLOP and element-wise seconds at t tokens per call are slowed by its tokens
    pieces, interpolated in log(tokens) between rungs, the end rungs' below and above, the fixed
    cost not; 1 without a tokens count or for a kind without pieces; the pieces round-trip and
    bad ones are refused."""
    pieces = ((64, 1.3), (256, 1.1), (math.inf, 1.0))
    dev = hm.Device("d", {"float32": 1e11}, 1.0, 1.0, efficiency={"transformer": 0.8},
                    overhead={"transformer": 1e-4}, elementwise={"transformer": 1e-9},
                    forward={"transformer": 0.4}, tokens={"transformer": pieces})
    assert dev.slowdown("transformer", 32) == 1.3 and dev.slowdown("transformer", 4096) == 1.0
    assert dev.slowdown("transformer", 128) == pytest.approx(1.2, rel=1e-12)
    assert dev.slowdown("transformer", None) == dev.slowdown("linear", 32) == 1.0
    flops, cache = 8e7, 1e5                   # 1 ms of FLOPs, 0.1 ms element-wise, 0.1 ms fixed
    assert dev.compute_seconds(flops, "float32", "transformer", 1, cache, tokens=64) == \
        pytest.approx(1.1e-3 * 1.3 + 1e-4, rel=1e-12)
    assert dev.pass_seconds(flops, "float32", "transformer", 1, cache, True, tokens=128) == \
        pytest.approx(1e-3 * 1.2 + 0.4 * (1e-4 + 1e-4 * 1.2), rel=1e-12)
    assert dev.pass_seconds(flops, "float32", "transformer", 1, cache, False) == \
        pytest.approx(1e-3 + 0.6 * 2e-4, rel=1e-12)
    m = hm.Machine("m", (), dev)
    assert hm.loads(m.to_toml()) == m
    assert "[device.tokens]" in m.to_toml()
    with pytest.raises(ValueError, match=r"tokens = -1: expected a finite number >= 0"):
        dev.slowdown("transformer", -1)
    for bad, message in ((((64, 1.5),), "the last piece's tokens must be inf"),
                         (((64, -0.5), (math.inf, 1)), r"tokens.t\[0\] slowdown = -0.5"),
                         (((64, 1.5), (32, 1.2), (math.inf, 1)), "tokens must increase")):
        with pytest.raises(ValueError, match=message):
            hm.Device("d", {"float32": 1.0}, 1.0, 1.0, tokens={"t": bad})


def test_the_tokens_slowdown_is_written_where_it_was_measured_for_the_ranks_at_hand():
    """machine_of keeps the calibrated transformer tokens pieces where ranks were timed cold (a
    core each) and, where ranks share cores, only once shared_figures has timed the ladder's
    bottom rung all at once (engine_low); the linear kind's rows pieces are kept either way."""
    from hpcnn.plan.calibrate import machine_of
    pieces = ((64, 1.8), (128, 1.3), (512, 1.0), (math.inf, 1.0))
    rows = ((32, 1.8), (64, 1.4), (256, 1.0), (math.inf, 1.0))
    tog = {"float32": 1e11, "float64": 5e10, "copy": 1e10, "efficiency.transformer": 0.9,
           "tokens.transformer": pieces, "tokens.linear": rows}
    meas = {"together": tog, "cpu": "cpu: test", "ranks_here": 1, "update": None}
    assert machine_of({**meas, "cold": True}, "m", 1).device.tokens == {"transformer": pieces,
                                                                         "linear": rows}
    assert machine_of({**meas, "cold": False}, "m", 1).device.tokens == {"linear": rows}
    shared = {**meas, "cold": False, "together": {**tog, "engine_low.transformer": 1.5}}
    assert machine_of(shared, "m", 1).device.tokens == {"transformer": pieces, "linear": rows}


def test_a_tokens_ladder_all_at_once_slows_its_small_rungs_by_their_own_sharing():
    """Where ranks share cores, the transformer's tokens pieces are rank 0's alone with each
    rung's slowdown times (bottom rung's sharing factor / top rung's) interpolated in
    log(tokens): the bottom rung by the whole ratio, the top by none, none below 1."""
    from hpcnn.plan.calibrate.shared import _shared_tokens, shared_figures
    pieces = ((64, 1.44), (128, 1.2), (256, 0.98), (512, 1.0), (math.inf, 1.0))
    alone = {"float32": 100.0, "float64": 50.0, "copy": 10.0, "tokens.transformer": pieces}
    rates = {"float32": 100.0, "float64": 50.0, "copy": 10.0}
    got = shared_figures(alone, {**rates, "engine.transformer": 9.0, "engine_low.transformer": 8.0},
                         {**rates, "engine.transformer": 4.0, "engine_low.transformer": 4.0})
    ratio = (8.0 / 4.0) / (9.0 / 4.0)                    # 2.0 / 2.25: small rungs shared better
    want = (1.44 * ratio, max(1.0, 1.2 * ratio ** (2 / 3)), 0.98, 1.0, 1.0)
    assert [t for t, _ in got["tokens.transformer"]] == [t for t, _ in pieces]
    assert [s for _, s in got["tokens.transformer"]] == pytest.approx(want, rel=1e-12)
    assert got["engine_low.transformer"] == 2.0 and got["engine.transformer"] == 2.25
    # without the bottom rung timed all at once, the pieces stay as alone
    plain = shared_figures(alone, {**rates, "engine.transformer": 9.0},
                           {**rates, "engine.transformer": 4.0})
    assert plain["tokens.transformer"] == pieces
    one = ((64, 1.4), (math.inf, 1.0))                 # a ladder of one rung: bottom and top
    assert _shared_tokens(one, 0.5) == one


def test_rows_costs_give_the_linear_kinds_slowdown_by_rows():
    """The rows ladder: one piece per rung of LINEAR_ROWS and one to infinity, 1 at the top rung
    and above, every factor positive and finite (their size is the machine's)."""
    from hpcnn.plan.calibrate.passes import LINEAR_ROWS, rows_costs
    got = rows_costs("float32", 1e-5, repeats=2)
    assert [n for n, _ in got] == [*LINEAR_ROWS[2], math.inf]
    assert [f for _, f in got][-2:] == [1.0, 1.0] and all(0 < f < math.inf for _, f in got), got


def test_a_linears_compute_is_slowed_by_its_rows_per_rank():
    """cost.strategy_cost prices a Linear's FLOP and element-wise seconds at the linear kind's
    rows slowdown for the rows each rank computes (the batch over its batch parts), the fixed
    cost not, and names it S_linear(rows) in the formula."""
    from dataclasses import replace
    from hpcnn.schedule.placement import Cut
    from hpcnn.plan.cost import mlp_graph, strategy_cost
    dev = hm.Device("d", {"float32": 1e10}, 1e10, 1e12, efficiency={"linear": 0.5},
                    overhead={"linear": 1e-5}, elementwise={"linear": 1e-10})
    m = hm.Machine("m", (hm.Level("node", 4, 1e-6, ((math.inf, 1e9),)),), dev)
    slow = replace(m, device=replace(dev, tokens={"linear": ((64, 2.0), (256, 1.0),
                                                             (math.inf, 1.0))}))
    g = mlp_graph([64, 128, 10], 256)
    for cuts, factor in (([Cut(4, 1, 1)] * 2, 2.0), ([Cut(1, 1, 4)] * 2, 1.0)):
        plain, slowed = (strategy_cost(g, cuts, mm).terms[0] for mm in (m, slow))
        assert slowed.seconds - 1e-5 == pytest.approx(factor * (plain.seconds - 1e-5), rel=1e-12)
        assert slowed.formula.startswith(f"S_linear({256 // cuts[0].batch})*(")
        assert "S_linear" not in plain.formula


def with_gemm(points=((1024, 1024, 1024, 8e11),)):
    """small() with published GEMM rates for float32."""
    m = small()
    return replace(m, device=replace(m.device, gemm={"float32": points}))


def test_a_gemm_table_round_trips_is_checked_and_files_without_it_have_none(tmp_path):
    m = with_gemm(((1024, 1024, 1024, 8e11), (64, 64, 64, 1e11)))
    assert hm.loads(m.to_toml()) == m and "[device.gemm]" in m.to_toml()
    assert "[device.gemm]" not in small().to_toml() and small().device.gemm == {}
    for f in FILES:                     # only the public GPU files carry published GEMM rates
        gemm = hm.load(f).device.gemm
        assert bool(gemm) == (os.path.basename(f) in ("dgx-a100-cluster.toml",
                                                      "dgx-h100-cluster.toml",
                                                      "jean-zay-a100.toml")), f
    a100 = hm.load(GPU).device.gemm
    assert a100["bfloat16"] == a100["float16"] == ((16384, 16384, 16384, 256.5e12),)
    text = m.to_toml()
    for old, new, message in (
            ("8e+11", "2e12", r"gemm.float32\[0\] flop_per_s = 2000000000000.0: above the "
                              "float32 peak"),
            ("[1024, 1024, 1024,", "[1024, 0, 1024,", r"gemm.float32\[0\] = \[1024, 0, 1024"),
            ("[64, 64, 64, 1e+11]", "[64, 64, 1e+11]", r"gemm.float32\[1\] = \[64, 64, "),
            ('"float32" = [[', '"int8" = [[', "gemm.int8: expected a dtype")):
        bad = text.replace("800000000000", "8e+11").replace("100000000000]", "1e+11]")
        assert old in bad, old
        with pytest.raises(ValueError, match=message):
            hm.loads(bad.replace(old, new))
    slow = m.device.slowed(4.0)
    assert slow.gemm_seconds(1024, 1024, 1024, "float32") == pytest.approx(
        4 * m.device.gemm_seconds(1024, 1024, 1024, "float32"), rel=1e-12)
    with pytest.raises(ValueError, match="no gemm figures for dtype 'float64'"):
        m.device.gemm_seconds(8, 8, 8, "float64")


def test_a_gemms_waves_fill_by_hand_and_set_its_rate_by_its_shape():
    """fill = batch m n / (waves x processors x tile area), the better orientation, by hand; a
    GEMM's rate is its point's times fill(shape) / fill(point); the backward prices its own two
    results (m x k and k x n), not twice the forward."""
    from hpcnn.plan import gemm
    waves = (108, 256, 128)                                   # the A100 file's
    assert gemm.fill(1024, 10240, 1, waves) == pytest.approx(1024 * 10240 / (3 * 108 * 32768))
    assert gemm.fill(2048, 2304, 1, waves) == pytest.approx(2048 * 2304 / (2 * 108 * 32768))
    # 300 x 128: 2 tiles of 256 x 128 or 3 of 128 x 256, one wave either way
    assert gemm.fill(300, 128, 1, waves) == pytest.approx(300 * 128 / (108 * 32768))
    # where the orientations differ, the better: on 3 processors, 256 x 384 is 3 tiles of
    # 256 x 128 (one full wave) or 4 of 128 x 256 (two waves, half full); 384 x 256 the reverse
    three = (3, 256, 128)
    assert gemm.fill(256, 384, 1, three) == 1.0 and gemm.fill(384, 256, 1, three) == 1.0
    assert gemm.fill(256, 384, 1, (3, 128, 256)) == 1.0 and gemm.fill(0, 5, 1, three) == 1.0
    assert gemm.fill(256, 128, 216, waves) == 1.0 and gemm.fill(5, 5, 1, ()) == 1.0
    m = with_gemm(((1024, 10240, 5120, 2.7e11),))
    dev = replace(m.device, waves=waves)
    assert dev.waves == waves and hm.loads(replace(m, device=dev).to_toml()).device == dev
    full = 2.7e11 / gemm.fill(1024, 10240, 1, waves)
    assert dev.gemm_seconds(2048, 2304, 4096, "float32") == pytest.approx(
        2 * 2048 * 2304 * 4096 / (full * 2048 * 2304 / (2 * 108 * 32768)), rel=1e-12)
    assert dev.gemm_seconds(1024, 10240, 5120, "float32") == pytest.approx(
        2 * 1024 * 10240 * 5120 / 2.7e11, rel=1e-12)          # the point itself: its rate
    shapes = ((2048, 2304, 4096, 1),)
    fwd, _ = gemm.pass_seconds(dev, "float32", shapes, True)
    bwd, flops = gemm.pass_seconds(dev, "float32", shapes, False)
    assert flops == 2 * 2 * 2048 * 2304 * 4096
    assert bwd == pytest.approx(dev.gemm_seconds(2048, 4096, 2304, "float32")
                                + dev.gemm_seconds(4096, 2304, 2048, "float32"), rel=1e-12)
    assert bwd != pytest.approx(2 * fwd, rel=1e-3)            # other results, other waves
    plain = m.device                                          # without waves: twice the forward
    assert gemm.pass_seconds(plain, "float32", shapes, False)[0] == pytest.approx(
        2 * gemm.pass_seconds(plain, "float32", shapes, True)[0], rel=1e-12)


def test_a_waves_table_is_checked_and_only_the_a100_files_have_one():
    device = replace(with_gemm(((1024, 10240, 5120, 2.7e11),)).device, waves=(108, 256, 128))
    toml = replace(with_gemm(), device=device).to_toml()
    assert "[device.waves]" in toml and "processors = 108" in toml
    for old, new, message in (
            ("processors = 108", "processors = 0", r"waves: processors = 0, tile = \[256, 128\]"),
            ("tile = [256, 128]", "tile = [256]", r"waves.tile = \[256\]: expected \[rows"),
            ("processors = 108", "sms = 108", r"waves has keys \['sms', 'tile'\]"),
            ("2.7e+11", "9.95e+11", "fills 0.988 of its waves: .* above the float32 peak")):
        bad = toml.replace("270000000000", "2.7e+11")
        assert old in bad, old
        with pytest.raises(ValueError, match=message):
            hm.loads(bad.replace(old, new))
    with pytest.raises(ValueError, match=r"waves = \(108, 256\): expected \(processors"):
        replace(small().device, waves=(108, 256))
    with pytest.raises(ValueError, match="waves = 5: expected a table"):
        replace(small().device, waves=5)
    # a point whose full-wave rate is the peak itself, slowed: not refused by rounding
    at_peak = replace(with_gemm(((256, 128, 64, 1e12 / 108),)).device, waves=(108, 256, 128))
    assert at_peak.slowed(0.3).waves == (108, 256, 128)
    for f in FILES:
        waves = hm.load(f).device.waves
        assert bool(waves) == (os.path.basename(f) in ("dgx-a100-cluster.toml",
                                                       "jean-zay-a100.toml")), f
    assert hm.load(GPU).device.waves == (108, 256, 128)
    # Jean Zay's nodes: the DGX A100 file's device, its own network (4 x 100 Gb/s a node)
    jz = hm.load(os.path.join(ROOT, "machines", "jean-zay-a100.toml"))
    assert jz.device == hm.load(GPU).device
    assert jz.levels[-1].bandwidth == ((math.inf, 4 * 100e9 / 8 / 8),)


def test_a_gemms_seconds_are_its_roofline():
    """max(FLOPs at the rate of the point nearest in arithmetic intensity, bytes at the memory
    bandwidth): word (mk + kn + mn) bytes, 4 bytes a float32 word, 1e11 B/s in small()."""
    from hpcnn.plan.gemm import intensity
    m = with_gemm(((4096, 4096, 4096, 8e11), (256, 256, 256, 2e11)))
    dev = m.device
    # compute-bound and near the large point: its rate
    assert dev.gemm_seconds(8192, 4096, 2048, "float32") == pytest.approx(
        2 * 8192 * 4096 * 2048 / 8e11, rel=1e-12)
    # near the small point in intensity: its rate (intensity 42.7 > ridge 2e11 / 1e11 = 2)
    assert intensity(256, 256, 256, 4) == pytest.approx(256 / 6)
    assert dev.gemm_seconds(256, 256, 256, "float32", batch=3) == pytest.approx(
        3 * 2 * 256 ** 3 / 2e11, rel=1e-12)
    # a thin GEMM (a matrix-vector product): its bytes at the bandwidth
    assert dev.gemm_seconds(4096, 1, 4096, "float32") == pytest.approx(
        4 * (4096 * 4096 + 4096 + 4096) / 1e11, rel=1e-12)
