"""Grade lab 2 (data parallelism) on 4 ranks against the exact serial twin.

    python labs/02-data-parallel/grade.py [FILE]    # default: student.py beside this file

Every rank builds the same hpcnn MLP (float64) twice: the replica the student's code trains on
its shard of each step's batch, and the serial twin trained on the whole batch. After each of
STEPS SGD steps every gradient must equal the twin's to 1e-10: naive (equal shares), bucketed
(buckets as ``make_buckets`` specifies, each Iallreduce started at the block that completes
it), and heterogeneous (unequal shares, ``weighted_mean``). The losses and each method's
gradient error, with the plain mean's on the unequal shares for comparison, go to the table
``curves`` of the results file for plot.py.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402

TITLE = "lab 2 (data parallelism)"
STEPS, LR, CAP = 6, 0.5, 40          # SGD steps per method, learning rate, bucket cap (elements)
N_IN, HIDDEN, N_OUT = 6, (8, 8), 3
ERROR_HINT = "run the file on its own under mpiexec to see the whole traceback"
HANG_HINT = ("every rank must call the same collectives in the same order: the same number of "
             "Allreduce / Iallreduce calls, and Wait on every request")


def build():
    from hpcnn.nn.models import mlp
    return mlp(N_IN, HIDDEN, N_OUT, seed=3, dtype=np.float64)


def batch(step, rows):
    rng = np.random.default_rng([7, step])
    return rng.standard_normal((rows, N_IN)), rng.integers(0, N_OUT, rows)


def serial_twin(model, x, y):
    """The whole batch on one rank: its loss, the gradients left in ``model``."""
    model.zero_grad()
    loss, caches = model.forward(x, y)
    model.backward(1.0, caches, need_dx=False)
    return loss


def sgd(*models):
    for m in models:
        for p in m.params:
            p.data -= LR * p.grad


def compare(ck, model, twin, method, hint):
    """Every gradient against the twin's; returns the largest relative error."""
    worst = 0.0
    for p, q in zip(model.params, twin.params):
        ck.close(f"{method}: the gradient of {p.name}", p.grad, q.grad, hint)
        worst = max(worst, float(np.abs(p.grad - q.grad).max() / np.abs(q.grad).max()))
    return worst


def shares_of(p, hetero):
    return [2 * (r + 1) for r in range(p)] if hetero else [4] * p


def run(ck, comm, method, step_fn, hint, hetero=False):
    """STEPS steps of ``step_fn(model, x, y, n_local)`` against the twin; the curve's rows."""
    model, twin, rows = build(), build(), []
    shares = shares_of(comm.Get_size(), hetero)
    lo, n = sum(shares[:ck.rank]), shares[ck.rank]
    for step in range(STEPS):
        ck.step(f"{method}, step {step}")
        x, y = batch(step, sum(shares))
        twin_loss = serial_twin(twin, x, y)
        loss = step_fn(model, x[lo:lo + n], y[lo:lo + n], n)
        err = compare(ck, model, twin, method, hint) if hint else max(
            float(np.abs(p.grad - q.grad).max() / np.abs(q.grad).max())
            for p, q in zip(model.params, twin.params))
        rows.append({"method": method, "step": step, "loss": comm.allreduce(loss * n) / sum(shares),
                     "grad_error": err, "serial_loss": twin_loss})
        sgd(model, twin)
    return rows


def expected_buckets(sizes, cap):
    buckets, total = [], 0
    for j in reversed(range(len(sizes))):
        if buckets and total + sizes[j] <= cap:
            buckets[-1].append(j)
            total += sizes[j]
        else:
            buckets.append([j])
            total = sizes[j]
    return buckets


def check_buckets(ck):
    ck.step("make_buckets")
    model = build()
    sizes = [p.data.size for p in model.params]
    for cap in (CAP, 10 ** 6, 1):
        ck.equal(f"make_buckets({sizes}, cap={cap})", ck.call("make_buckets", sizes, cap),
                 expected_buckets(sizes, cap), "walk the parameters from the last to the first "
                 "(the backward's order); a bucket's total stays <= cap unless it holds one "
                 "parameter")


def check_overlap(ck, rec, engine_holder):
    """The Iallreduce calls of the last step: one per bucket, each at the block completing it."""
    engine = engine_holder[0]
    names = rec.names()
    ck.equal("the collectives of one bucketed step", names,
             ["Iallreduce"] * len(engine.buckets), "one Iallreduce per bucket, nothing else")
    ck.equal("the block at whose completion each bucket's Iallreduce started", rec.marks,
             engine.ready_at, "start a bucket's Iallreduce in on_block_done(i) for the buckets "
             "whose ready_at is i, not later in finish: that is the overlap")


def bucketed(ck, comm):
    rec = labkit.Recorder(comm)
    holder = []

    def step(model, x, y, n):
        if not holder:
            holder.append(ck.call(ck.function("BucketedAllreduce"), rec, model, CAP))
        engine = holder[0]
        hook = engine.on_block_done

        def marked(i):
            rec.mark = i
            ck.call(hook, i)
        engine.on_block_done = marked
        rec.calls.clear()
        rec.marks.clear()
        loss = ck.call(ck.function("bucketed_step"), rec, model, x, y, engine)
        engine.on_block_done = hook
        check_overlap(ck, rec, holder)
        return loss
    return run(ck, comm, "bucketed", step, "in finish, write each bucket's slice back into its "
               "parameters' gradients, in the bucket's order, divided by p")


def hetero(ck, comm):
    from mpi4py import MPI

    def weighted(model, x, y, n):
        model.zero_grad()
        loss, caches = model.forward(x, y)
        model.backward(1.0, caches, need_dx=False)
        ck.call("weighted_mean", comm, model.params, n)
        return loss

    def plain(model, x, y, n):                  # the biased plain mean, for the figure
        loss = serial_twin(model, x, y)
        for p in model.params:
            comm.Allreduce(MPI.IN_PLACE, p.grad)
            p.grad /= comm.Get_size()
        return loss
    rows = run(ck, comm, "weighted mean, unequal shares", weighted, "rank i's gradient is the "
               "mean of its n_i samples: weigh it by n_i and divide the sum by sum_i n_i; the plain "
               "mean of the means is biased towards the small shares", hetero=True)
    return rows + run(ck, comm, "plain mean, unequal shares", plain, None, hetero=True)


def checks(ck, comm, out):
    rows = run(ck, comm, "naive", lambda m, x, y, n: ck.call("naive_step", comm, m, x, y),
               "sum each gradient over the ranks with one Allreduce, then divide by p: each "
               "rank's gradient is the mean over its own shard")
    check_buckets(ck)
    rows += bucketed(ck, comm)
    rows += hetero(ck, comm)
    if ck.rank == 0:
        from hpcnn.log.results import save_table
        save_table(out, "curves", rows, attrs={"ranks": comm.Get_size(), "lr": LR})
    ck.info(f"the plain mean on unequal shares is off by up to "
            f"{max(r['grad_error'] for r in rows if r['method'].startswith('plain')):.1e} "
            f"(relative), the weighted mean by at most "
            f"{max(r['grad_error'] for r in rows if r['method'].startswith('weighted')):.1e}")


if __name__ == "__main__":
    sys.exit(labkit.grade_main(__file__, TITLE, ranks=4, timeout=90, hang_hint=HANG_HINT))
