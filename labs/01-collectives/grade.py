"""Grade lab 1 (collectives) on 4 ranks: the ring's sums, its messages, the model and its fit.

    python labs/01-collectives/grade.py [FILE]      # default: student.py beside this file

Checks, in order: every Sendrecv goes right around the ring (checked before it is made); the sums equal the exact serial
twin (every rank's array made on every rank and added up) and hpcnn's plain ring to 1e-10, at
sizes below, at and above p; each rank sends 2 (p - 1) messages of about n / p elements;
``ring_model`` and ``fit_alpha_beta`` on made-up figures. Then it times the student's ring and
the MPI library's Allreduce over message sizes, fits both, and writes the table ``timings`` to
the results file (runs/student.h5) for plot.py.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402

TITLE = "lab 1 (collectives)"
SIZES = (1000, 7, 4, 3, 1)                 # elements: above, at and below p = 4
TIMED_BYTES = [2 ** k for k in (4, 8, 12, 16, 18, 20)]     # 16 B .. 1 MiB
ERROR_HINT = ("'Message truncated' means a rank received a chunk longer than its receive "
              "buffer: sender and receiver disagree on the chunk of that step (chunk r - k is "
              "sent, chunk r - k - 1 received and added); otherwise run the file on its own "
              "under mpiexec for the whole traceback")
HANG_HINT = ("a ring hangs when a rank waits for a message nobody sends: use Sendrecv (send "
             "and receive in one call), the same number of steps on every rank, dest = right "
             "and source = left")


def expected_sum(n, step, p):
    """The serial twin: every rank's array, made here, summed in rank order."""
    return sum(np.random.default_rng([step, r]).standard_normal(n) for r in range(p))


def direction_check(ck, p):
    """A check of each Sendrecv before it is made: right around the ring (a message the wrong
    way would fail inside MPI, or hang, before the grader could name it)."""
    right, left = (ck.rank + 1) % p, (ck.rank - 1) % p

    def before(name, args, kw):
        dest = kw.get("dest", args[1] if len(args) > 1 else None)
        source = kw.get("source", args[4] if len(args) > 4 else None)
        if dest != right or source != left:
            ck.fail(f"a Sendrecv went to rank {dest} from rank {source}",
                    f"rank r sends to its right neighbour (r + 1) % p = {right} and receives "
                    f"from its left (r - 1) % p = {left}: a reversed or mixed direction breaks "
                    "the chunk order of the algorithm", (right, left), (dest, source))
    return before


def check_messages(ck, rec, n, p):
    """2 (p - 1) calls, about n / p elements each."""
    ck.equal(f"the number of Sendrecv calls for {n} elements", len(rec.calls), 2 * (p - 1),
             "p - 1 steps of reduce-scatter, then p - 1 of all-gather")
    sent = sum(np.asarray(kw.get("sendbuf", args[0] if args else None)).size
               for _, args, kw in rec.calls)
    most = 2 * (p - 1) * -(-n // p)
    if not 2 * (p - 1) * (n // p) <= sent <= most:
        ck.fail(f"elements sent for {n} elements", "each step sends one chunk of about n / p "
                "elements, not the whole buffer", f"about 2 (p-1) n/p, at most {most}", sent)


def check_sums(ck, comm):
    from hpcnn.parallel.collectives import Communicator
    from hpcnn.parallel.collectives.plain_ring import allreduce as hpcnn_ring
    p = comm.Get_size()
    for step, n in enumerate(SIZES):
        ck.step(f"ring_allreduce of {n} elements")
        buf = np.random.default_rng([step, ck.rank]).standard_normal(n)
        rec = labkit.Recorder(comm, allowed={"Sendrecv", "Get_rank", "Get_size"},
                              before=direction_check(ck, p))
        got = ck.call("ring_allreduce", rec, buf)
        check_messages(ck, rec, n, p)
        if got is not buf:
            ck.fail("ring_allreduce returned another array", "sum in place and return buf")
        ck.close(f"the sum of {n} elements", buf, expected_sum(n, step, p),
                 "chunk indices: at step k rank r sends chunk r-k and adds the chunk r-k-1 it "
                 "receives; then p-1 all-gather steps pass the finished chunks on")
        ref = hpcnn_ring(Communicator(comm), np.random.default_rng([step, ck.rank])
                         .standard_normal(n))
        ck.close("the sum against hpcnn's plain ring", buf, ref, "as above")


def check_model(ck):
    ck.step("ring_model and fit_alpha_beta on made-up figures")
    p, alpha, beta = 4, 5e-6, 2e-9
    n = np.array([8.0, 1024.0, 65536.0, 1048576.0])
    model = ck.call("ring_model", alpha, beta, n, p)
    ck.close("ring_model(5e-6, 2e-9, n, p=4)", model, 6 * alpha + 1.5 * n * beta,
             "2 (p-1) alpha + 2 (p-1)/p n beta: each rank sends 2 (p-1) chunks of n/p bytes")
    fit = ck.call("fit_alpha_beta", n, 6 * alpha + 1.5 * n * beta, p)
    ck.close("fit_alpha_beta on exact figures", np.array(fit, dtype=float),
             np.array([alpha, beta]), "solve the least squares of the model's two columns "
             "(its value at alpha=1, beta=0 and at alpha=0, beta=1)", rtol=1e-6)


def timed(comm, fn, n, reps=3):
    """The median over ``reps`` of the slowest rank's seconds for one call of ``fn`` on n
    float64 (one call first, untimed)."""
    from mpi4py import MPI
    buf = np.ones(n)
    fn(buf)
    times = []
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        fn(buf)
        times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return float(np.median(times))


def measure(ck, comm, out):
    from mpi4py import MPI
    ck.step("timing the ring and the library over message sizes")
    p, ring = comm.Get_size(), ck.function("ring_allreduce")
    algorithms = {"ring (yours)": lambda b: ring(comm, b),
                  "library": lambda b: comm.Allreduce(MPI.IN_PLACE, b)}
    rows, fits = [], {}
    for name, fn in algorithms.items():
        secs = [timed(comm, fn, nb // 8) for nb in TIMED_BYTES]
        rows += [{"algorithm": name, "bytes": nb, "seconds": s} for nb, s in zip(TIMED_BYTES, secs)]
        fits[name] = ck.call("fit_alpha_beta", np.array(TIMED_BYTES, float), np.array(secs), p)
        alpha, beta = fits[name]
        rate = f"{1 / beta / 1e9:.2f} GB/s" if beta > 0 else "noise: no bandwidth resolved"
        ck.info(f"{name}: alpha = {alpha * 1e6:.1f} us, beta = {beta * 1e9:.3f} ns/byte ({rate})")
    if ck.rank == 0:
        from hpcnn.log.results import save_table
        attrs = {"ranks": p, **{f"{k} {q}": v[i] for k, v in fits.items()
                                for i, q in enumerate(("alpha", "beta"))}}
        save_table(out, "timings", rows, attrs=attrs)


def checks(ck, comm, out):
    check_sums(ck, comm)
    check_model(ck)
    measure(ck, comm, out)


if __name__ == "__main__":
    sys.exit(labkit.grade_main(__file__, TITLE, ranks=4, timeout=90, hang_hint=HANG_HINT))
