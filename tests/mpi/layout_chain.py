"""Per-layer layouts of an MLP against the serial run (float64, 1e-10), on the world's p ranks.

    mpiexec -n 4 python -m mpi4py tests/mpi/layout_chain.py

For many lists of cuts (pure data parallelism, Megatron column then row, reduce-dimension cuts,
replication, mixed per layer, every single cut applied to all layers, random mixes): the loss and
every gathered parameter gradient over two SGD steps equal the serial ``models.mlp``'s on a
batch that no cut divides evenly. Each redistribution alone: moves the right parts of a known
array both ways, and the bytes its alltoallv sends (summed over the ranks) equal the documented
formula, computed here from index masks; finite differences of a loss of the logical input,
perturbed on every rank in lockstep, match each rank's backward. Every block keeps the block
contract (cache bytes, accumulating gradients, counted bytes = spec().comm_bytes). Bad cuts are
refused on every rank before any collective.
"""
import itertools

import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.nn import models
from hpcnn.parallel.collectives import CommStats, Communicator
from hpcnn.schedule.placement import Cut, Placement
from hpcnn.parallel.layout import LayoutLinear, Redistribute, free_layout, gather_full, layout_mlp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/
from cachecheck import grads_accumulate, spec_matches_cache  # noqa: E402

world = MPI.COMM_WORLD
rank, P = world.Get_rank(), world.Get_size()
stats = CommStats()
comm = Communicator(world, stats, name="layout")
TOL = 1e-10
N_IN, HIDDEN, N_OUT, BATCH = 7, (9, 6), 5, 11      # 11 rows: uneven parts for nb = 2, 3, 4
F64 = np.float64


def all_cuts(p):
    """Every Cut whose product divides p."""
    return [Cut(a, b, c) for a, b, c in itertools.product(range(1, p + 1), repeat=3)
            if p % (a * b * c) == 0]


def cut_lists(p):
    """Named layouts, each single cut on every layer, and seeded random mixes."""
    named = [[Cut(p, 1, 1)] * 3,                               # pure data parallelism
             [Cut(1, 1, p), Cut(1, p, 1), Cut(1, 1, p)],       # Megatron column, row, column
             [Cut(1, p, 1)] * 3,                               # reduce dimension everywhere
             [Cut(1, 1, 1)] * 3,                               # every device replicates
             [Cut(p, 1, 1), Cut(1, 1, p), Cut(1, p, 1)]]       # mixed per layer
    if P == 4:
        named += [[Cut(2, 1, 2), Cut(1, 2, 2), Cut(2, 2, 1)],
                  [Cut(1, 2, 2), Cut(2, 1, 1), Cut(1, 1, 2)],   # replication r = 2 in the middle
                  [Cut(2, 2, 1), Cut(1, 2, 1), Cut(4, 1, 1)]]
    singles = [[c] * 3 for c in all_cuts(p)]
    rng = np.random.default_rng(p)
    cuts = all_cuts(p)
    mixes = [[cuts[i] for i in rng.integers(len(cuts), size=3)] for _ in range(8)]
    return named + singles + mixes


def check_model(cuts, x, t):
    serial = models.mlp(N_IN, HIDDEN, N_OUT, seed=3, dtype=F64)
    par = layout_mlp(N_IN, HIDDEN, N_OUT, cuts, comm, seed=3, dtype=F64)
    for step in range(2):
        losses = []
        for m in (serial, par):
            m.zero_grad()
            loss, caches = m.forward(x, t)
            m.backward(1.0, caches)
            losses.append(loss)
        assert abs(losses[0] - losses[1]) <= TOL, (cuts, step, losses)
        grads, data = gather_full(par.params, comm, grads=True), gather_full(par.params, comm)
        for p in serial.params:
            err = np.abs(grads[p.name] - p.grad).max()
            assert err <= TOL, (cuts, step, p.name, err)
            assert np.abs(data[p.name] - p.data).max() <= TOL, (cuts, step, p.name)
        for m in (serial, par):                            # one SGD step on both
            for p in m.params:
                p.data -= 0.1 * p.grad
    free_layout(par)


def check_specs(cuts, x):
    """Every block of the model on this rank: spec() against its real cache (cachecheck), its
    gradients accumulate, and the bytes one forward+backward counts equal spec().comm_bytes
    (a batch of equal parts; 1 byte of floor per allreduce call tolerated: the counters floor
    2(g-1)/g of their running total, not of each call)."""
    model = layout_mlp(N_IN, HIDDEN, N_OUT, cuts, comm, seed=3, dtype=F64)
    for block in model.blocks:
        spec_matches_cache(block, x)
        if block.params:
            grads_accumulate(block, x)
        before, calls = stats.bytes_sent, stats.calls["allreduce"]
        y, cache = block.forward(x)
        block.backward(np.ones_like(y), cache)
        sent, calls = stats.bytes_sent - before, stats.calls["allreduce"] - calls
        want = block.spec(x.shape).comm_bytes
        assert abs(sent - want) <= calls, (cuts, block, sent, want)
        x = y
    block.zero_grad()
    free_layout(model)


def expected_moved(src, dst, rows, cols):
    """Elements the ranks receive in total, from boolean masks of the full array."""
    def mask(pl, d):
        m = np.zeros((rows, cols), bool)
        r = np.array_split(np.arange(rows), pl.rows)[pl.row_of[d]]
        c = np.array_split(np.arange(cols), pl.cols)[pl.col_of[d]]
        m[np.ix_(r, c)] = True
        return m
    return sum(int((mask(dst, t) & ~mask(src, t)).sum()) for t in range(P))


def check_redistribution(src, dst, rows, cols):
    """Parts of a known array land where ``dst`` says, both ways; bytes match the formula."""
    full = np.arange(rows * cols, dtype=F64).reshape(rows, cols)
    block = Redistribute(src, dst, cols, comm, dtype=F64)
    (a0, a1), (b0, b1) = src.block(rank, rows, cols)
    (c0, c1), (d0, d1) = dst.block(rank, rows, cols)
    before = stats.bytes["alltoallv"]
    y, cache = block.forward(full[a0:a1, b0:b1].copy())
    assert np.array_equal(y, full[c0:c1, d0:d1]), (src, dst, rank)
    dx = block.backward(-full[c0:c1, d0:d1].copy(), cache)
    assert np.array_equal(dx, -full[a0:a1, b0:b1]), (src, dst, rank)
    sent = comm.allreduce_scalars([stats.bytes["alltoallv"] - before])[0]
    want = 8 * (expected_moved(src, dst, rows, cols) + expected_moved(dst, src, rows, cols))
    assert sent == want == block.bytes_moved(rows), (src, dst, sent, want)
    return want


def check_redistributions():
    places = [Placement.full(P)]
    for c in all_cuts(P):
        places += [Placement.input_of(c, P), Placement.output_of(c, P)]
    places = list(dict.fromkeys(places))
    pairs = list(itertools.product(places, repeat=2))
    if len(pairs) > 60:                  # 4 ranks: a seeded sample keeps the scenario fast
        pairs = [pairs[i] for i in np.random.default_rng(1).permutation(len(pairs))[:60]]
    for src, dst in pairs:
        check_redistribution(src, dst, BATCH, 6)
    for src, dst in itertools.product(places[:6], repeat=2):
        check_fd(src, dst, 5, 6)
    # a closed form: batch rows over p devices -> every device the whole batch; forward each
    # device fetches the rows it lacks, backward keeps its own rows (no communication)
    rows, cols = 4 * P, 3
    moved = check_redistribution(Placement.input_of(Cut(P, 1, 1), P), Placement.full(P), rows, cols)
    assert moved == 8 * P * (rows - rows // P) * cols, moved
    # Megatron: a column layer's output is the row layer's input, nothing moves
    assert Placement.output_of(Cut(1, 1, P), P) == Placement.input_of(Cut(1, P, 1), P)


def check_fd(src, dst, rows, cols, eps=1e-6):
    """Finite differences of L(X) = sum over the distinct target blocks of w . y, X the logical
    input (the same on every rank, perturbed in lockstep): each rank's backward must give its
    part of dL/dX = w, the full gradient on every copy."""
    rng = np.random.default_rng(5)
    X, w = rng.standard_normal((rows, cols)), rng.standard_normal((rows, cols))
    block = Redistribute(src, dst, cols, comm, dtype=F64)
    (a0, a1), (b0, b1) = src.block(rank, rows, cols)
    (c0, c1), (d0, d1) = dst.block(rank, rows, cols)
    copies = sum(dst.row_of[d] == dst.row_of[rank] and dst.col_of[d] == dst.col_of[rank]
                 for d in range(P))

    def loss(Xv):
        y, cache = block.forward(Xv[a0:a1, b0:b1].copy())
        mine = float(np.sum(w[c0:c1, d0:d1] * y)) / copies
        return comm.allreduce_scalars([mine])[0], cache

    _, cache = loss(X)
    dx = block.backward(w[c0:c1, d0:d1].copy(), cache)
    for i, j in zip(rng.integers(rows, size=6), rng.integers(cols, size=6)):
        Xp, Xm = X.copy(), X.copy()
        Xp[i, j] += eps
        Xm[i, j] -= eps
        numeric = (loss(Xp)[0] - loss(Xm)[0]) / (2 * eps)
        assert abs(numeric - w[i, j]) <= 1e-7, (src, dst, i, j, numeric, w[i, j])
        if a0 <= i < a1 and b0 <= j < b1:
            assert abs(dx[i - a0, j - b0] - numeric) <= 1e-7, (src, dst, i, j, rank)


def check_refusals():
    """Bad cuts raise the same message on every rank, before any collective."""
    calls = sum(stats.calls.values())
    bad = [(lambda: Cut(0, 1, 1), "batch must be an integer >= 1, got 0"),
           (lambda: Cut(1, 2.0, 1), "reduce must be an integer >= 1, got 2.0"),
           (lambda: layout_mlp(N_IN, HIDDEN, N_OUT, [Cut(P + 1, 1, 1)] * 3, comm),
            f"= {P + 1} does not divide the {P} devices"),
           (lambda: layout_mlp(N_IN, HIDDEN, N_OUT, [Cut(1, 1, P)] * 2, comm),
            "2 cuts for 3 Linear layers"),
           (lambda: LayoutLinear(N_IN, 1, Cut(1, 1, P), comm), f"cuts 1 output features in {P}")]
    for make, msg in bad:
        try:
            make()
        except ValueError as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(f"accepted: {msg}")
    assert sum(stats.calls.values()) == calls, "a refusal communicated"


def main():
    check_refusals()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, N_IN))
    t = rng.integers(N_OUT, size=BATCH)
    lists = cut_lists(P)
    for cuts in lists:
        check_model(cuts, x, t)
    even = rng.standard_normal((12, N_IN))                 # 12 rows: equal parts for nb <= 4
    for cuts in lists[::2]:
        check_specs(cuts, even)
    check_redistributions()
    if rank == 0:
        print(f"layout_chain OK on {P} ranks: {len(lists)} layouts")


main()
