"""Grade lab 6 (memory): rotor's dynamic program for a homogeneous chain against hpcnn's, its
sequences simulated and executed, against sqrt(L) checkpointing.

    python labs/06-memory/grade.py [FILE]    # default: student.py beside this file

Checks, in order: the student's table against hpcnn's rotor table (:func:`hpcnn.memory.rotor.
table` on the same homogeneous chain) for every length and budget, on two chains; each budget's
rebuilt sequence through hpcnn's simulator (valid, time equal to the table's, peak within the
budget). Then, on a real chain of L Linear blocks (float64), each feasible budget's sequence
and sqrt(L) checkpointing (``hpcnn.schedule.sequences.segments``) are run by hpcnn's executor:
the input gradient and every weight gradient must equal the store-all run's to 1e-10, and the
executor's exact account of live bytes must stay within the budget. Peak bytes, recomputed
forwards and their measured seconds go to the table ``memory`` for plot.py. One rank: memory
is a serial matter.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402

TITLE = "lab 6 (memory)"
CHAINS = [(8, 30, 1, 2, 1, 1, 1), (6, 40, 1, 3, 2, 3, 1)]    # n, M, uf, ub, wx, wbar, wd
L, WIDTH, ROWS = 16, 256, 64           # the real chain: L Linear(WIDTH, WIDTH) on ROWS rows
ERROR_HINT = "run the file on its own (python labs/06-memory/grade.py FILE) to see the traceback"
HANG_HINT = "a loop that does not end: the recursion of sequence must shrink k"


def profile(n, uf, ub, wx, wbar, wd):
    from hpcnn.memory.profile import ChainProfile
    return ChainProfile(tuple(["block"] * n), np.full(n, float(uf)), np.full(n, float(ub)),
                        np.full(n + 1, wx), np.full(n + 1, wbar), np.full(n + 1, wd),
                        np.zeros(n, int), np.zeros(n, int))


def check_table(ck, n, M, uf, ub, wx, wbar, wd):
    from hpcnn.memory.rotor import table
    ck.step(f"table, n={n}, M={M}, wx={wx}, wbar={wbar}, wd={wd}")
    ref, _ = table(profile(n, uf, ub, wx, wbar, wd), M)
    opt, choice = ck.call("table", n, M, uf, ub, wx, wbar, wd)
    opt, choice = np.asarray(opt, dtype=float), np.asarray(choice)
    ck.equal("the shape of opt", opt.shape, (n + 1, M + 1), "rows k = 0..n, columns m = 0..M")
    for k in range(1, n + 1):
        want, got = ref[0, k - 1], opt[k]
        if not np.array_equal(np.isfinite(want), np.isfinite(got)):
            m = int(np.argmax(np.isfinite(want) != np.isfinite(got)))
            ck.fail(f"Opt[{k}][m] is finite from another m than rotor's (first difference at "
                    f"m = {m})", "a sub-chain fits from m >= 2 wd + wbar (F_all) or wd + wx "
                    "(a checkpoint; wd + 2 wx when F_n runs); the shifts m - wbar, m - wx",
                    want, got)
        ck.close(f"Opt[{k}][m] over the finite m", np.where(np.isfinite(got), got, 0),
                 np.where(np.isfinite(want), want, 0), "the candidates: F_all first "
                 "(uf + ub + Opt[k-1][m - wbar]) and a checkpoint after i = 1 .. k-1 stages "
                 "(i uf + Opt[k-i][m - wx] + Opt[i][m]); take the least")
    return opt, choice


def check_sequences(ck, opt, choice, n, M, uf, ub, wx, wbar, wd):
    from hpcnn.memory.simulate import SequenceError, simulate
    ck.step(f"sequence, n={n}, M={M}")
    prof = profile(n, uf, ub, wx, wbar, wd)
    for m in range(M + 1):
        if not np.isfinite(opt[n][m]):
            continue
        seq = ck.call("sequence", choice, n, m, wx, wbar)
        try:
            r = simulate(seq, prof)
        except SequenceError as e:
            ck.fail(f"sequence(choice, {n}, {m}) is not a valid sequence: {e}", "choice i: the "
                    "forwards F_ck(s), F_n(s+1..s+i-1), then the last k-i stages (m - wx slots), "
                    "then the first i (m slots); choice ALL: F_all(s), the rest, B(s)")
        ck.close(f"the simulated time of sequence(choice, {n}, {m})", r.time, opt[n][m],
                 "rebuild with the choice of each sub-chain and its own m (m - wbar after "
                 "F_all, m - wx for the part after a checkpoint)")
        if r.peak > m + wx:
            ck.fail(f"sequence(choice, {n}, {m}) peaks at {r.peak:g} slots, over the budget "
                    f"{m + wx}", "the slots of each part are those its table entry assumed")


def real_chain():
    from hpcnn.nn.chain import Chain
    from hpcnn.nn.layers import Linear
    return Chain([Linear(WIDTH, WIDTH, seed=i, dtype=np.float64) for i in range(L)])


def run_real(ck, chain, seq, x, dy, ref, what):
    """Run ``seq`` with hpcnn's executor; compare with the store-all gradients ``ref``."""
    from hpcnn.memory.executor import Executor
    chain.zero_grad()
    ex = Executor(chain, seq)
    start = time.perf_counter()
    res = ex.run(x, None, dy)
    seconds = time.perf_counter() - start
    hint = "a valid sequence computes the store-all gradients exactly: check what sequence returns"
    ck.close(f"{what}: the input gradient", res.dx, ref[0], hint)
    for p, g in zip(chain.params, ref[1]):
        ck.close(f"{what}: the gradient of {p.name}", p.grad, g, hint)
    return res.peak, ex.recompute_seconds, seconds


def measure(ck):
    """Every feasible budget's DP sequence and sqrt(L) checkpointing on the real chain."""
    from hpcnn.schedule.sequences import segments, store_all
    ck.step("the real chain: store-all reference")
    chain, slot = real_chain(), ROWS * WIDTH * 8           # one activation: wx = wbar = wd = 1
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((ROWS, WIDTH)), rng.standard_normal((ROWS, WIDTH))
    chain.zero_grad()
    ref = (chain.backward_blocks(dy, chain.forward_blocks(x)[1]),
           [p.grad.copy() for p in chain.params])
    opt, choice = ck.call("table", L, L + 3, 1, 2, 1, 1, 1)
    runs = [("store all", store_all(L), None), (f"sqrt(L): {int(np.ceil(np.sqrt(L)))} "
                                                f"segments", segments(L, has_loss=False), None)]
    runs += [(f"rotor, {m + 1} slots", ck.call("sequence", choice, L, m, 1, 1), m + 1)
             for m in range(L + 3) if np.isfinite(opt[L][m])]
    rows = []
    for what, seq, budget in runs:
        ck.step(f"the real chain: {what}")
        peak, redo_s, seconds = run_real(ck, chain, seq, x, dy, ref, what)
        if budget is not None and peak > budget * slot:
            ck.fail(f"{what}: the executor measured a peak of {peak} bytes, over the budget of "
                    f"{budget} slots of {slot} bytes", "the sequence must fit the m it was "
                    "rebuilt for")
        n_redo = ck.call("recomputed", seq, L)
        ck.equal(f"recomputed(sequence of {what}, {L})", n_redo,
                 sum(op.kind.startswith("F") for op in seq) - L,
                 "count every forward op (F_ck, F_n, F_all) and subtract one per stage")
        rows.append({"method": what.split(":")[0].split(",")[0], "budget_slots": budget or 0,
                     "peak_bytes": peak, "peak_slots": peak / slot, "recomputed": n_redo,
                     "recompute_s": redo_s, "step_s": seconds})
    return rows


def checks(ck, comm, out):
    for n, M, uf, ub, wx, wbar, wd in CHAINS:
        opt, choice = check_table(ck, n, M, uf, ub, wx, wbar, wd)
        check_sequences(ck, opt, choice, n, M, uf, ub, wx, wbar, wd)
    rows = measure(ck)
    from hpcnn.log.results import save_table
    save_table(out, "memory", rows, attrs={"L": L, "width": WIDTH, "rows": ROWS,
                                           "slot_bytes": ROWS * WIDTH * 8})
    sq = rows[1]
    same = min((r for r in rows if r["method"] == "rotor" and r["peak_slots"] <= sq["peak_slots"]),
               key=lambda r: r["recomputed"], default=None)
    ck.info(f"sqrt(L) checkpointing: peak {sq['peak_slots']:.0f} slots, {sq['recomputed']} "
            f"forwards recomputed ({sq['recompute_s'] * 1e3:.1f} ms)")
    if same:
        ck.info(f"rotor within that peak: {same['peak_slots']:.0f} slots, {same['recomputed']} "
                f"recomputed ({same['recompute_s'] * 1e3:.1f} ms); store-all: "
                f"{rows[0]['peak_slots']:.0f} slots")


if __name__ == "__main__":
    sys.exit(labkit.grade_main(__file__, TITLE, ranks=1, timeout=120, hang_hint=HANG_HINT))
