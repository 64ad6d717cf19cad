"""The transformer layout search (hpcnn.plan.hybrid): closed-form prices on a machine of two
levels (GPUs of a node, nodes of a cluster) built from the planner's own machine classes."""
import math
import random
from dataclasses import replace

import pytest

from hpcnn.plan.hybrid import (Layout, Transformer, _accumulated_params, _block,
                               accumulate_seconds, flops_per_step, layouts, plan, price,
                               rank_memory, stage_cut, stage_times, update_seconds)
from hpcnn.plan.machine import Device, Level, Machine as Hsm
from hpcnn.schedule import pipeline


def Machine(per_node=8, nodes=4, inter=25e9, memory=80e9, efficiency=None):
    """per_node GPUs on NVLink-like links, nodes on a slower network."""
    return Hsm(name="stub", levels=(Level("node", per_node, 2e-6, ((math.inf, 300e9),)),
                                    Level("cluster", nodes, 5e-6, ((math.inf, inter),))),
               device=Device("gpu", {"bfloat16": 150e12, "float32": 19.5e12}, 2e12, memory,
                             efficiency or {}))


SMALL = Transformer(n_layers=8, dim=512, n_heads=8, seq=256, vocab=1024, batch=64)


def test_parts_add_up_and_one_device_is_the_compute():
    m = Machine(per_node=1, nodes=1)
    every = plan(SMALL, m, 1)
    assert {q.layout.microbatches for q in every} == {1, 2, 4, 8, 16, 32, 64}
    for q in every:
        assert (q.layout.dp, q.layout.tp, q.layout.pp) == (1, 1, 1)
        assert q.step_s == pytest.approx(sum(q.parts.values()), rel=1e-12)
        assert q.parts["tp_comm"] == q.parts["dp_comm"] == q.parts["pp_comm"] == 0
    # one micro-batch of the whole batch: the model's FLOPs at the device's rate, then the update
    # of every parameter (one stage holds both tables)
    one = price(SMALL, Layout(1, 1, 1, 1), m)
    assert one.parts["optimizer"] == pytest.approx(update_seconds(SMALL.params(), 2, m.device),
                                                   rel=1e-9)
    assert one.step_s - one.parts["optimizer"] == pytest.approx(flops_per_step(SMALL) / 150e12,
                                                                rel=1e-9)
    assert "dp allreduce" in one.formula and "adamw update" in one.formula
    # a block kind's efficiency slows exactly its FLOPs
    slow = Machine(per_node=1, nodes=1, efficiency={"transformer": 0.5})
    half = price(SMALL, Layout(1, 1, 1, 1), slow)
    f, b, *_ = _block(SMALL.dim, SMALL.n_heads, SMALL.seq, SMALL.batch, SMALL.word)
    assert half.step_s - one.step_s == pytest.approx(SMALL.n_layers * (f + b) / 150e12, rel=1e-9)


def test_tensor_parallel_memory_is_the_sharded_blocks_spec():
    """Under tp the LayerNorms and the column-parallel inputs stay whole on every rank: the cache
    per rank is the Megatron block's spec, more than the serial cache / tp."""
    from hpcnn.nn.transformer import TransformerBlock
    from hpcnn.parallel.tensor.attention import ParallelTransformerBlock
    from hpcnn.plan.hybrid import _ShapeComm
    serial = TransformerBlock(64, 4, dtype="float32", keep=()).spec((2, 16, 64))
    for tp in (2, 4):
        cache = _block(64, 4, 16, 2, 4, tp)[2]
        sharded = ParallelTransformerBlock(_ShapeComm(tp), 64, 4, dtype="float32", keep=())
        assert cache == sharded.spec((2, 16, 64)).bytes_cache
        assert serial.bytes_cache / tp < cache < serial.bytes_cache


def test_every_layout_respects_the_divisibility_rules():
    got = list(layouts(SMALL, 16))
    assert got and all(q.dp * q.tp * q.pp == 16 for q in got)
    assert all(SMALL.n_heads % q.tp == 0 and SMALL.n_layers % q.pp == 0 for q in got)
    assert all(SMALL.batch % (q.dp * q.microbatches) == 0 for q in got)
    assert all(q.pp == 1 or q.microbatches >= q.pp for q in got)
    assert {q.schedule for q in got if q.pp > 1} == {"1f1b", "gpipe", "zb_h1", "interleaved"}
    inter = [q for q in got if q.virtual > 1]
    assert inter and all(q.schedule == "interleaved" and q.microbatches % q.pp == 0
                         and SMALL.n_layers % (q.pp * q.virtual) == 0 for q in inter)
    assert all(q.tp > 1 and SMALL.seq % q.tp == 0 and q.zero < 2
               for q in got if q.sequence_parallel)
    assert any(q.sequence_parallel for q in got)
    for q in plan(SMALL, Machine(), 16):
        assert q.step_s == pytest.approx(sum(q.parts.values()), rel=1e-9), q.layout


def test_memory_decides_feasibility_and_the_order():
    big = Transformer(n_layers=96, dim=12288, n_heads=96, seq=2048, batch=1536)
    assert 170e9 < big.params() < 180e9                        # GPT-3's 175 B
    eight = plan(big, Machine(per_node=8, nodes=1), 8)
    assert not any(q.feasible for q in eight)                  # 175 B does not fit 8 x 80 GB
    many = plan(big, Machine(per_node=8, nodes=128), 1024)
    best = many[0]
    assert best.feasible and best.memory_bytes <= 80e9
    assert best.layout.tp * best.layout.pp > 1                 # sharded, not replicated
    first_bad = next(i for i, q in enumerate(many) if not q.feasible)
    assert all(not q.feasible for q in many[first_bad:])       # feasible ones first


def test_a_slow_network_keeps_tensor_parallelism_inside_a_node():
    for inter in (1e9, 100e9):
        best = plan(SMALL, Machine(per_node=4, nodes=4, inter=inter), 16)[0]
        assert best.layout.tp <= 4, (inter, best.layout)
    slow = plan(SMALL, Machine(inter=1e9), 32)
    fast = plan(SMALL, Machine(inter=100e9), 32)
    by = {q.layout: q.step_s for q in fast}
    assert all(by[q.layout] <= q.step_s + 1e-15 for q in slow)   # faster links never slower


def test_remat_trades_time_for_memory():
    m = Machine()
    lay = dict(dp=2, tp=2, pp=2, microbatches=8)
    plain, full = price(SMALL, Layout(**lay), m), price(SMALL, Layout(**lay, remat="full"), m)
    assert full.step_s > plain.step_s and full.memory_bytes < plain.memory_bytes


@pytest.mark.parametrize("stages,last", [((3, 5), False), ((3, 5), True), ((1, 7), False)])
def test_remat_full_prices_the_forwards_train_runs_again(stages, last):
    """remat="full" charges a stage pass the forwards hpcnn train --remat=full runs again: the
    policy's sequence (a segment per chain block) recomputes every transformer block of a
    stage, with the LM head (its last segment the head and the loss) or without it (every
    segment checkpointed, the last recomputed first in the backward)."""
    from hpcnn.schedule import sequences as sequence
    from hpcnn.nn import models
    from hpcnn.plan.hybrid import _pass_times, recomputed_forward
    m = Machine()
    chain = models.gpt(64, 16, sum(stages), 16, 2, dtype="float32")
    stage = stages[1] if last else stages[0]
    # the stage's chain blocks: the embedding and the first blocks, or the last blocks, the
    # final LayerNorm and the LM head (then the loss joins them), as the pipeline cuts the chain
    names = [b.name for b in (chain.blocks[1 + stages[0]:] if last else
                              chain.blocks[:1 + stages[0]])]
    n = len(names) + last
    seq = sequence.segments(n, n, has_loss=last)
    forwards = [op.block for op in seq if op.kind.startswith("F_")]
    again = [names[i] for i in range(len(names)) if forwards.count(i) > 1]
    transformer = [x for x in again if x.startswith("h")]
    assert len(transformer) == stage, again
    for tp in (1, 2):
        lay = Layout(1, tp, 2, 4, remat="none")
        t_f, t_b, _, _ = _pass_times(SMALL, lay, m, stage, last)
        head_f = _pass_times(SMALL, lay, m, 0, last)[0]
        _, t_b_full, _, _ = _pass_times(SMALL, Layout(1, tp, 2, 4, remat="full"), m, stage, last)
        blocks_f = t_f - head_f
        assert t_b_full - t_b == pytest.approx(blocks_f * len(transformer) / stage, rel=1e-12)
        assert recomputed_forward(blocks_f, stage, last) == pytest.approx(t_b_full - t_b)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="n_heads dividing dim"):
        Transformer(n_layers=2, dim=100, n_heads=3)
    with pytest.raises(ValueError, match="devices=64: the machine 'stub' has 32"):
        plan(SMALL, Machine(), 64)
    with pytest.raises(ValueError, match="no layout"):
        plan(Transformer(n_layers=3, dim=64, n_heads=1, batch=1), Machine(), 32)


def test_hpcnn_plan_on_the_gpu_cluster_file(capsys):
    import json

    from hpcnn.cli_tools import cmd_plan
    from mpi_util import ROOT
    gpu = f"{ROOT}/machines/dgx-a100-cluster.toml"
    args = [f"--machine={gpu}", "--devices=1024", "--n_layers=96", "--dim=12288",
            "--n_heads=96", "--seq=2048", "--batch=1536"]
    assert cmd_plan(args + ["--json=true", "--top=3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 1024 and 170e9 < out["params"] < 180e9 and len(out["ranked"]) == 3
    best = out["ranked"][0]
    assert best["feasible"] and best["memory_gb"] <= 80.0
    steps = [r["step_s"] for r in out["ranked"]]
    assert steps == sorted(steps)
    assert cmd_plan(args + ["--top=2"]) == 0
    text = capsys.readouterr().out
    assert "layouts priced in" in text and "winner:" in text and "against #2" in text
    assert cmd_plan(args + ["--n_heads=7"]) == 2 and "n_heads dividing dim" in \
        capsys.readouterr().err


def test_the_forward_share_moves_time_between_the_passes_not_the_total():
    """The device's measured forward share splits a block's fixed and element-wise seconds; the
    FLOPs split as spec() counts them; one stage's t_f + t_b does not depend on the share."""
    from hpcnn.plan.hybrid import stage_times

    def device(forward):
        return Hsm(name="cpu", levels=(Level("node", 1, 1e-6, ((math.inf, 1e10),)),),
                   device=Device("cpu", {"float32": 1e11}, 1e10, 1e10, {"transformer": 0.8},
                                 {"transformer": 1e-4, "linear": 1e-5},
                                 {"transformer": 1e-9, "linear": 2e-9}, forward))
    model = Transformer(n_layers=2, dim=64, n_heads=4, seq=16, vocab=64, batch=8,
                        dtype="float32")
    lay = Layout(1, 1, 1, 1)
    third, half = (stage_times(model, lay, device(f)) for f in (
        {}, {"transformer": 0.5, "linear": 0.5}))
    assert third.t_f + third.t_b == pytest.approx(half.t_f + half.t_b, rel=1e-12)
    f, b, cache, *_ = _block(64, 4, 16, 8, 4)
    rest = 2 * (1e-4 + cache * 1e-9) + 1e-5 + 8 * 16 * 64 * 4 * 2e-9   # blocks + head
    assert half.t_f - third.t_f == pytest.approx(rest / 6, rel=1e-9)
    assert half.t_f == pytest.approx(2 * f / 0.8e11 + 2 * 8 * 16 * 64 * 64 / 1e11 + rest / 2,
                                     rel=1e-9)


def test_zero_bubble_halves_are_the_devices_measured_split():
    """ZB-H1's input and weight halves: the device's fractions of the whole backward (tp
    allreduces stay in the input half); (0.5, 0.5) without them."""
    from hpcnn.plan.hybrid import stage_times

    def machine(split):
        return Hsm(name="cpu", levels=(Level("node", 2, 1e-6, ((math.inf, 1e10),)),),
                   device=Device("cpu", {"float32": 1e11}, 1e10, 1e10, split=split))
    model = Transformer(n_layers=2, dim=64, n_heads=4, seq=16, vocab=64, batch=8,
                        dtype="float32")
    whole = stage_times(model, Layout(1, 2, 1, 1), machine({}))
    even = stage_times(model, Layout(1, 2, 1, 1, "zb_h1"), machine({}))
    assert even.t_b == pytest.approx(whole.t_b, rel=1e-12)
    assert even.t_w == pytest.approx((whole.t_b - whole.tp_s) / 2, rel=1e-12)
    split = stage_times(model, Layout(1, 2, 1, 1, "zb_h1"),
                        machine({"transformer": (0.66, 0.47)}))
    body = whole.t_b - whole.tp_s
    assert split.t_w == pytest.approx(0.47 * body, rel=1e-12)
    assert split.t_b - split.t_w == pytest.approx(0.66 * body + whole.tp_s, rel=1e-12)


def test_the_update_is_priced_from_the_measured_table_when_there_is_one():
    from dataclasses import replace
    plain = Machine(per_node=1, nodes=1)
    n = SMALL.params()                  # one stage: every parameter, both tables included
    # no table: 11 (AdamW) or 4 (SGD) passes of 3 words per parameter at 2e12 bytes/s
    assert update_seconds(1000, 4, plain.device) == 11 * 3 * 4 * 1000 / 2e12
    assert update_seconds(1000, 2, plain.device, "sgd") == 4 * 3 * 2 * 1000 / 2e12
    pieces = ((100, 4e-9), (10_000, 2e-9), (math.inf, 1e-9))
    timed = replace(plain, device=replace(plain.device, update={"adamw": pieces}))
    # float32 as measured (1000 is halfway in log between 100 and 10000: 3e-9 s a parameter);
    # other words scale by word / 4; an optimizer without a table keeps the stream model
    assert update_seconds(1000, 4, timed.device) == pytest.approx(3e-6, rel=1e-12)
    assert update_seconds(1000, 2, timed.device) == pytest.approx(1.5e-6, rel=1e-12)
    assert update_seconds(1000, 8, timed.device) == pytest.approx(6e-6, rel=1e-12)
    assert update_seconds(1000, 2, timed.device, "sgd") == 4 * 3 * 2 * 1000 / 2e12
    # the layout's price takes the table's figure: n > 10000 parameters at 1e-9 s, bfloat16
    one, measured = (price(SMALL, Layout(1, 1, 1, 1), m) for m in (plain, timed))
    assert n > 10_000 and measured.parts["optimizer"] == pytest.approx(n * 1e-9 * 2 / 4,
                                                                       rel=1e-12)
    assert one.parts["optimizer"] == pytest.approx(11 * 3 * 2 * n / 2e12, rel=1e-12)
    assert measured.step_s - measured.parts["optimizer"] == pytest.approx(
        one.step_s - one.parts["optimizer"], rel=1e-12)


def test_held_microbatches_are_what_the_schedules_hold():
    """The closed form per stage equals the simulated schedule's peak of micro-batches holding
    memory (F done, last backward part not yet)."""
    from hpcnn.schedule import pipeline as schedules
    from hpcnn.plan.hybrid import held_microbatches
    for name in ("1f1b", "gpipe", "zb_h1"):
        for pp, m in ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8)):
            sim = schedules.simulate(schedules.SCHEDULES[name](pp, m, pp), 1.0, 1.0,
                                     1.0 if name == "zb_h1" else 0.0)
            assert [held_microbatches(name, pp, m, s) for s in range(pp)] == \
                sim.peak_held_stage, (name, pp, m)


def test_memory_counts_the_fullest_stage_with_the_last_stages_tail():
    """GPipe's last stage holds all M micro-batches and the head's and loss's caches: more than
    1F1B, whose fullest stage is the first (min(pp, M) micro-batches, no tail)."""
    from hpcnn.plan.hybrid import _tail
    m = Machine(per_node=4, nodes=1)
    model = Transformer(n_layers=4, dim=64, n_heads=4, seq=16, vocab=96, batch=16,
                        dtype="float32")
    f1b = price(model, Layout(1, 1, 4, 4, "1f1b"), m)
    gpipe = price(model, Layout(1, 1, 4, 4, "gpipe"), m)
    tail, tokens = _tail(64, 16, 4, 96, 4), 4 * 16 * 8      # 4 sequences a micro-batch
    assert tail > tokens
    # 1F1B's fullest stage is the first (4 micro-batches and their tokens), GPipe's the last;
    # the first holds the embedding's and position tables on top (4 words a parameter)
    tables = (96 + 16) * 64 * 4 * 4
    assert gpipe.memory_bytes - f1b.memory_bytes == pytest.approx(4 * (tail - tokens) - tables,
                                                                  rel=1e-12)


# ---------------------------------------------------------------- explicit stages (stage_cut)
HEAVY_HEAD = Transformer(n_layers=8, dim=64, n_heads=4, seq=128, vocab=4096, batch=16)


@pytest.mark.parametrize("lay", [Layout(1, 1, 2, 4), Layout(1, 1, 4, 8, "gpipe"),
                                 Layout(1, 1, 4, 4, "zb_h1"), Layout(2, 2, 2, 4, "1f1b", "full"),
                                 Layout(2, 1, 4, 2, "1f1b"), Layout(1, 2, 2, 2, "gpipe", "full")])
@pytest.mark.parametrize("moved", [None, 5e-12])
def test_the_per_stage_path_prices_uniform_stages_as_the_uniform_price(lay, moved):
    """With uniform stages and the uniform price's convention (the head's time and table on every
    stage) the per-stage path (simulated span, per-stage memory and reduction) is the uniform
    price but for the messages waited on, which the uniform price counts with the head on the
    last stage only: under 1F1B the head's slack hides part of the steady state's waits, and
    the simulated cut of that shape waits as long; the other schedules count as on equal
    stages. With the head on the last stage only it is never dearer. Also where the file
    prices memory-bound work by the bytes moved, the gradients' accumulation with it."""
    from hpcnn.plan.hybrid import _staged, _staged_memory
    m = Machine()
    if moved is not None:
        m = replace(m, device=replace(m.device, elementwise={**m.device.elementwise,
                                                             "moved": moved}))
        assert accumulate_seconds(SMALL, lay, m, 1.0) > 0 or lay.microbatches == 1
    uniform = price(SMALL, lay, m)
    staged = replace(lay, stages=(SMALL.n_layers // lay.pp,) * lay.pp)
    span, pp_s, _, (dp_s, opt_s) = _staged(SMALL, staged, m, "adamw", range(lay.pp))
    memory = _staged_memory(SMALL, staged, set(range(lay.pp)), "adamw")
    waits = uniform.parts["pp_comm"]
    assert span + dp_s + opt_s == pytest.approx(uniform.step_s - waits, rel=1e-12, abs=0)
    head_last = _staged(SMALL, staged, m, "adamw")[1]
    assert waits == pytest.approx(head_last if lay.schedule == "1f1b" else pp_s, rel=1e-9)
    assert (waits < pp_s * (1 - 1e-9)) == (lay.schedule == "1f1b" and lay.pp < lay.microbatches)
    assert sum(memory.values()) == pytest.approx(uniform.memory_bytes, rel=1e-12, abs=0)
    last_only = price(SMALL, staged, m)
    assert last_only.step_s <= uniform.step_s and last_only.memory_bytes <= uniform.memory_bytes
    assert last_only.step_s == pytest.approx(sum(last_only.parts.values()), rel=1e-12)
    assert "stages 2|2|2|2" in str(staged) or "stages 4|4" in str(staged)


def test_1f1bs_steady_waits_fall_with_the_slack_of_a_slower_last_stage():
    """1F1B with every message taking c and the last stage's pass d slower than the others
    (the LM head's, in a uniform price): the simulated makespan grows by the fill and drain's
    2(pp - 1) c and floor((M - 1)(pp - 1) / pp) max(0, 2c - d), as hybrid._messages counts."""
    rng = random.Random(43)
    for _ in range(40):
        p, M = rng.randint(2, 10), rng.randint(1, 60)
        t, c = rng.uniform(0.5, 2), rng.uniform(0.001, 0.05)
        d = rng.choice((0.0, rng.uniform(0, 3 * c)))
        share = rng.uniform(0.25, 0.5)                    # the forward's share of a pass
        t_f = [t * share] * (p - 1) + [(t + d) * share]
        t_b = [t * (1 - share)] * (p - 1) + [(t + d) * (1 - share)]
        lists = pipeline.one_f_one_b(p, M, p)
        grow = (pipeline.makespan(lists, t_f, t_b, [0.0] * p, c)
                - pipeline.makespan(lists, t_f, t_b, [0.0] * p))
        want = 2 * (p - 1) * c + (M - 1) * (p - 1) // p * max(0.0, 2 * c - d)
        assert grow == pytest.approx(want, rel=1e-9, abs=1e-12), (p, M, t, c, d)


def test_a_heavy_head_leaves_the_last_stage_fewer_blocks():
    """The cut balances the stages' passes: its span beats the even cut's, and so does its
    step but under ZB-H1, where the even cut's slack on the first stage hides the messages
    the balanced cut waits on (the cut's objective is the slowest stage, not the messages)."""
    m = Machine(per_node=2, nodes=1)
    for lay in (Layout(1, 1, 2, 2), Layout(1, 1, 2, 4, "gpipe"), Layout(1, 1, 2, 4, "zb_h1")):
        cut = stage_cut(HEAVY_HEAD, lay, m)
        assert sum(cut) == 8 and cut[-1] < 4, (lay, cut)
        chosen = price(HEAVY_HEAD, replace(lay, stages=cut), m)
        even = price(HEAVY_HEAD, replace(lay, stages=(4, 4)), m)
        assert (chosen.step_s - chosen.parts["pp_comm"]
                < even.step_s - even.parts["pp_comm"])
        if lay.schedule == "zb_h1":
            assert chosen.parts["pp_comm"] > even.parts["pp_comm"]
            assert chosen.step_s == pytest.approx(even.step_s, rel=0.01)
        else:
            assert chosen.step_s < even.step_s
        assert chosen.step_s < price(HEAVY_HEAD, lay, m).step_s
    # the planner offers the cut, and it wins over the uniform layouts
    best = plan(HEAVY_HEAD, m, 2)[0]
    assert best.layout.stages and best.layout.stages[-1] < 4, best.layout


def test_the_cut_meets_a_memory_bound_the_uniform_cut_violates():
    """1F1B holds two micro-batches on the first of two stages, one on the last: a bound below
    the uniform cut's memory moves blocks to the last stage."""
    activations = Transformer(n_layers=8, dim=64, n_heads=4, seq=512, vocab=64, batch=16)
    m, lay = Machine(per_node=2, nodes=1), Layout(1, 1, 2, 4)
    even = replace(lay, stages=(4, 4))
    bound = 0.9 * price(activations, even, m).memory_bytes
    assert not price(activations, even, m, bound).feasible
    cut = stage_cut(activations, lay, m, bound)
    fits = price(activations, replace(lay, stages=cut), m, bound)
    assert fits.feasible and cut[0] < cut[1], cut
    assert stage_cut(activations, lay, m) == (4, 4)           # unbounded: balanced
    # the planner's list holds it, feasible, for that bound
    assert any(q.layout == replace(lay, stages=cut) and q.feasible
               for q in plan(activations, m, 2, memory_bytes=bound))


def test_pp_not_dividing_the_layers_is_cut_into_stages():
    model = Transformer(n_layers=7, dim=64, n_heads=4, seq=32, vocab=256, batch=16)
    m = Machine(per_node=2, nodes=1)
    assert all(q.pp == 1 for q in layouts(model, 2))         # no machine: the divisors only
    staged = [q.layout for q in plan(model, m, 2) if q.layout.pp == 2]
    assert staged and all(len(q.stages) == 2 and sum(q.stages) == 7 for q in staged)
    with pytest.raises(ValueError, match="expected pp=2 stage sizes"):
        Layout(1, 1, 2, 2, stages=(7,))
    with pytest.raises(ValueError, match=r"stages \(3, 3\) hold 6 transformer blocks"):
        price(model, Layout(1, 1, 2, 2, stages=(3, 3)), m)
    with pytest.raises(ValueError, match="explicit stages"):
        stage_times(model, Layout(1, 1, 2, 2, stages=(3, 4)), m)


def test_hpcnn_plan_prints_the_stage_cuts(capsys):
    import json

    from hpcnn.cli_tools import cmd_plan
    from mpi_util import ROOT
    args = [f"--machine={ROOT}/machines/dgx-a100-cluster.toml", "--devices=2", "--n_layers=7",
            "--dim=256", "--n_heads=4", "--seq=128", "--batch=16", "--top=200"]
    assert cmd_plan(args + ["--json=true"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranked"]
    staged = [r for r in rows if r["stages"]]        # 7 layers: pp = 2 only as a planned cut
    assert staged and all(len(r["stages"]) == 2 and sum(r["stages"]) == 7 for r in staged)
    assert all(r["stages"] == [] for r in rows if "pp=1" in r["layout"])
    assert cmd_plan(args) == 0
    first = staged[0]
    assert f"{first['layout']}" in capsys.readouterr().out
    assert first["layout"].endswith(f"stages {first['stages'][0]}|{first['stages'][1]}")


def test_every_micro_batch_pass_pays_the_stage_figure():
    """The device's "stage" kind (hpcnn calibrate's stage pass around the blocks) is paid by
    every forward and backward pass of a micro-batch: once for one micro-batch without a
    pipeline, (M + pp - 1) times each on a 1F1B span of uniform stages."""
    base = Machine(per_node=2, nodes=1)
    dev = replace(base.device, overhead={**base.device.overhead, "stage": 1e-3},
                  forward={**base.device.forward, "stage": 0.4})
    m = replace(base, device=dev)
    for lay, passes in ((Layout(1, 1, 1, 1), 1), (Layout(1, 1, 2, 4), 4 + 2 - 1)):
        more = price(SMALL, lay, m).step_s - price(SMALL, lay, base).step_s
        assert more == pytest.approx(passes * 1e-3, rel=1e-9), lay


@pytest.mark.parametrize("lay, handoffs", [
    (Layout(4, 1, 1, 1), 1),                         # the dp allreduce
    (Layout(1, 4, 1, 1), 4 * 8),                     # 2 + 2 tp allreduces per block, 8 blocks
    (Layout(1, 4, 1, 1, remat="full"), 6 * 8),       # and the forward's 2 again under remat
    (Layout(1, 1, 4, 8), 2 * (8 + 4 - 1) + 2 * 3),   # a wait per pass, and the 2(pp-1) messages
    (Layout(2, 1, 2, 4), 2 * (4 + 2 - 1) + 2 + 1),   # ... and the dp allreduce
    (Layout(1, 2, 2, 2), (2 * 2 * 4 + 2) * (2 + 2 - 1) + 2)])   # 4 blocks a stage: 8 + 1 a pass
def test_every_blocking_exchange_pays_the_levels_handoff(lay, handoffs):
    """Where ranks share cores (a level's ``handoff``), every blocking exchange on the step's
    path pays it once: a tensor-parallel allreduce, a pipeline pass's wait on its neighbour,
    a pp message on the critical path, the dp allreduce. ``calibrate.contention.handoff_points`` fits the
    handoff by this same count (the price's growth per second of a flat handoff)."""
    one = Machine(per_node=4, nodes=1)
    h = 1e-4
    shared = replace(one, levels=(replace(one.levels[0], handoff=((0.0, h),)),))
    more = price(SMALL, lay, shared).step_s - price(SMALL, lay, one).step_s
    assert more == pytest.approx(handoffs * h, rel=1e-9), lay


def test_the_handoff_follows_the_compute_before_it_and_the_fill_and_drain_their_weight():
    """A pipeline pass's handoff is H(its own length), a tp allreduce's H(the compute between
    two of them: a quarter of a block's forward + backward), the dp allreduce's H(a backward
    pass); with H(c) = k c every such wait grows with k as its compute does. The bubble weight
    w scales what the span holds beyond a stage's own passes, (1 - w) x bubble less, and leaves
    layouts without a pipeline alone."""
    one = Machine(per_node=4, nodes=1)
    k = 0.25
    linear = replace(one, levels=(replace(one.levels[0], handoff=((0.0, 0.0), (1.0, k))),))
    lay = Layout(1, 1, 4, 8)
    st, sl = stage_times(SMALL, lay, one), stage_times(SMALL, lay, linear)
    # a calibrated file's measured backward holds the gradients' accumulation
    assert accumulate_seconds(SMALL, lay, one, _accumulated_params(SMALL, lay, 2, True)) == 0
    assert (sl.t_f, sl.t_b) == pytest.approx(((1 + k) * st.t_f, (1 + k) * st.t_b), rel=1e-12)
    tp = Layout(1, 4, 1, 1)
    st, sl = stage_times(SMALL, tp, one), stage_times(SMALL, tp, linear)
    f, b, cache, _, _ = _block(SMALL.dim, SMALL.n_heads, SMALL.seq, SMALL.batch, SMALL.word, 4)
    per_block = sum(one.device.pass_seconds(x, SMALL.dtype, "transformer", 1, cache, fwd)
                    for x, fwd in ((f, True), (b, False)))
    assert sl.tp_s - st.tp_s == pytest.approx(k * per_block / 4 * 2 * SMALL.n_layers, rel=1e-9)
    for w in (0.5, 0.25):
        weighted = replace(one, levels=(replace(one.levels[0], bubble_weight=w),))
        for lay in (Layout(1, 1, 4, 8), Layout(2, 1, 2, 4, "zb_h1")):
            base = price(SMALL, lay, one)
            assert price(SMALL, lay, weighted).step_s == pytest.approx(
                base.step_s - (1 - w) * base.parts["bubble"], rel=1e-12), (w, lay)
        assert price(SMALL, Layout(4, 1, 1, 1), weighted).step_s == price(
            SMALL, Layout(4, 1, 1, 1), one).step_s


def test_allreduces_read_the_collectives_after_compute_curves_where_the_level_has_them():
    """Where ranks share cores (a level with after_compute curves) a GPT allreduce is priced
    from the allreduce curve after its compute, the wait for the last rank included; elsewhere
    it is the ring and its handoff; a group of one or no bytes costs nothing."""
    from hpcnn.plan.hybrid import ring_allreduce_s
    ring = Level("node", 4, 1e-6, ((math.inf, 1e9),))
    curves = Level("node", 4, 1e-6, ((math.inf, 1e9),), after_compute={
        "allreduce.4": ((0.0, 8, 1e-4), (0.0, 1 << 20, 1e-3), (1e-2, 8, 3e-4),
                        (1e-2, 1 << 20, 2e-3))}, collective_scale=1.5)
    assert ring_allreduce_s(1 << 20, 4, ring, 1e-3) == ring.allreduce_seconds(1 << 20, 4, 1e-3)
    assert ring_allreduce_s(1 << 20, 4, curves, 5e-3) == pytest.approx(1.5 * 1.5e-3, rel=1e-12)
    assert ring_allreduce_s(1 << 20, 1, curves) == ring_allreduce_s(0, 4, curves) == 0.0


def test_held_activations_cost_their_fresh_bytes_beyond_one_micro_batch():
    """With the device's ``elementwise["held"]`` a step pays it per byte of the activations its
    fullest stage holds beyond one micro-batch's: on one stage, GPipe's M micro-batches against
    1F1B's one are the difference of their memory accounts; nothing without the figure."""
    plain = Machine(per_node=4, nodes=1)
    held = replace(plain, device=replace(plain.device, elementwise={"held": 3e-10}))
    model = Transformer(n_layers=4, dim=64, n_heads=4, seq=16, vocab=96, batch=16,
                        dtype="float32")
    gpipe, f1b = (price(model, Layout(1, 1, 1, 8, s), held) for s in ("gpipe", "1f1b"))
    assert f1b.parts["held"] == 0 and f1b.step_s == price(model, f1b.layout, plain).step_s
    assert gpipe.parts["held"] == pytest.approx(3e-10 * (gpipe.memory_bytes - f1b.memory_bytes),
                                                rel=1e-12)
    assert "held activations" in gpipe.formula and "held" not in f1b.formula
    for lay in (Layout(1, 1, 4, 8, "gpipe"), Layout(2, 1, 2, 4, "1f1b", "full"),
                Layout(1, 1, 4, 4, "zb_h1"), replace(Layout(1, 1, 2, 8, "gpipe"), stages=(1, 3))):
        with_it, without = price(model, lay, held), price(model, lay, plain)
        assert with_it.parts["held"] > 0 and with_it.memory_bytes == without.memory_bytes
        assert with_it.step_s - without.step_s == pytest.approx(with_it.parts["held"], rel=1e-9)
        assert with_it.step_s == pytest.approx(sum(with_it.parts.values()), rel=1e-12)
    # 1F1B's first stage holds pp micro-batches, GPipe's every stage all M: GPipe pays more
    assert (price(model, Layout(1, 1, 4, 8, "gpipe"), held).parts["held"]
            > price(model, Layout(1, 1, 4, 8, "1f1b"), held).parts["held"] > 0)


def test_zero1_prices_a_dp_th_of_the_slots_and_a_gather():
    """At zero 1 a rank holds 1/dp of AdamW's two slots and (16-bit parameters) of the float32
    master copy, and a scratch no larger than its part: the memory falls by 3 (1 - 1/dp) float32
    words a parameter, at most a scratch more; the update covers 1/dp of the parameters, then
    half a ring allreduce gathers them."""
    from hpcnn.plan.hybrid import ring_allreduce_s, sharded_update_seconds, state_words
    m = Machine()
    lay0, lay1 = Layout(8, 1, 1, 1), Layout(8, 1, 1, 1, zero=1)
    assert (state_words("adamw", lay0), state_words("adamw", lay1)) == (4, 2 + 2 / 8)
    q0, q1 = price(SMALL, lay0, m), price(SMALL, lay1, m)
    n, word = SMALL.params(), SMALL.word
    saved = q0.memory_bytes - q1.memory_bytes
    assert word == 2 and 3 * (1 - 1 / 8) * n * 4 * 0.99 < saved < (
        3 * (1 - 1 / 8) * n + 4 * 512 * 512 + 1024 * 512) * 4
    gather = ring_allreduce_s(n * word, 8, m.level_for_group(8)) / 2
    assert q1.parts["optimizer"] == pytest.approx(
        update_seconds(n / 8, word, m.device) + gather, rel=0.02)
    assert sharded_update_seconds(n, lay0, m, word, "adamw") == update_seconds(n, word, m.device)
    assert "zero 1" in str(lay1) and "zero" not in str(lay0)


def test_zero1_is_a_layout_dimension_that_memory_can_decide():
    """Asked for (``zero=(0, 1)``), every dp > 1 layout comes at both stages, dp = 1 at zero 0
    only; a model that only data parallelism splits (one head, one block), given memory for
    zero 1's layouts only, is planned at zero 1."""
    m = Machine(per_node=8, nodes=1)
    both = plan(SMALL, m, 8, zero=(0, 1))
    assert len(both) == len(plan(SMALL, m, 8)) + sum(
        q.layout.dp > 1 for q in plan(SMALL, m, 8))
    assert all(q.layout.zero == 0 for q in both if q.layout.dp == 1)
    one = Transformer(n_layers=1, dim=512, n_heads=1, seq=256, vocab=1024, batch=64)
    every = plan(one, m, 8, zero=(0, 1))
    assert {q.layout.dp for q in every} == {8}
    least0, least1 = (min(q.memory_bytes for q in every if q.layout.zero == z) for z in (0, 1))
    assert least1 < least0
    tight = plan(one, m, 8, memory_bytes=(least0 + least1) / 2, zero=(0, 1))
    assert tight[0].feasible and tight[0].layout.zero == 1
    assert not plan(one, m, 8, memory_bytes=(least0 + least1) / 2)[0].feasible


def test_zero2_prices_the_gradient_s_part_and_a_reduce_scatter():
    """At zero 2 a rank also holds 1/dp of the gradient (float32 under 16-bit parameters) and
    the buffers its reduction holds whole (three blocks and a bucket each without a pipeline),
    and its reduction is the reduce-scatter half of the allreduce."""
    from hpcnn.plan.hybrid import _block, _bucket_bytes, state_words
    m = Machine()
    lay1, lay2 = Layout(8, 1, 1, 1, zero=1), Layout(8, 1, 1, 1, zero=2)
    assert state_words("adamw", lay2) == 1 + 3 / 8 and state_words("sgd", lay2) == 1 + 2 / 8
    deep = replace(SMALL, n_layers=32)
    q1, q2 = price(deep, lay1, m), price(deep, lay2, m)
    block = _block(deep.dim, deep.n_heads, deep.seq, 1, deep.word)[3] / deep.word
    buffers = 3 * (max(block, deep.vocab * deep.dim) + _bucket_bytes() / 4)
    assert buffers < deep.params() / 3
    assert q1.memory_bytes - q2.memory_bytes == pytest.approx(
        (1 - 1 / 8) * deep.params() * 4 - buffers * 4, rel=1e-9)
    assert q2.memory_parts["gradients"] - q1.memory_parts["gradients"] == pytest.approx(
        buffers * 4 - (1 - 1 / 8) * deep.params() * 4, rel=1e-9)
    # the least a backward binds (memory_check's floor): the block computing's buckets
    assert rank_memory(deep, lay2, least=True) == pytest.approx(
        q2.memory_bytes - (buffers - block) * 4, rel=1e-9)
    assert rank_memory(deep, lay1, least=True) == q1.memory_bytes
    # micro-batches reduced each in its backward: as many buffers; a pipeline reduces once,
    # after its last micro-batch: every gradient held whole until then
    acc2 = price(deep, replace(lay2, microbatches=4), m)
    assert acc2.memory_parts["gradients"] == q2.memory_parts["gradients"]
    piped1, piped2 = (price(deep, Layout(4, 1, 2, 4, zero=z), m) for z in (1, 2))
    assert piped2.memory_parts["gradients"] == pytest.approx(
        (1 + 1 / 4) * piped1.memory_parts["gradients"], rel=1e-9)
    q1, q2 = price(SMALL, lay1, m), price(SMALL, lay2, m)
    assert q2.parts["dp_comm"] == pytest.approx(q1.parts["dp_comm"] / 2, rel=1e-12)
    assert q2.parts["optimizer"] == q1.parts["optimizer"] and "zero 2" in str(lay2)


def test_zero3_and_mixed_precision_price_what_a_rank_holds():
    """At zero 3 a rank holds 1/dp of everything plus two blocks' gathered parameters, and its
    parameters are gathered twice a step; 16-bit parameters (mixed precision) carry float32
    gradients, slots and a master copy: AdamW's 18 bytes a parameter, not 4 x 2."""
    from hpcnn.plan.hybrid import _block, state_bytes
    assert state_bytes("adamw", None, 4) == 16 and state_bytes("adamw", None, 2) == 18
    assert state_bytes("sgd", None, 2) == 2 + 4 + 4 + 4
    lay = {z: Layout(8, 1, 1, 1, zero=z) for z in range(4)}
    assert [state_bytes("adamw", lay[z], 2) for z in range(4)] == [
        18, 2 + 4 + 12 / 8, 2 + 16 / 8, 18 / 8]
    m = Machine()
    q2, q3 = price(SMALL, lay[2], m), price(SMALL, lay[3], m)
    block = _block(SMALL.dim, SMALL.n_heads, SMALL.seq, 1, SMALL.word)[3]
    table = SMALL.vocab * SMALL.dim
    gathered = 2 * max(block, (table + SMALL.seq * SMALL.dim) * SMALL.word)
    assert q2.memory_bytes - q3.memory_bytes == pytest.approx(
        (1 - 1 / 8) * SMALL.params() * SMALL.word - gathered, rel=1e-9)
    assert q3.parts["optimizer"] > q2.parts["optimizer"] and "zero 3" in str(lay[3])


def test_zero2_and_3_reduce_and_gather_once_per_micro_batch_without_a_pipeline():
    """Without a pipeline hpcnn's ZeRO-2 and 3 reduce-scatter each micro-batch's gradients in
    its own backward, and ZeRO-3 gathers the parameters for each micro-batch's forward and
    backward: m reductions and 2 m gathers a step (on a file without overlap, whole); at
    ZeRO-1 one allreduce a step; a pipeline's ZeRO-2 reduces once, after its last
    micro-batch."""
    from hpcnn.plan.hybrid import _stage_params, ring_allreduce_s
    m = Machine()
    assert not m.dp_overlap
    one, four = ({z: price(SMALL, Layout(8, 1, 1, mb, zero=z), m) for z in (1, 2, 3)}
                 for mb in (1, 4))
    assert four[1].parts["dp_comm"] == pytest.approx(one[1].parts["dp_comm"], rel=1e-12)
    for z in (2, 3):
        assert four[z].parts["dp_comm"] == pytest.approx(4 * one[z].parts["dp_comm"],
                                                         rel=1e-12)
    params = _stage_params(SMALL, Layout(8, 1, 1, 1), 0, SMALL.n_layers, True)
    gather = ring_allreduce_s(params * SMALL.word, 8, m.level_for_group(8)) / 2
    assert four[3].parts["optimizer"] - one[3].parts["optimizer"] == pytest.approx(
        (8 - 2) * gather, rel=1e-9)
    piped = {mb: price(SMALL, Layout(4, 1, 2, mb, zero=2), m) for mb in (2, 8)}
    assert piped[8].parts["dp_comm"] == pytest.approx(piped[2].parts["dp_comm"], rel=1e-12)


def test_data_parallelism_across_nodes_is_priced_in_two_levels_where_cheaper():
    """dp = 32 over 4 nodes of 8 (tp = 1): the reduce-scatter and all-gather among a node's 8,
    the 8th part across the 4 nodes (hier), cheaper than the flat ring on the slow network; at
    tp = 8 a node holds one dp rank, and the ring is flat. ZeRO-2 and 3's reduce-scatter is the
    flat ring wherever (the engine's parts collectives under auto)."""
    from hpcnn.plan.hybrid import dp_allreduce_s, ring_allreduce_s
    m = Machine(per_node=8, nodes=4, inter=10e9)
    node, cluster = m.levels
    n = 1e9
    flat = ring_allreduce_s(n, 32, cluster)
    two = ring_allreduce_s(n, 8, node) + ring_allreduce_s(n / 8, 4, cluster)
    assert two < flat / 4
    assert dp_allreduce_s(n, Layout(32, 1, 1, 1), m) == pytest.approx(two, rel=1e-12)
    assert dp_allreduce_s(n, Layout(4, 8, 1, 1), m) == ring_allreduce_s(n, 4, cluster)
    assert dp_allreduce_s(n, Layout(8, 1, 4, 1), m) == ring_allreduce_s(n, 8, node)
    q = price(SMALL, Layout(32, 1, 1, 1), m)
    assert q.parts["dp_comm"] < ring_allreduce_s(SMALL.params() * SMALL.word, 32, cluster) / 2
    # ZeRO-2 and 3 reduce-scatter: --allreduce=auto leaves a parts collective to the MPI
    # library (Comm._levels), so the flat ring, as the parameters' gathers; ZeRO-1 allreduces
    for zero, form in ((1, two), (2, flat), (3, flat)):
        assert dp_allreduce_s(n, Layout(32, 1, 1, 1, zero=zero), m) == pytest.approx(form,
                                                                               rel=1e-12)


def test_a_flat_ring_gets_a_nodes_whole_link_where_the_level_has_a_stream_bandwidth():
    """A node's link of 1 GB/s shared by its 2 ranks: 0.5 GB/s each when both send, 1 GB/s for
    one alone (``stream_bandwidth``). The flat ring over 4 consecutive ranks on 2 nodes sends one
    message a node across at once (the whole link); the two-level form's rails send two (half
    each). Without a stream bandwidth the level prices every message at its per-device rate,
    as before; a crossing outside (0, 1] is refused."""
    from hpcnn.plan.hybrid import dp_allreduce_forms
    inf = math.inf
    node = Level("node", 2, 1e-5, ((inf, 4e9),))
    links = Level("links", 2, 2e-5, ((inf, 0.5e9),), stream_bandwidth=((inf, 1e9),))
    m = Hsm(name="2x2", levels=(node, links), device=Device("cpu", {"float32": 1e9}, 1e9, 1e9))
    n = 64 * 2**20
    forms = dp_allreduce_forms(n, Layout(4, 1, 1, 1), m)
    assert forms["flat"] == pytest.approx(6 * (2e-5 + n / 4 / 1e9), rel=1e-12)
    assert forms["hier"] == pytest.approx(2 * (1e-5 + n / 2 / 4e9) + 2 * (2e-5 + n / 4 / 0.5e9),
                                          rel=1e-12)
    assert forms["flat"] / forms["hier"] == pytest.approx(1.20, abs=0.01)
    # tp = 2 fills each node: one dp rank a node, both ranks of a node in a ring of their own,
    # two messages a node across at once; no inner level holds two dp ranks (flat only)
    assert dp_allreduce_forms(n, Layout(2, 2, 1, 1), m) == {
        "flat": pytest.approx(2 * (2e-5 + n / 2 / 0.5e9), rel=1e-12)}
    plain = Hsm(name="2x2", levels=(node, Level("links", 2, 2e-5, ((inf, 0.5e9),))),
                device=m.device)
    assert dp_allreduce_forms(n, Layout(4, 1, 1, 1), plain)["flat"] == pytest.approx(
        6 * (2e-5 + n / 4 / 0.5e9), rel=1e-12)
    with pytest.raises(ValueError, match="crossing = 1.5"):
        links.shared_rate(n, 1.5)


def test_a_machine_file_reads_a_levels_stream_bandwidth():
    from hpcnn.plan.machine import loads
    m = loads('name = "x"\n[device]\nname = "d"\nmemory_bandwidth = 1e9\nmemory_bytes = 1e9\n'
              '[device.flops]\nfloat32 = 1e9\n[[levels]]\nname = "node"\nfanout = 2\n'
              'latency_s = 1e-6\nbandwidth = [[inf, 4e9]]\n[[levels]]\nname = "links"\n'
              'fanout = 2\nlatency_s = 2e-5\nbandwidth = [[inf, 5e8]]\n'
              'stream_bandwidth = [[inf, 1e9]]\n')
    assert m.levels[1].stream_bandwidth == ((math.inf, 1e9),)
    assert m.levels[0].stream_bandwidth == ()
    with pytest.raises(ValueError, match="stream_bandwidth"):
        loads('name = "x"\n[device]\nname = "d"\nmemory_bandwidth = 1e9\nmemory_bytes = 1e9\n'
              '[device.flops]\nfloat32 = 1e9\n[[levels]]\nname = "node"\nfanout = 2\n'
              'latency_s = 1e-6\nbandwidth = [[inf, 4e9]]\nstream_bandwidth = [[inf, -1]]\n')


@pytest.mark.parametrize("dim,heads,seq,word,tp", [(12288, 96, 2048, 2, 8), (2304, 24, 2048, 2, 1),
                                                   (512, 8, 256, 4, 2), (96, 6, 30, 2, 3),
                                                   (64, 4, 64, 8, 1)])
def test_a_blocks_figures_scale_with_its_sequences_as_its_spec_says(dim, heads, seq, word, tp):
    """The planner prices a block on any rows from one sequence's figures: the spec built on
    rows sequences gives the same numbers."""
    from hpcnn.plan.hybrid import _block, _block_one
    for rows in (1, 2, 3, 7, 16):
        assert _block(dim, heads, seq, rows, word, tp) == _block_one(dim, heads, seq, word, tp,
                                                                      rows)


def test_interleaved_chunks_held_are_what_the_schedule_holds():
    """Interleaved 1F1B's closed form per rank (chunk passes) equals the simulated schedule's
    peak, and on the first rank it is Korthikanti et al.'s pp + (pp - 1) / v stages' worth."""
    from hpcnn.schedule import pipeline as schedules
    from hpcnn.plan.hybrid import held_microbatches
    for pp, v, m in ((2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16)):
        sim = schedules.simulate(schedules.interleaved_1f1b(pp * v, m, pp), 1.0, 1.0)
        got = [held_microbatches("interleaved", pp, m, r, v) for r in range(pp)]
        assert got == sim.peak_held, (pp, v, m)
        if m > pp:
            assert got[0] / v == pytest.approx(pp + (pp - 1) / v)


def test_interleaving_divides_the_bubble_by_v_and_crosses_every_chunk_boundary():
    """With no fixed cost per pass (the stub device), a chunk pass is a v-th of a stage pass:
    the bubble is 1F1B's over v, the passes' compute the same, the messages waited on
    2(pp v - 1) (the fill and drain, GPipe's 2(pp - 1)) where 1F1B's steady state waits on up
    to 2 floor((M - 1)(pp - 1) / pp) more (10 at pp 4 and M 8, less the head's slack); the
    first rank holds pp + (pp - 1) / v stages' worth of
    activations where 1F1B's holds pp; chunks that do not split the layers are refused."""
    from hpcnn.plan.hybrid import _held_bytes
    m = Machine()
    one = price(SMALL, Layout(1, 1, 4, 8, "1f1b"), m)
    for v in (2,):
        lay = Layout(1, 1, 4, 8, "interleaved", virtual=v)
        inter = price(SMALL, lay, m)
        assert inter.parts["compute"] == pytest.approx(one.parts["compute"], rel=1e-9)
        assert inter.parts["bubble"] == pytest.approx(one.parts["bubble"] / v, rel=1e-9)
        msg = price(SMALL, Layout(1, 1, 4, 8, "gpipe"), m).parts["pp_comm"] / 6
        assert inter.parts["pp_comm"] == pytest.approx(2 * (4 * v - 1) * msg, rel=1e-9)
        assert 6 * msg * (1 - 1e-9) <= one.parts["pp_comm"] <= 16 * msg * (1 + 1e-9)
        ratio = _held_bytes(SMALL, lay, 0, 2) / _held_bytes(SMALL, one.layout, 0, 2)
        assert ratio == pytest.approx((4 + 3 / v) / 4, rel=0.02)
        assert "x2 chunks" in str(lay)
    with pytest.raises(ValueError, match="interleaving needs"):
        price(SMALL, Layout(1, 1, 4, 8, "interleaved", virtual=4), m)     # 8 layers, 16 chunks
    with pytest.raises(ValueError, match="virtual=2"):
        Layout(1, 1, 4, 8, "1f1b", virtual=2)


def test_sequence_parallelism_splits_the_norm_regions_not_the_allreduce_volume():
    """Sequence parallelism: the block's figures are its spec with the seq/tp input (less
    cache, less memory-bound time), the tp collectives cost the allreduce's ring (reduce-scatter
    + all-gather) and the backward's gathers of the two column-parallel inputs again, half as
    much (1.25 times the allreduces' seconds over a step), a pp message is a seq/tp slice;
    tp = 1 is refused."""
    from hpcnn.parallel.tensor.attention import ParallelTransformerBlock
    from hpcnn.plan.hybrid import _ShapeComm
    m = Machine(per_node=8, nodes=1)
    for tp in (2, 4):
        spec = ParallelTransformerBlock(_ShapeComm(tp), 64, 4, dtype="float32", keep=(),
                                        sequence_parallel=True).spec((2, 16 // tp, 64))
        assert _block(64, 4, 16, 2, 4, tp, True)[2] == spec.bytes_cache < _block(
            64, 4, 16, 2, 4, tp)[2]
    plain, sp = (price(SMALL, Layout(1, 4, 2, 4, sequence_parallel=s), m) for s in (False, True))
    assert sp.parts["tp_comm"] == pytest.approx(1.25 * plain.parts["tp_comm"], rel=1e-12)
    assert sp.memory_parts["activations"] < plain.memory_parts["activations"]
    assert sp.parts["pp_comm"] < plain.parts["pp_comm"]
    assert "sequence parallel" in str(sp.layout)
    with pytest.raises(ValueError, match="tp=1"):
        Layout(2, 1, 1, 1, sequence_parallel=True)


def test_selective_recomputation_runs_the_attention_core_again_and_holds_the_rest():
    """remat="selective" (priced, not offered: hpcnn train has no such remat) holds the
    caches less the attention core's (the softmax output: a s^2 / t words a sequence and
    block) and runs the core's forward again: slower than none, faster than full, between
    them in memory; its hardware FLOPs count the core once more."""
    from hpcnn.plan.hybrid import (attention_core, hardware_flops_per_step, _held_bytes)
    big = Transformer(n_layers=8, dim=512, n_heads=8, seq=1024, vocab=1024, batch=64)
    m = Machine(per_node=8, nodes=1)
    assert attention_core(512, 8, 1024, 2, 4)[1] == 8 * 1024 * 1024 // 4 * 2
    none, sel, full = (price(big, Layout(1, 4, 2, 4, remat=r), m)
                       for r in ("none", "selective", "full"))
    assert none.step_s < sel.step_s < full.step_s
    assert full.memory_bytes < sel.memory_bytes < none.memory_bytes
    rows = big.batch // 4
    assert _held_bytes(big, none.layout, 0, 4) - _held_bytes(big, sel.layout, 0, 4) == \
        pytest.approx(2 * 4 * rows * attention_core(512, 8, 1024, 2, 4)[1])
    assert hardware_flops_per_step(big, sel.layout) > flops_per_step(big)
    assert all(q.remat in ("none", "full") for q in layouts(big, 8))


def test_the_dp_reduction_hides_behind_the_backward_where_the_machine_overlaps_it():
    """dp_overlap: what the backward does not hide plus the last bucket's reduction, at most
    the whole; without it, the whole (float32 gradients under 16-bit parameters either way)."""
    from hpcnn.config import TrainConfig
    from hpcnn.plan.hybrid import dp_allreduce_s, dp_seconds, _stage_params
    serial, overlapped = Machine(), replace(Machine(), dp_overlap=True)
    for model in (SMALL, Transformer(n_layers=8, dim=4096, n_heads=32, seq=2048, batch=64)):
        lay = Layout(8, 2, 2, 2)
        st = stage_times(model, lay, overlapped)
        params = _stage_params(model, lay, 0, 4, True)
        whole = dp_allreduce_s(params * 4, lay, serial, after=st.t_b)
        last = dp_allreduce_s(min(params * 4, TrainConfig.bucket_mb * 2 ** 20), lay, serial,
                              after=st.t_b)
        assert stage_times(model, lay, serial).dp_s == pytest.approx(whole, rel=1e-12)
        assert st.dp_s == pytest.approx(min(whole, max(0, whole - st.t_b) + last), rel=1e-12)
        assert dp_seconds(model, lay, overlapped, params, 0.0) == pytest.approx(whole)
    assert st.dp_s < whole / 2         # the larger model's: many buckets, most hidden


def test_gradients_reduced_at_the_parameters_16_bits_move_half_the_bytes():
    """grad_reduce="param" (hpcnn train's --grad_reduce_dtype=param): the dp reduction of
    2-byte gradients, the float32 reduction's bytes halved, the memory unchanged; refused at a
    32-bit dtype, at an unknown type and with ZeRO-2 or 3, in one line."""
    from hpcnn.plan.hybrid import dp_allreduce_s
    serial = Machine()
    wide = Transformer(n_layers=8, dim=1024, n_heads=16, seq=512, batch=64)
    narrow = replace(wide, grad_reduce="param")
    assert (wide.reduce_word, narrow.reduce_word) == (4, 2)
    lay = Layout(8, 2, 2, 4)
    a, b = price(wide, lay, serial), price(narrow, lay, serial)
    st_w, st_n = stage_times(wide, lay, serial), stage_times(narrow, lay, serial)
    from hpcnn.plan.hybrid import _stage_params
    params = _stage_params(wide, lay, 0, 4, True)
    assert st_w.dp_s == pytest.approx(dp_allreduce_s(4 * params, lay, serial, after=st_w.t_b))
    # the engine's 16-bit ring (narrow_allreduce): the flat form, half the float32 one's bytes
    from hpcnn.plan.hybrid import dp_allreduce_forms
    flat = {w: dp_allreduce_forms(w * params, lay, serial, after=st_n.t_b)["flat"]
            for w in (2, 4)}
    assert st_n.dp_s == pytest.approx(flat[2], rel=1e-12) and flat[2] < flat[4]
    assert b.step_s - a.step_s == pytest.approx(st_n.dp_s - st_w.dp_s, rel=1e-9)
    # it blocks the compute's thread: never hidden behind the backward
    overlapped = replace(serial, dp_overlap=True)
    st_o = stage_times(narrow, lay, overlapped)
    assert st_o.dp_s == pytest.approx(dp_allreduce_forms(2 * params, lay, overlapped,
                                                         after=st_o.t_b)["flat"], rel=1e-12)
    assert st_o.dp_s > stage_times(wide, lay, overlapped).dp_s
    assert b.memory_parts == a.memory_parts          # the gradients are held in float32 still
    assert (st_n.t_f, st_n.t_b, st_n.opt_s) == (st_w.t_f, st_w.t_b, st_w.opt_s)
    with pytest.raises(ValueError, match="grad_reduce fp32 or param"):
        replace(wide, dtype="float32", grad_reduce="param")
    with pytest.raises(ValueError, match="grad_reduce fp32 or param"):
        replace(wide, grad_reduce="fp16")
    with pytest.raises(ValueError, match="grad_reduce='param' with ZeRO stage 2"):
        plan(narrow, serial, 16, zero=(0, 2))
    with pytest.raises(ValueError, match="grad_reduce='param' with ZeRO stage 3"):
        price(narrow, Layout(16, 1, 1, 4, zero=3), serial)
    assert plan(narrow, serial, 16, zero=(0, 1))


def test_published_gemm_rates_price_the_blocks_gemms_on_their_roofline():
    """With a dtype's [device.gemm] table, a block pass is its GEMMs' roofline seconds (the
    backward's two GEMMs each twice the forward's) plus the rest of its FLOPs at the rate;
    without one the pass is as before; the LM head's GEMM likewise."""
    from hpcnn.plan import gemm
    from hpcnn.plan.hybrid import _pass_times
    plain = Machine(per_node=8, nodes=1)
    rate = 100e12
    table = replace(plain, device=replace(plain.device, gemm={"bfloat16": (
        (4096, 4096, 4096, rate),)}))
    lay = Layout(1, 2, 1, 4)
    rows, tp = SMALL.batch // 4, 2
    f, b, *_ = _block(SMALL.dim, SMALL.n_heads, SMALL.seq, rows, SMALL.word, tp)
    shapes = gemm.block_shapes(SMALL.dim, SMALL.n_heads, SMALL.seq, rows, tp)
    assert len(shapes) == 6
    gemm_f = sum(2.0 * m * n * k * bt for m, n, k, bt in shapes)
    assert 0 < f - gemm_f < 0.02 * f            # the rest: biases, softmax, GELU, norms
    dev = table.device
    roof = sum(dev.gemm_seconds(m, n, k, "bfloat16", bt) for m, n, k, bt in shapes)
    head = gemm.head_shapes(SMALL.dim, SMALL.seq, rows, SMALL.vocab, tp)[0]
    t_f, t_b, _, tp_s = _pass_times(SMALL, lay, table, 3, False)
    assert t_f - tp_s == pytest.approx(3 * ((f - gemm_f) / 150e12 + roof), rel=1e-12)
    assert t_b - tp_s == pytest.approx(3 * ((b - 2 * gemm_f) / 150e12 + 2 * roof), rel=1e-12)
    h_f = _pass_times(SMALL, lay, table, 3, True)[0] - t_f
    assert h_f == pytest.approx(dev.gemm_seconds(*head[:3], "bfloat16"), rel=1e-12)
    # the attention core's GEMMs (batched per head) are memory-bound at this size
    core = gemm.core_shapes(SMALL.dim, SMALL.n_heads, SMALL.seq, rows, tp)
    assert core[0] == (256, 256, 64, rows * 4)
    assert dev.gemm_seconds(*core[0][:3], "bfloat16", core[0][3]) > 2.0 * 256 * 256 * 64 * rows * 4 / rate
    # without the table: the FLOPs as spec() counts them at the rate
    p_f, p_b, _, p_tp = _pass_times(SMALL, lay, plain, 3, False)
    assert p_f - p_tp == pytest.approx(3 * f / 150e12, rel=1e-12)
    assert p_b - p_tp == pytest.approx(3 * b / 150e12, rel=1e-12)
    # a dtype the table does not list is priced as before
    fp32 = replace(SMALL, dtype="float32")
    assert _pass_times(fp32, lay, table, 3, True) == _pass_times(fp32, lay, plain, 3, True)


def test_a_pp_that_does_not_divide_the_layers_gets_the_even_cut_beyond_the_searched_ones():
    """Where pp does not divide the layers and pp x M is past the searched cuts (or M is not
    a power of two), the plan offers the even cut, the first stages a block more (BLOOM's 70
    layers on 12 stages: 6 x 10 and 5 x 2), priced stage by stage; up to EVEN_CUT_PASSES."""
    from hpcnn.plan import hybrid
    gpt = Transformer(n_layers=7, dim=64, n_heads=4, seq=32, vocab=96, batch=96)
    every = plan(gpt, Machine(per_node=2, nodes=1), 2, allow={"pp": {2}})
    cuts = {q.layout.microbatches: q.layout.stages for q in every}
    assert cuts[48] == cuts[96] == cuts[3] == (4, 3)          # past 64 passes, or M = 3
    assert 2 * 96 <= hybrid.EVEN_CUT_PASSES
    q = next(q for q in every if q.layout.microbatches == 96 and q.layout.remat == "none"
             and q.layout.schedule == "1f1b")
    assert q.step_s == pytest.approx(sum(q.parts.values()), rel=1e-12)
    assert q.step_s == price(gpt, q.layout, Machine(per_node=2, nodes=1)).step_s
    assert hybrid._even_cut(70, 12) == (6,) * 10 + (5,) * 2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_long_staged_schedule_is_priced_by_closed_forms_bounding_its_simulation(schedule):
    """Past SIMULATED_PASSES a staged layout's span is not simulated: GPipe's closed form (two
    flow shops of M identical jobs) equals the simulation on unequal stages, and 1F1B's and
    ZB-H1's with every stage as slow as the busiest are at or above it, equal on equal
    stages (an even cut and a head, random times, seeded)."""
    import random
    from hpcnn.plan import hybrid
    rng = random.Random(7)
    for pp, m in [(3, 30), (5, 16), (12, 16), (7, 40)]:
        assert pp * m > hybrid.SIMULATED_PASSES
        blocks = [3] * rng.randint(0, pp - 1)
        blocks += [2] * (pp - len(blocks))
        per_f, per_b = rng.uniform(0.5, 2), rng.uniform(1, 4)
        t_f = [n * per_f for n in blocks]
        t_f[-1] += rng.uniform(0, 2)
        whole = [n * per_b for n in blocks]
        whole[-1] += rng.uniform(0, 3)
        split = 0.4 if schedule == "zb_h1" else 0.0
        t_b, t_w = (tuple(x * (1 - split) for x in whole), tuple(x * split for x in whole))
        for f, b, w in [(tuple(t_f), t_b, t_w), ((t_f[0],) * pp, (t_b[0],) * pp, (t_w[0],) * pp)]:
            simulated = hybrid._simulated_span(schedule, pp, m, f, b, w)
            closed = hybrid._staged_span(schedule, pp, m, f, b, w)
            if schedule == "gpipe" or len(set(f)) == 1:
                assert closed == pytest.approx(simulated, rel=1e-12), (pp, m, f)
            else:
                assert closed >= simulated * (1 - 1e-12), (pp, m, closed, simulated)


def test_cached_hashes_are_not_pickled():
    """A model's, layout's, machine's and level's hash is computed once and kept, but not
    pickled: a string's hash differs between processes (an unpickled copy hashes afresh)."""
    import pickle
    m = Machine()
    objs = (SMALL, Layout(2, 2, 2, 4), m, m.levels[0])
    for o in objs:
        hash(o)
        assert "_hash" in o.__dict__
        back = pickle.loads(pickle.dumps(o))
        assert "_hash" not in back.__dict__ and back == o and hash(back) == hash(o)
