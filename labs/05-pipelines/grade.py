"""Grade lab 5 (pipelines) on 4 ranks: the schedules against hpcnn's, the execution against the
exact serial twin, and the bubble measured against (S-1)/(M+S-1).

    python labs/05-pipelines/grade.py [FILE]    # default: student.py beside this file

Checks, in order: the compute orders of GPipe, 1F1B and ZB-H1 for every stage and several M
against hpcnn's (:mod:`hpcnn.schedule.pipeline`), and the student's lists through its
``validate``; the stage's split backward (B's input gradient, W's accumulation); then each
schedule's lists executed by the student's ``execute`` on S = ranks stages, every stage's weight
and bias gradients against the serial twin's (the whole chain on the whole batch, float64) to
1e-10. Each compute instruction sleeps its cost (t_f = t_b = t_w = UNIT seconds) so that the
run's timeline shows the schedule, not the noise of a shared CPU: the measured bubble, the
simulated one (``simulate``) and the formula go to the table ``bubble``, the spans of each run to
``spans``, for plot.py.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402

TITLE = "lab 5 (pipelines)"
D, ROWS = 6, 3                        # width of every stage, rows per micro-batch
UNIT = 0.01                           # seconds each F, B and W sleeps (t_f = t_b = t_w)
ORDERS = {"gpipe": "gpipe_order", "1f1b": "one_f_one_b_order", "zb_h1": "zb_h1_order"}
RUNS = [("1f1b", 1), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8), ("gpipe", 8), ("zb_h1", 4),
        ("zb_h1", 8)]
ERROR_HINT = "run the file on its own under mpiexec to see the whole traceback"
HANG_HINT = ("a rank waits in Recv for a message never sent: each RECV_ACT / RECV_GRAD must "
             "match its SEND's tag (tag_of) and peer, and every F and B must run")
ACCUMULATE = ("W adds each micro-batch's gradient: dw += ..., db += ... (assigning keeps only "
              "the last micro-batch's)")


def reference_order(name, s, S, M):
    from hpcnn.schedule import pipeline
    lists = pipeline.SCHEDULES[name](S, M, S)
    return [(op.kind, op.mb) for op in lists[s] if op.kind in ("F", "B", "W")]


def check_orders(ck, S):
    """Every stage's order against hpcnn's, then the student's lists through validate."""
    from hpcnn.schedule.pipeline import validate
    hints = {"gpipe": "all M forwards in micro-batch order, then all M backwards in micro-batch "
             "order", "1f1b": "warm-up: min(S - 1 - s, M) forwards; steady: F of w + b then B of "
             "b; cool-down: the last B's", "zb_h1": "1F1B's order, B split from W; in the steady "
             "state the W of the oldest pending micro-batch follows B once k >= s"}
    for name, fn in ORDERS.items():
        for M in (1, 2, 3, 4, 8):
            ck.step(f"{fn}, S={S}, M={M}")
            for s in range(S):
                got = ck.call(fn, s, S, M)
                want = reference_order(name, s, S, M)
                if list(map(tuple, got)) != want:
                    k = next((i for i, (a, b) in enumerate(zip(got, want)) if tuple(a) != b),
                             min(len(got), len(want)))
                    ck.fail(f"{fn}({s}, {S}, {M}) differs from {name}'s order at position {k} "
                            f"(of {len(want)})", hints[name], want[k:k + 4], list(got[k:k + 4]))
            lists = ck.call("schedule", ck.function(fn), S, M)
            try:
                validate(lists, S, M, S)
            except ValueError as e:
                ck.fail(f"hpcnn's validate refuses schedule({fn}, {S}, {M}): {e}", hints[name])


def check_stage(ck):
    ck.step("Stage.backward_input and backward_weight")
    rng = np.random.default_rng(5)
    w, b, x, dy = rng.standard_normal((D, D)), rng.standard_normal(D), \
        rng.standard_normal((ROWS, D)), rng.standard_normal((ROWS, D))
    st = ck.call(ck.function("Stage"), w.copy(), b.copy(), 0, 2)
    y, cache = ck.call(st.forward, x)
    dz = dy * (1 - np.tanh(x @ w + b) ** 2)
    ck.close("backward_input(dy, cache)", ck.call(st.backward_input, dy, cache), dz @ w.T,
             "dx = (dy * (1 - y**2)) @ w.T: tanh's derivative, then the transposed weight")
    ck.close("dw after backward_input", st.dw, np.zeros_like(w), "B computes only the input "
             "gradient: the weight gradient is W's (backward_weight)")
    ck.call(st.backward_weight, dy, cache)
    ck.close("dw after one backward_weight", st.dw, x.T @ dz, "dw = x.T @ (dy * (1 - y**2))")
    ck.call(st.backward_weight, dy, cache)
    ck.close("dw after a second backward_weight", st.dw, 2 * x.T @ dz, ACCUMULATE)
    ck.close("db after a second backward_weight", st.db, 2 * dz.sum(axis=0), ACCUMULATE)


def weights(S):
    rng = np.random.default_rng(11)
    return [(rng.standard_normal((D, D)) / np.sqrt(D), 0.1 * rng.standard_normal(D))
            for _ in range(S)]


def data(M):
    rng = np.random.default_rng([3, M])
    return rng.standard_normal((M * ROWS, D)), rng.standard_normal((M * ROWS, D))


def serial_twin(params, x, t):
    """The whole chain on the whole batch: each stage's (dw, db) for the loss
    0.5 * sum((y - t)**2) / rows."""
    caches = []
    for w, b in params:
        y = np.tanh(x @ w + b)
        caches.append((x, y))
        x = y
    dy, grads = (x - t) / len(t), []
    for (w, b), (xi, y) in zip(reversed(params), reversed(caches)):
        dz = dy * (1 - y * y)
        grads.append((xi.T @ dz, dz.sum(axis=0)))
        dy = dz @ w.T
    return grads[::-1]


class Timed:
    """The student's stage, each pass sleeping its cost first and recording (kind, start, end):
    the timeline then shows the schedule's shape (sleeping ranks leave the shared cores free)."""

    COST = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}
    KIND = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}

    def __init__(self, stage, clock0):
        self.stage, self.clock0, self.spans = stage, clock0, []

    def __getattr__(self, name):
        attr = getattr(self.stage, name)
        if name not in self.COST:
            return attr

        def timed(*args):
            start = time.perf_counter()
            time.sleep(UNIT * self.COST[name])
            out = attr(*args)
            self.spans.append((self.KIND[name], start - self.clock0, time.perf_counter()
                               - self.clock0))
            return out
        return timed


def run_schedule(ck, comm, name, M, check):
    """Execute hpcnn's ``name`` lists with the student's execute; check against the twin."""
    from hpcnn.schedule.pipeline import SCHEDULES
    S, s = comm.Get_size(), ck.rank
    ck.step(f"execute {name}, M={M}")
    params = weights(S)
    x, t = data(M)
    lists = SCHEDULES[name](S, M, S)
    stage = ck.call(ck.function("Stage"), params[s][0].copy(), params[s][1].copy(), s, S)
    clock0 = comm.bcast(time.perf_counter())     # one host: perf_counter is one clock

    def loss_grad(mb, y):
        return (y - t[mb * ROWS:(mb + 1) * ROWS]) / len(t)
    timed = Timed(stage, clock0)
    comm.Barrier()
    inputs = [x[mb * ROWS:(mb + 1) * ROWS] for mb in range(M)]
    ck.call("execute", comm, lists[s], timed, inputs, loss_grad, (ROWS, D), S)
    if check:
        dw, db = serial_twin(params, x, t)[s]
        hint = ("each micro-batch's F, B (and W) must run once on the right data: the input of "
                "stage 0 is inputs[mb], the others' the activation received for mb; "
                + ("with W's in the list B is backward_input only, W backward_weight" if name ==
                   "zb_h1" else "without W's in the list B is the whole backward"))
        ck.close(f"{name}, M={M}: the weight gradient of stage {s}", stage.dw, dw, hint)
        ck.close(f"{name}, M={M}: the bias gradient of stage {s}", stage.db, db, hint)
    return timed.spans


def bubble_rows(ck, comm, name, M, spans):
    """The measured, simulated and formula bubbles of one run (rank 0's rows)."""
    from hpcnn.schedule.pipeline import SCHEDULES, simulate
    S = comm.Get_size()
    every = comm.gather(spans, root=0)
    if ck.rank != 0:
        return [], []
    pairs = [[(a, b) for _, a, b in r] for r in every]
    busy = sum(b - a for r in pairs for a, b in r)
    start, end = min(a for r in pairs for a, _ in r), max(b for r in pairs for _, b in r)
    want = 1.0 - busy / (S * (end - start))
    ck.close(f"measured_bubble of the {name} run (M={M})", ck.call("measured_bubble", pairs),
             want, "1 - (sum of the durations) / (ranks * (latest end - earliest start))")
    sim = simulate(SCHEDULES[name](S, M, S), UNIT, UNIT, UNIT)
    row = {"schedule": name, "M": M, "S": S, "measured": want, "simulated": sim.bubble,
           "formula": (S - 1) / (M + S - 1), "makespan": end - start, "sim_makespan": sim.makespan}
    spans_rows = [{"schedule": name, "M": M, "rank": r, "kind": k, "start": a, "end": b}
                  for r, sp in enumerate(every) for k, a, b in sp]
    return [row], spans_rows


def checks(ck, comm, out):
    S = comm.Get_size()
    check_orders(ck, S)
    check_stage(ck)
    rows, spans = [], []
    for name, M in RUNS:
        got = run_schedule(ck, comm, name, M, check=True)
        r, sp = bubble_rows(ck, comm, name, M, got)
        rows, spans = rows + r, spans + sp
    if ck.rank == 0:
        from hpcnn.log.results import save_table
        save_table(out, "bubble", rows, attrs={"ranks": S, "unit_s": UNIT})
        save_table(out, "spans", spans)
        for r in rows:
            ck.info(f"{r['schedule']:>5} M={r['M']}: bubble measured {r['measured']:.3f}, "
                    f"simulated {r['simulated']:.3f}, (S-1)/(M+S-1) = {r['formula']:.3f}")


if __name__ == "__main__":
    sys.exit(labkit.grade_main(__file__, TITLE, ranks=4, timeout=90, hang_hint=HANG_HINT))
