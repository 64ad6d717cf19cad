"""Per-layer layouts of a Linear chain (hpcnn.parallel.layout): the multi-rank scenario at 2, 3
and 4 ranks, and the one-rank pieces (cuts, plan files, gradients, the serial equivalence)."""
import json

import numpy as np
import pytest

from gradcheck import check_block_gradients
from hpcnn.nn import models
from hpcnn.schedule.placement import (Cut, Placement, crosses, exchange_group, moved_elements,
                                      part_range, plan_move, read_plan, write_plan)
from hpcnn.parallel.layout import LayoutLinear, Redistribute, gather_full, layout_mlp
from mpi_util import run_mpi, single


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.long),
                               pytest.param(4, marks=pytest.mark.long)])
def test_layouts_equal_serial_on_n_ranks(n):
    out = run_mpi("layout_chain", n, timeout=180)
    assert f"layout_chain OK on {n} ranks" in out


def test_cut_checks_and_coordinates():
    assert Cut(2, 1, 2).replicas(8) == 2
    # device d = unravel_index(d, (r, nb, nk, nj))
    assert [Cut(2, 1, 2).coords(d, 8) for d in (0, 1, 2, 5)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (1, 0, 0, 1)]
    with pytest.raises(ValueError, match=r"2 \* 2 \* 1 = 4 does not divide the 6 devices"):
        Cut(2, 2, 1).replicas(6)
    with pytest.raises(ValueError, match="out must be an integer >= 1, got -1"):
        Cut(1, 1, -1)
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got True"):
        Cut(True, 1, 1)


def test_part_ranges_are_array_split():
    for n, parts in [(11, 4), (7, 3), (5, 5), (8, 2)]:
        got = [part_range(n, parts, i) for i in range(parts)]
        want = [(int(a[0]), int(a[-1]) + 1) for a in np.array_split(np.arange(n), parts)]
        assert got == want


def test_moved_elements_closed_forms():
    # rows over 4 devices -> every device the whole (8, 3): each lacks 6 rows of 3
    assert moved_elements(Placement.input_of(Cut(4, 1, 1), 4), Placement.full(4), 8, 3) \
        == [18] * 4
    # the reverse is a slice of what each holds: nothing moves
    assert moved_elements(Placement.full(4), Placement.input_of(Cut(4, 1, 1), 4), 8, 3) \
        == [0] * 4
    # data parallel output (rows over 2) -> Megatron row input (cols over 2): each device
    # needs (8, 2) of which it holds (4, 2)
    assert moved_elements(Placement.output_of(Cut(2, 1, 1), 2),
                          Placement.input_of(Cut(1, 2, 1), 2), 8, 4) == [8, 8]


def test_exchange_group_is_the_largest_set_the_messages_join():
    """The devices a redistribution's alltoallv connects (its zero counts post no message):
    a gather along pairs joins 2 of 4, a gather of row parts all 4, a slice none; and the
    sets are those of the pieces plan_move sends."""
    out, inp, p = Placement.output_of, Placement.input_of, 4
    cases = [(out(Cut(1, 1, 4), p), inp(Cut(1, 2, 2), p), 2),     # col -> k halves: pairs
             (out(Cut(4, 1, 1), p), Placement.full(p), 4),         # rows gathered whole
             (Placement.full(p), inp(Cut(1, 2, 2), p), 1),         # a slice of what it holds
             (out(Cut(1, 1, 4), p), inp(Cut(1, 4, 1), p), 1),      # col feeds row in place
             (out(Cut(1, 2, 2), p), inp(Cut(1, 1, 1), p), 2),      # j halves gathered in pairs
             (out(Cut(2, 1, 2), p), inp(Cut(1, 2, 2), p), 4)]      # rows and columns trade
    for src, dst, want in cases:
        assert exchange_group(src, dst, 8, 12) == want, (src, dst)
        peers = {(d, q) for d in range(p) for q, rects in enumerate(plan_move(
            src, dst, 8, 12, d).sends) if rects and q != d}
        sets = [{d} for d in range(p)]                  # merged along every message
        for a, b in peers:
            joined = next(x for x in sets if a in x) | next(x for x in sets if b in x)
            sets = [x for x in sets if not x & joined] + [joined]
        assert max(map(len, sets)) == want, (src, dst, peers)
    # more than one device exactly where some device needs data it does not hold (crosses),
    # for every pair of cuts' placements at 2, 3 and 4 devices, parts empty ones included
    for q in (2, 3, 4):
        cuts = [Cut(b, k, j) for b in (1, 2, 4) for k in (1, 2, 4) for j in (1, 2, 4)
                if q % (b * k * j) == 0]
        places = [f(c, q) for c in cuts for f in (out, inp)] + [Placement.full(q)]
        for src in places:
            for dst in places:
                for rows, cols in ((8, 12), (1, 3), (5, 1)):
                    assert (exchange_group(src, dst, rows, cols) > 1) == crosses(
                        src, dst, rows, cols), (src, dst, rows, cols)


def test_read_plan(tmp_path):
    good = tmp_path / "plan.json"
    good.write_text(json.dumps({"devices": 4, "layers": [
        {"batch": 2, "reduce": 1, "out": 2}, {"batch": 1, "reduce": 4, "out": 1}, {}]}))
    assert read_plan(good) == [Cut(2, 1, 2), Cut(1, 4, 1), Cut(1, 1, 1)]
    cases = [({"devices": 4, "layers": [{"batch": 3}]}, "layer 0: .*= 3 does not divide the 4"),
             ({"devices": 0, "layers": [{}]}, "devices must be an integer >= 1, got 0"),
             ({"devices": 2, "layers": [{"batch": 1, "width": 2}]}, "layer 0 must be an object"),
             ({"devices": 2, "layers": []}, "layers must be a non-empty list"),
             ({"layers": []}, "a plan is"),
             ({"devices": 2, "layers": [{"reduce": 1.5}]}, "reduce must be an integer >= 1")]
    for i, (plan, msg) in enumerate(cases):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(json.dumps(plan))
        with pytest.raises(ValueError, match=msg):
            read_plan(bad)
    with pytest.raises(ValueError, match="a plan for 4 devices, run on 2"):
        read_plan(good, devices=2)
    assert read_plan(good, devices=4)[0] == Cut(2, 1, 2)
    written = tmp_path / "written.json"                     # write_plan: what read_plan reads
    write_plan(written, [Cut(2, 1, 2), Cut(1, 4, 1), Cut(1, 1, 1)], 4)
    assert read_plan(written, devices=4) == read_plan(good)
    bad = tmp_path / "notjson.json"
    bad.write_text("{devices: 2")
    with pytest.raises(ValueError, match="not JSON"):
        read_plan(bad)


def test_one_rank_blocks_pass_finite_differences():
    comm = single()
    x = np.random.default_rng(1).standard_normal((5, 6))
    lin = LayoutLinear(6, 4, Cut(1, 1, 1), comm, seed=2, index=0, dtype=np.float64)
    check_block_gradients(lin, x)
    check_block_gradients(Redistribute(Placement.full(1), Placement.full(1), 6, comm,
                                       dtype=np.float64), x)


def test_one_rank_model_equals_serial_mlp():
    comm = single()
    serial = models.mlp(5, (6, 4), 3, seed=4, dtype=np.float64)
    par = layout_mlp(5, (6, 4), 3, [Cut()] * 3, comm, seed=4, dtype=np.float64)
    assert [p.name for p in par.params] == [p.name for p in serial.params]
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((7, 5)), rng.integers(3, size=7)

    def step(model):
        model.zero_grad()
        loss, caches = model.forward(x, t)
        model.backward(1.0, caches)
        return loss

    assert step(par) == step(serial)
    grads = gather_full(par.params, comm, grads=True)
    for p in serial.params:
        assert np.array_equal(grads[p.name], p.grad), p.name
    with pytest.raises(ValueError, match="cut 1 must be a Cut"):
        layout_mlp(5, (6, 4), 3, [Cut(), (1, 1, 1), Cut()], comm)


def test_keep_gives_placeholders():
    from hpcnn.nn.core import is_placeholder
    lin = LayoutLinear(6, 4, Cut(), single(), keep={"fc.bias"}, name="fc")
    assert is_placeholder(lin.weight.data) and not is_placeholder(lin.bias.data)
