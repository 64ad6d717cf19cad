"""Grade lab 4 (tensor parallelism) on 4 ranks against the exact serial twin in NumPy.

    python labs/04-tensor-parallel/grade.py [FILE]    # default: student.py beside this file

Checks, in order: the shards of a weight and a bias; the conjugate collectives f and g (which
of them communicate, and what they return); the column-parallel and the row-parallel linear
layer (output, input gradient, weight and bias gradients against the serial layer's parts, to
1e-10, and a second backward doubling the gradients); the parallel MLP block against the
serial MLP, with one allreduce in its forward and one in its backward. Then it times the block
against the serial one over widths and writes the table ``tp`` to the results file.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402

TITLE = "lab 4 (tensor parallelism)"
BATCH, N, H = 5, 8, 12
WIDTHS = (64, 256, 512)                  # timed MLP widths n (hidden 4 n), batch 32
ERROR_HINT = "run the file on its own under mpiexec to see the whole traceback"
HANG_HINT = ("every rank must make the same collectives: each f_backward and g_forward is one "
             "Allreduce on every rank")
ACCUMULATE = ("gradients accumulate: dw += ..., db += ... (assigning drops what an earlier "
              "backward, another micro-batch's, left there)")


def arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


def check_shards(ck, p):
    ck.step("shard_columns and shard_rows")
    w, b = arrays(1, (N, H), (H,))
    kc, kr = H // p, N // p
    for r in range(p):
        ck.close(f"shard_columns(w {w.shape}, p={p}, r={r})", ck.call("shard_columns", w, p, r),
                 w[:, r * kc:(r + 1) * kc], "cut the columns (the output features, last axis): "
                 "w[:, r k:(r+1) k]; a transposed cut takes rows instead", rtol=0)
        ck.close(f"shard_columns(b {b.shape}, p={p}, r={r})", ck.call("shard_columns", b, p, r),
                 b[r * kc:(r + 1) * kc], "a bias is cut like the columns it belongs to", rtol=0)
        ck.close(f"shard_rows(w {w.shape}, p={p}, r={r})", ck.call("shard_rows", w, p, r),
                 w[r * kr:(r + 1) * kr], "cut the rows (the input features, first axis)", rtol=0)


def collective(ck, comm, name, arg, want, talks):
    rec = labkit.Recorder(comm)
    got = ck.call(name, rec, arg)
    ck.close(f"{name}", got, want, f"{name} {'sums over the ranks' if talks else 'is the identity'}")
    ck.equal(f"how many collectives {name} made", len(rec.calls), int(talks),
             "f: identity forward, allreduce backward; g: allreduce forward, identity backward")


def check_collectives(ck, comm):
    ck.step("the conjugate collectives f and g")
    p = comm.Get_size()
    parts = [arrays([2, r], (BATCH, N))[0] for r in range(p)]
    mine = parts[ck.rank]
    collective(ck, comm, "f_forward", mine, mine, False)
    collective(ck, comm, "f_backward", mine, sum(parts), True)
    collective(ck, comm, "g_forward", mine, sum(parts), True)
    collective(ck, comm, "g_backward", mine, mine, False)


def twice(ck, layer, dy, cache, want, what):
    """A second backward must double the gradients."""
    ck.call(layer.backward, dy, cache)
    ck.close(f"{what}: dw after a second backward", layer.dw, 2 * want[0], ACCUMULATE)
    ck.close(f"{what}: db after a second backward", layer.db, 2 * want[1], ACCUMULATE)


def check_linear(ck, comm, kind, cut_in, cut_out):
    """One layer against the serial one: ``cut_in``/``cut_out`` take this rank's part of an
    input and of an output (features on the last axis)."""
    ck.step(f"{kind}: forward and backward")
    w, b, x, dy = arrays(3, (N, H), (H,), (BATCH, N), (BATCH, H))
    layer = ck.call(ck.function(kind), comm, w, b)
    y, cache = ck.call(layer.forward, cut_in(x))
    ck.close(f"{kind}: y", y, cut_out(x @ w + b), "y = x @ w + b, the bias once")
    dx = ck.call(layer.backward, cut_out(dy), cache)
    ck.close(f"{kind}: dx", dx, cut_in(dy @ w.T), "dx = dy @ w.T, summed over the ranks where "
             "every rank computed a part of it (f_backward)")
    part_w = (x.T @ dy)[:, cut_out(np.arange(H))] if kind.startswith("Column") else (
        x.T @ dy)[cut_in(np.arange(N))]
    want = (part_w, cut_out(dy.sum(axis=0)))
    ck.close(f"{kind}: dw", layer.dw, want[0], "dw = x.T @ dy with this rank's part of x or dy")
    ck.close(f"{kind}: db", layer.db, want[1], "db = dy summed over the batch")
    twice(ck, layer, cut_out(dy), cache, want, kind)


def serial_mlp(x, w1, b1, w2, b2, dy):
    h = x @ w1 + b1
    a = np.maximum(h, 0)
    dh = (dy @ w2.T) * (h > 0)
    return a @ w2 + b2, dh @ w1.T, [x.T @ dh, dh.sum(0), a.T @ dy, dy.sum(0)]


def check_mlp(ck, comm):
    ck.step("ParallelMLP: forward and backward")
    p, r = comm.Get_size(), ck.rank
    w1, b1, w2, b2, x, dy = arrays(4, (N, H), (H,), (H, N), (N,), (BATCH, N), (BATCH, N))
    y_ref, dx_ref, grads = serial_mlp(x, w1, b1, w2, b2, dy)
    rec = labkit.Recorder(comm)
    mlp = ck.call(ck.function("ParallelMLP"), rec, w1, b1, w2, b2)
    y, cache = ck.call(mlp.forward, x)
    ck.equal("Allreduce calls in the MLP's forward", rec.names().count("Allreduce"), 1,
             "Megatron's MLP needs one: after the row-parallel layer (g), none before the ReLU")
    ck.close("ParallelMLP: y", y, y_ref, "column-parallel, ReLU on your columns, row-parallel")
    rec.calls.clear()
    dx = ck.call(mlp.backward, dy, cache)
    ck.equal("Allreduce calls in the MLP's backward", rec.names().count("Allreduce"), 1,
             "one: the column-parallel layer's input gradient (f)")
    ck.close("ParallelMLP: dx", dx, dx_ref, "the ReLU's mask is h > 0 of your own columns")
    k = H // p
    for name, got, want in (("fc1.dw", mlp.fc1.dw, grads[0][:, r * k:(r + 1) * k]),
                            ("fc1.db", mlp.fc1.db, grads[1][r * k:(r + 1) * k]),
                            ("fc2.dw", mlp.fc2.dw, grads[2][r * k:(r + 1) * k]),
                            ("fc2.db", mlp.fc2.db, grads[3])):
        ck.close(f"ParallelMLP: {name}", got, want, "each layer's part, as in the layer checks")


def measure(ck, comm, out):
    from mpi4py import MPI
    ck.step("timing the parallel MLP block against the serial one")
    p, rows = comm.Get_size(), []
    for n in WIDTHS:
        w1, b1, w2, b2, x, dy = arrays(5, (n, 4 * n), (4 * n,), (4 * n, n), (n,), (32, n), (32, n))
        mlp = ck.function("ParallelMLP")(comm, w1, b1, w2, b2)
        for mode, run in (("serial (one rank)", lambda: serial_mlp(x, w1, b1, w2, b2, dy)),
                          (f"tensor parallel ({p} ranks)",
                           lambda: mlp.backward(dy, mlp.forward(x)[1]))):
            times = []
            for _ in range(3):
                comm.Barrier()
                t = time.perf_counter()
                run()
                times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
            per_rank = 8 * (w1.size + w2.size) // (1 if mode.startswith("serial") else p)
            rows.append({"mode": mode, "width": n, "seconds": float(np.median(times)),
                         "weight_bytes": int(per_rank)})
    if ck.rank == 0:
        from hpcnn.log.results import save_table
        save_table(out, "tp", rows, attrs={"ranks": p})


def checks(ck, comm, out):
    p = comm.Get_size()
    check_shards(ck, p)
    check_collectives(ck, comm)
    r, kc, kr = ck.rank, H // p, N // p
    check_linear(ck, comm, "ColumnParallelLinear", lambda a: a,
                 lambda a: a[..., r * kc:(r + 1) * kc])
    check_linear(ck, comm, "RowParallelLinear", lambda a: a[..., r * kr:(r + 1) * kr],
                 lambda a: a)
    check_mlp(ck, comm)
    measure(ck, comm, out)


if __name__ == "__main__":
    sys.exit(labkit.grade_main(__file__, TITLE, ranks=4, timeout=90, hang_hint=HANG_HINT))
