"""Grade lab 3 (ZeRO-1, ZeRO-2) on 4 ranks against hpcnn's AdamW on the whole vector.

    python labs/03-zero/grade.py [FILE]       # default: student.py beside this file

Checks: ``shard_range`` for n below, at and above p and not divisible by p; then ZeRO-1 and
ZeRO-2 for STEPS steps on a vector of N elements, each rank with its own gradient: the
optimizer state of each rank holds its part only, the parameters after every step equal the
serial twin's (hpcnn's AdamW, weight decay 0, on the mean gradient) to 1e-10 on every rank,
and so does each rank's part of Adam's moments; ZeRO-2 never allreduces, it reduce-scatters.
Then it times both steps over vector lengths and writes the table ``zero`` (seconds, state
and communicated bytes per rank) to the results file for plot.py.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402

TITLE = "lab 3 (ZeRO-1, ZeRO-2)"
N, STEPS, LR = 37, 3, 1e-2
TIMED = (1000, 10000, 100000, 300000)
ERROR_HINT = "run the file on its own under mpiexec to see the whole traceback"
HANG_HINT = ("every rank must make the same collectives with matching counts: the counts list "
             "of Reduce_scatter and Allgatherv is the same on every rank (every rank's part)")


def check_shards(ck, p):
    ck.step("shard_range")
    for n in (3, 8, N):
        got = [tuple(ck.call("shard_range", n, p, r)) for r in range(p)]
        q, extra = divmod(n, p)
        want = [(r * q + min(r, extra), (r + 1) * q + min(r + 1, extra)) for r in range(p)]
        ck.equal(f"shard_range({n}, {p}, r) for r = 0..{p - 1}", got, want,
                 "contiguous parts in rank order covering [0, n) exactly once, the first n % p "
                 "ranks one element longer (rank 0 owns the first part)")


def twin(params0):
    from hpcnn.nn.core import Parameter
    from hpcnn.nn.optim import AdamW
    param = Parameter(params0.copy(), "flat")
    return param, AdamW([param], weight_decay=0.0)


def check_state(ck, opt, lo, hi, name):
    for moment in ("m", "v"):
        size = getattr(opt, moment, None)
        size = None if size is None else np.asarray(size).size
        ck.equal(f"{name}: the size of this rank's moment `{moment}`", size, hi - lo,
                 "ZeRO shards the optimizer state: a rank keeps Adam's moments for its own part "
                 "[lo, hi) only, not for the whole vector")


def run(ck, comm, name, hint):
    """STEPS steps of the student's ``name`` optimizer against the twin; returns the Recorder."""
    p = comm.Get_size()
    rec = labkit.Recorder(comm)
    opt = ck.call(ck.function(name), rec, N)
    lo, hi = shard_range(N, p, ck.rank)
    check_state(ck, opt, lo, hi, name)
    params = np.random.default_rng(1).standard_normal(N)
    ref, adam = twin(params)
    for step in range(STEPS):
        ck.step(f"{name}, step {step}")
        grads = [np.random.default_rng([2, step, r]).standard_normal(N) for r in range(p)]
        ref.grad = sum(grads) / p
        adam.step(LR)
        rec.calls.clear()
        ck.call(opt.step, params, grads[ck.rank].copy(), LR)
        ck.close(f"{name}: the parameters after step {step}", params, ref.data, hint)
        ck.close(f"{name}: this rank's part of Adam's m after step {step}", opt.m,
                 adam.state["flat/m"][lo:hi], "update the moments of your own part [lo, hi) "
                 "with the same part of the mean gradient")
    return rec


def shard_range(n, p, r):
    q, extra = divmod(n, p)
    return r * q + min(r, extra), (r + 1) * q + min(r + 1, extra)


def check_zero2_calls(ck, rec):
    names = rec.names()
    if "Allreduce" in names or "Reduce_scatter" not in names:
        ck.fail("the collectives of a ZeRO-2 step", "ZeRO-2 reduce-scatters the gradient: each "
                "rank receives the sum of its own part only, (p-1)/p of the bytes of an "
                "allreduce", "Reduce_scatter, then Allgatherv", names)


def measure(ck, comm, out):
    from mpi4py import MPI
    ck.step("timing ZeRO-1 and ZeRO-2 steps")
    p, rows = comm.Get_size(), []
    for n in TIMED:
        for name, comm_bytes in (("Zero1", 3), ("Zero2", 2)):
            opt = ck.function(name)(comm, n)
            params, times = np.zeros(n), []
            for _ in range(3):
                grads = np.ones(n)
                comm.Barrier()
                t = time.perf_counter()
                opt.step(params, grads, LR)
                times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
            rows.append({"method": name, "n": n, "seconds": float(np.median(times)),
                         "state_bytes": int(opt.m.nbytes + opt.v.nbytes),
                         "sent_bytes": int(comm_bytes * (p - 1) / p * 8 * n)})
    if ck.rank == 0:
        from hpcnn.log.results import save_table
        save_table(out, "zero", rows, attrs={"ranks": p})


def checks(ck, comm, out):
    check_shards(ck, comm.Get_size())
    run(ck, comm, "Zero1", "Allreduce the gradient, divide by p, Adam on params[lo:hi] with "
        "grads[lo:hi], then Allgatherv every rank's part back into params")
    check_zero2_calls(ck, run(ck, comm, "Zero2", "Reduce_scatter with recvcounts = every rank's "
                              "part size, divide by p, then the same update and gather"))
    measure(ck, comm, out)


if __name__ == "__main__":
    sys.exit(labkit.grade_main(__file__, TITLE, ranks=4, timeout=90, hang_hint=HANG_HINT))
