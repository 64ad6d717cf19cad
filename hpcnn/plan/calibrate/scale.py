"""Where ranks share cores: by how much training exceeds the figures measured before it.

:func:`layout_scale` trains two reference MLPs under five layouts each (and four cut in pairs
where the ranks pair up) and two data-parallel GPTs through ``hpcnn train``'s step engine
(:func:`_references`, :mod:`.runs`) and fits (:func:`_fit_scale`) the ``compute_scale`` by
which training's device seconds exceed the device figures (the machine file's device is slowed
by it), the ``collective_scale`` by which the layout executor's collectives exceed the
``after_compute`` curves (:mod:`.contention`) and the ``group_scales`` of the curves over pairs.

The curves time a collective after a loop of matmuls, every rank alike; in training the ranks
reach the layout executor's collectives after its Linears, ReLUs and copies. The device's
figures where ranks share cores are rank 0's alone times the ratio of windows alone and all at
once (:mod:`.shared`), and their level drifts between calibrations more than training does. A
figure of the step engine on this machine: the reference sizes are fixed here, and re-planning
another model reruns nothing.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace

import numpy as np

from hpcnn.config import TrainConfig
from hpcnn.schedule.placement import Cut, write_plan
from hpcnn.plan import cost, hybrid
from hpcnn.plan.calibrate.runs import engine_steps, gpt_config, gpt_model
from hpcnn.plan.calibrate.timing import counted

# The layout executor's reference MLPs (layout_scale): digits features, hidden widths, classes
# and batch (apart from the validation's 64-1024-1024-10 on 256 rows), the per-Linear plans
# ("col": each Linear's output cut over all ranks, "row": its input, "dp": its batch, "rep":
# whole on every rank), the steps of each run and the rounds over them.
LAYOUT_MLP = (64, (512, 512), 10, 128)
LAYOUT_MLPS = (LAYOUT_MLP, (64, (768, 768), 10, 192))    # the plans run on each
LAYOUT_PLANS = (("col", "col", "col"), ("row", "row", "row"), ("dp", "dp", "dp"),
                ("col", "row", "rep"), ("rep", "rep", "rep"))
# Plans whose collectives run over pairs of ranks where they pair up (p > 2, even; "k2": the
# input in 2 parts and the output in p / 2, "k2r": the input in 2 parts, replicated p / 2
# times, "b2": the batch in 2 and the output in p / 2): layout_scale fits their own scale.
LAYOUT_PAIR_PLANS = (("col", "k2", "k2r"), ("k2", "k2", "row"), ("b2", "col", "row"),
                     ("col", "k2", "rep"))
# GPTs data-parallel over all ranks beside them: blocks, width, heads, context, sequences per rank.
LAYOUT_GPTS = ((2, 64, 4, 32, 8), (2, 192, 6, 32, 4))
LAYOUT_STEPS = 16
LAYOUT_ROUNDS = 2


def layout_scale(comm, machine, plans=LAYOUT_PLANS, steps: int = LAYOUT_STEPS,
                 rounds: int = LAYOUT_ROUNDS, pair_plans=LAYOUT_PAIR_PLANS,
                 gpts=LAYOUT_GPTS) -> tuple:
    """Where ranks share cores: (``compute_scale``, ``collective_scale``, ``group_scales``), by
    how much training through the step engine took longer than ``machine`` (the figures
    measured before) prices it: its device's seconds and the layout executor's collectives
    against the ``after_compute`` curves, the same on every rank.

    Each reference MLP of :data:`LAYOUT_MLPS` is trained ``steps`` steps by the step engine on
    the digits data under each of ``plans`` (per Linear "col", "row", "dp" or "rep" over all of
    ``comm``'s ranks) and, where the machine has curves over pairs of ranks and the ranks
    pair up (more than two, even), ``pair_plans`` (:data:`LAYOUT_PAIR_PLANS`), and each GPT of
    ``gpts`` (:data:`LAYOUT_GPTS`) data-parallel over all ranks, ``rounds`` rounds in turn; each
    step is the slowest rank's, a run's the median after the first fifth, a reference's the
    median over rounds. Its price (:func:`hpcnn.plan.cost.strategy_cost`,
    :func:`hpcnn.plan.hybrid.price`) is affine in the three scales: the device's seconds times
    c (:meth:`~hpcnn.plan.machine.Device.slowed`), its collectives priced from the curves times
    k, those over pairs times k2 where pair plans ran; the scales of least squares of the
    relative errors over the references (:func:`_fit_scale`). Plans cut in pairs get their own
    scale: one scale fitted on plans whose collectives span all ranks mispriced them."""
    calls = counted(comm)
    pairs = (calls.size > 2 and calls.size % 2 == 0
             and any(k.endswith(".2") for k in machine.levels[0].after_compute))
    refs = _references(comm, tuple(plans) + (tuple(pair_plans) if pairs else ()), gpts, steps)
    runs = {name: [] for name in refs}
    for _ in range(rounds):
        for name, (run, _) in refs.items():
            runs[name].append(run())
    return calls.bcast_object(_fit_scale([(float(np.median(runs[name])), price)
                                          for name, (_, price) in refs.items()],
                                         machine, (2,) if pairs else ()), root=0)


def _references(comm, plans, gpts, steps: int) -> dict:
    """{name: (run: () -> measured step, price: machine -> seconds)} of :func:`layout_scale`'s
    references over ``comm``'s ranks: each MLP of :data:`LAYOUT_MLPS` under each of ``plans``
    and each GPT of ``gpts`` data-parallel, ``steps`` steps each run."""
    p = counted(comm).size
    make = {"col": Cut(1, 1, p), "row": Cut(1, p, 1), "dp": Cut(p, 1, 1), "rep": Cut(1, 1, 1)}
    if p % 2 == 0:
        make.update(k2=Cut(1, 2, p // 2), k2r=Cut(1, 2, 1), b2=Cut(2, 1, p // 2))
    refs = {}
    for mlp in LAYOUT_MLPS:
        n_in, hidden, n_out, batch = mlp
        graph = cost.mlp_graph([n_in, *hidden, n_out], batch)
        for plan in plans:
            cuts = [make[c] for c in plan]
            refs[f"{hidden[0]}:" + "-".join(plan)] = (
                lambda cuts=cuts, mlp=mlp: _layout_step(comm, cuts, steps, mlp),
                lambda m, cuts=cuts, g=graph: cost.strategy_cost(g, cuts, m).seconds)
    layout = hybrid.Layout(p, 1, 1, 1)
    for layers, *shape in gpts:
        cfg = gpt_config(layers, shape, layout, steps)
        refs[f"gpt{layers}x{shape[0]}"] = (
            lambda cfg=cfg: engine_steps(comm, cfg, steps),
            lambda m, model=gpt_model(cfg): hybrid.price(model, layout, m).step_s)
    return refs


def _layout_step(comm, cuts, steps: int, mlp=LAYOUT_MLP) -> float:
    """The median step (slowest rank, after the first fifth) of ``mlp`` (inputs, hidden widths,
    classes, batch; default :data:`LAYOUT_MLP`) laid out by
    ``cuts`` over ``comm``'s ranks, ``steps`` steps of ``hpcnn train``'s step engine (each rank
    reads its own copy of the plan file)."""
    p = counted(comm).size
    n_in, hidden, _, batch = mlp
    fd, path = tempfile.mkstemp(suffix=".json", prefix="hpcnn-layout-")
    os.close(fd)
    try:
        write_plan(path, cuts, p)
        cfg = TrainConfig(model="mlp", dataset="digits", hidden=hidden, batch_size=batch,
                          tp=p, plan=path, dtype="float32", allreduce="mpi",
                          progress=False, eval_interval=0, steps=steps).resolved()
        return engine_steps(comm, cfg, steps)
    finally:
        os.unlink(path)


def _fit_scale(runs, machine, groups=()) -> tuple:
    """(``compute_scale``, ``collective_scale``, ``group_scales``) pricing ``runs`` ((measured
    step, price: machine -> seconds), :func:`layout_scale`) best on ``machine``: the least
    squares of the relative errors, the price affine in the device's slowdown c, in the scale of
    the curves of each group size in ``groups`` and in the scale of the others. The curves are
    read at the compute seconds before the collective, which c lengthens: two passes, the
    second at the first's c. A scale no run's price depends on is 1, each other kept >= 0.1
    (after the fit: not a bounded least squares)."""
    meas = np.array([t for t, _ in runs])
    n = 1 + len(groups)

    def priced(c: float, scales) -> np.ndarray:
        m = replace(machine, device=machine.device.slowed(c), levels=tuple(
            replace(lv, collective_scale=scales[0], group_scales=tuple(zip(groups, scales[1:])))
            for lv in machine.levels))
        return np.array([price(m) for _, price in runs])

    c, scales, tiny = 1.0, np.ones(n), 1e-9                  # a scale -> 0: no such collectives
    for _ in range(2):
        bare = priced(c, [tiny] * n)
        grow = np.column_stack([priced(c, [1.0 if j == i else tiny for j in range(n)]) - bare
                                for i in range(n)])
        used = np.any(grow != 0, axis=0)
        a = np.column_stack([bare, grow[:, used]]) / meas[:, None]
        x = np.linalg.lstsq(a, np.ones(len(meas)), rcond=None)[0]
        c = max(c * float(x[0]), 0.1)
        scales[used] = np.maximum(x[1:], 0.1)
    scales = [float(f"{k:.4g}") if u else 1.0 for k, u in zip(scales, used)]
    return float(f"{c:.4g}"), scales[0], tuple((g, k) for g, k, u in zip(groups, scales[1:],
                                                                        used[1:]) if u)
