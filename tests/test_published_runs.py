"""experiments/published_runs.toml: the published runs the planner is held against (issue 40)
load, are numerous and varied enough, are self-consistent, and a corrupted copy is refused
with a message naming the run and the field."""
import os
import re

import pytest

from hpcnn.plan import machine, published

from mpi_util import ROOT


def test_the_file_loads_with_enough_runs_and_sources():
    runs = published.load()
    assert len(runs) >= 15
    assert len({r.source for r in runs}) >= 3
    assert len({r.name for r in runs}) == len(runs)
    devices = {r.device for r in runs}
    assert any("A100" in d for d in devices) and any("H100" in d for d in devices)
    assert any(r.zero for r in runs) and any(r.sequence_parallel for r in runs)
    assert any(r.virtual and r.virtual > 1 for r in runs)


def test_every_run_is_consistent():
    for r in published.load():
        assert r.tp * r.pp * r.dp == r.devices, r.name
        if r.micro_batch is not None:
            assert r.global_batch % (r.dp * r.micro_batch) == 0, r.name
            assert r.microbatches * r.dp * r.micro_batch == r.global_batch, r.name
        assert r.source and r.where, r.name
        assert r.hidden % r.heads == 0, r.name
        published_figures = [getattr(r, k) for k in published.THROUGHPUTS]
        assert any(v is not None for v in published_figures), r.name
        if r.tflops_per_device is not None:
            assert r.flops_convention in published.CONVENTIONS, r.name
        assert set(r.derived) <= set(published.PublishedRun.__dataclass_fields__), r.name


def test_the_published_figures_agree_with_each_other():
    """Korthikanti et al.'s MFU is their eq. 7 over the iteration time at 312 TFLOP/s; a
    transcription slip in a shape, a batch or a time shows here."""
    for r in published.load():
        if r.mfu is None or r.iteration_seconds is None or r.vocabulary is None:
            continue
        b, s, h, n_l, v = r.global_batch, r.sequence, r.hidden, r.layers, r.vocabulary
        model = 72 * b * n_l * s * h * h * (1 + s / (6 * h) + v / (12 * h * n_l))
        assert model / (r.iteration_seconds * r.devices * 312e12) == pytest.approx(r.mfu,
                                                                                   abs=0.003)


def test_table_1s_rows_take_the_authors_scripts_flags_and_agree_with_the_table():
    """Narayanan et al.'s Table 1 rows: micro-batch, chunks and the fp16 gradient reduction
    from their scripts (examples/sc21/run_table_1.sh), priced by the model the planner gets;
    the published per-GPU teraFLOP/s, fraction of peak and aggregate agree."""
    rows = [r for r in published.load() if r.name.startswith("narayanan2021-t1-")]
    assert len(rows) == 10
    for r in rows:
        assert r.micro_batch and r.precision == "fp16" and r.recompute == "full", r.name
        assert published.model_of(r).grad_reduce == "param", r.name
        assert r.tflops_per_device / 312 == pytest.approx(r.peak_fraction, abs=0.006), r.name
        assert r.tflops_per_device * r.devices / 1e3 == pytest.approx(r.aggregate_pflops,
                                                                       rel=0.01), r.name
    by = {r.name.split("-")[-1]: r for r in rows}
    assert [by[k].virtual for k in ("76.1b", "145.6b", "310.1b", "529.6b")] == [3, 2, 2, 3]
    assert by["39.1b"].virtual is None and by["1008b"].schedule == "1f1b"
    assert [by[k].dp_overlap for k in ("1.7b", "18.4b", "39.1b")] == [True, True, False]
    others = [r for r in published.load() if not r.name.startswith("narayanan2021-t1-")]
    assert all(published.model_of(r).grad_reduce == "fp32" for r in others)


def test_a_run_priced_on_its_own_system_names_its_machine_file():
    """BLOOM ran on Jean Zay's A100 nodes (4 x 100 Gb/s Omni-Path a node), not on the DGX A100
    cluster the other A100 runs are priced on."""
    runs = {r.name: r for r in published.load()}
    assert published.machine_name(runs["bloom2022-176b"]) == "jean-zay-a100"
    assert published.machine_name(runs["narayanan2021-t1-1.7b"]) == "dgx-a100-cluster"
    assert published.machine_name(runs["nemo2407-gpt3-5b-64"]) == "dgx-h100-cluster"
    assert [r.name for r in runs.values() if r.machine] == ["bloom2022-176b"]


def test_the_new_machine_files_load():
    h100 = machine.load(os.path.join(ROOT, "machines", "dgx-h100-cluster.toml"))
    assert h100.device.flops["bfloat16"] == 989.5e12 and h100.p == 4096
    mi = machine.load(os.path.join(ROOT, "machines", "mi250x-cluster.toml"))
    assert [lv.fanout for lv in mi.levels] == [2, 4, 512]


def _corrupt(tmp_path, *pairs):
    """A copy of the runs file with each (old, new) replaced once."""
    with open(published.RUNS) as f:
        text = f.read()
    for old, new in pairs:
        assert old in text
        text = text.replace(old, new, 1)
    path = tmp_path / "runs.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("old, new, message", [
    ("devices = 3072\ntp = 8\npp = 64\ndp = 6",
     "devices = 3072\ntp = 8\npp = 64\ndp = 5",
     "'narayanan2021-t1-1008b': dp = 5: tp * pp * dp = 8 * 64 * 5 = 2560, expected devices"),
    ("global_batch = 2048\nmicro_batch = 2\nzero = 1",
     "global_batch = 2047\nmicro_batch = 2\nzero = 1",
     "'bloom2022-176b': global_batch = 2047: expected a multiple of dp * micro_batch = 16"),
    ('source = "bloom2022"\nwhere', 'source = "nowhere"\nwhere',
     "'bloom2022-176b': source = 'nowhere'"),
    ("recompute = \"selective\"\niteration_seconds = 1.10",
     "recompute = \"some\"\niteration_seconds = 1.10",
     "'korthikanti2023-22b-selective': recompute = 'some': expected one of"),
    ("mfu = 0.514", "mfu = 51.4", "'korthikanti2023-175b-selective': mfu = 51.4"),
    ("virtual = 3\nglobal_batch = 64", "virtual = 5\nglobal_batch = 64",
     "'korthikanti2023-175b-selective': virtual = 5: layers = 96 do not split"),
    ('machine = "jean-zay-a100"', 'machine = "jean-zay"',
     "'bloom2022-176b': machine = 'jean-zay': expected the name of a file of"),
    ('grad_reduce = "param"\nrecompute', 'grad_reduce = "bf16"\nrecompute',
     "'narayanan2021-t1-1.7b': grad_reduce = 'bf16': expected one of fp32, param"),
    ('micro_batch = 4\nzero = 3', 'micro_batch = 4\nzero = 3\ngrad_reduce = "param"',
     "'narayanan2021-t2-zero3-174.6b-384': grad_reduce = 'param': ZeRO-3 reduce-scatters"),
])
def test_a_corrupted_copy_is_refused_naming_the_run_and_the_field(tmp_path, old, new, message):
    path = _corrupt(tmp_path, (old, new))
    with pytest.raises(ValueError, match=re.escape(message)):
        published.load(path)


def test_a_missing_field_or_throughput_is_named(tmp_path):
    path = _corrupt(tmp_path, ("hidden = 2304\nlayers = 24\n", "hidden = 2304\n"))
    with pytest.raises(ValueError, match=re.escape("'narayanan2021-t1-1.7b': layers = None: "
                                                   "required, missing")):
        published.load(path)
    path = _corrupt(tmp_path, ("iteration_seconds = 104.70\n", ""),
                    ("tflops_per_device = 149.77\nflops_convention = \"hardware\"\n", ""))
    with pytest.raises(ValueError, match=re.escape(
            "'bloom2022-176b': tflops_per_device = None: expected at least one published")):
        published.load(path)
