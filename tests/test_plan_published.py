"""experiments/plan_published.py's settings: the layouts each published run's software could
run, and the prices of its layouts as that software ran them (issue 40)."""
import dataclasses
import importlib.util
import os

import pytest

from hpcnn.plan import hybrid, published
from hpcnn.plan.machine import load

from mpi_util import ROOT


@pytest.fixture(scope="module")
def experiment():
    spec = importlib.util.spec_from_file_location(
        "plan_published", os.path.join(ROOT, "experiments", "plan_published.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(name):
    return next(r for r in published.load() if r.name == name)


@pytest.mark.parametrize("source, layout, ok", [
    # Megatron-LM of 2021-22: interleaving on 3 stages or more, m a multiple of pp
    ("narayanan2021", hybrid.Layout(4, 2, 2, 8, "interleaved", virtual=6), False),
    ("korthikanti2023", hybrid.Layout(1, 4, 2, 4, "interleaved", virtual=24), False),
    ("narayanan2021", hybrid.Layout(2, 2, 4, 8, "interleaved", virtual=5), True),
    ("narayanan2021", hybrid.Layout(2, 2, 4, 6, "interleaved", virtual=5), False),
    ("narayanan2021", hybrid.Layout(4, 2, 2, 8, "1f1b"), True),
    # NeMo 24.07's Megatron-core interleaves on 2 stages, m still a multiple of pp
    ("nemo2407", hybrid.Layout(4, 2, 2, 8, "interleaved", virtual=6), True),
    ("nemo2407", hybrid.Layout(4, 2, 2, 7, "interleaved", virtual=6), False),
    # uneven stages: not in Megatron-LM; BLOOM's Megatron-DeepSpeed cut 70 layers on 12
    ("korthikanti2023", hybrid.Layout(1, 8, 2, 4, stages=(20, 28)), False),
    ("korthikanti2023", hybrid.Layout(1, 8, 2, 4, stages=(24, 24)), True),
    ("bloom2022", hybrid.Layout(8, 4, 12, 128, stages=(6,) * 10 + (5, 5)), True),
])
def test_a_layout_its_software_could_not_run_is_left_out(experiment, source, layout, ok):
    assert experiment.could_run(source, layout) is ok


def test_the_setting_keeps_what_its_software_ran_and_prices_pipelines_as_it_did(experiment):
    """Narayanan et al.'s 7.5B ran PyTorch's DDP (priced overlapped, in float32), which their
    Megatron-LM refused with a pipeline: the setting's pipelined layouts are priced with the
    run's own fp16 reduction after the backward; its unpipelined ones keep the run's price."""
    run = _run("narayanan2021-t1-7.5b")
    machine, (model, changed) = experiment.machine_for(run), experiment.model_for(run)
    assert changed and machine.dp_overlap
    every = hybrid.plan(model, machine, run.devices, zero=(0, 1), remat=hybrid.PRICED_REMAT)
    assert any(not experiment.could_run(run.source, r.layout) for r in every)
    ok = experiment.of_setting(run, every)
    assert {r.layout for r in ok} == {
        r.layout for r in every if r.layout.zero == 0 and r.layout.remat != "selective"
        and not r.layout.sequence_parallel and r.layout.schedule != "zb_h1"
        and experiment.could_run(run.source, r.layout)}
    assert [hybrid.plan_order(r) for r in ok] == sorted(hybrid.plan_order(r) for r in ok)
    local = dataclasses.replace(machine, dp_overlap=False)
    piped = [r for r in ok if r.layout.pp > 1]
    unpiped = {r.layout: r.step_s for r in every if r.layout.pp == 1}
    assert piped and len(piped) < len(ok)
    for r in piped[:5]:
        again = hybrid.price(published.model_of(run), r.layout, local)
        assert again.step_s == r.step_s and again.step_s != hybrid.price(
            model, r.layout, machine).step_s
    for r in ok:
        if r.layout.pp == 1:
            assert r.step_s == unpiped[r.layout]
    # the published layout's own price is the overlapped one, as before
    q, _ = experiment.published_layout(run, model, machine)
    assert q.layout.pp == 1 and q.step_s == unpiped[q.layout]


def test_a_megatron_run_ranks_only_layouts_it_could_run(experiment):
    """Korthikanti et al.'s 22B on 8 GPUs: the fastest of the layouts of its setting's
    dimensions interleaves on 2 stages, which Megatron-LM refused in 2022; the best the
    experiment names is one it could run, and the published one ranks among those."""
    run = _run("korthikanti2023-22b-full")
    machine, (model, _) = experiment.machine_for(run), experiment.model_for(run)
    q, _ = experiment.published_layout(run, model, machine)
    k, best, _ = experiment.rank_of(run, model, machine, q)
    every = hybrid.plan(model, machine, run.devices, zero=(0,), remat=hybrid.PRICED_REMAT)
    fastest = next(r for r in every if r.feasible)
    assert fastest.layout.pp == 2 and fastest.layout.virtual > 1
    assert not experiment.could_run(run.source, fastest.layout)
    assert experiment.could_run(run.source, best.layout) and best.feasible
    assert best.step_s > fastest.step_s
    ranked = [r for r in experiment.of_setting(run, every) if r.feasible]
    assert ranked[0].layout == best.layout and ranked[k - 1].layout.tp == q.layout.tp
