"""Unite and conquer against one Lanczos solver: restarts and time to a residual of ``--tol``.

On the normalised adjacency Â of an SBM (largest connected component; ``--nodes``, 4 blocks,
average degree 10), the k largest eigenpairs by, on all the ranks of the run (an even number):

- ``single_m1``: :func:`hpcnn.graph.lanczos` with basis ``m1`` over all ranks;
- ``single_m2``: the same with basis ``m2``;
- ``unite``: :func:`hpcnn.graph.unite_and_conquer` with subspaces (m1, m2), one instance per
  half of the ranks (so each instance has half the ranks the single solvers have).

Each round runs the three in an order that rotates from round to round; a variant's time is the
median over rounds of the slowest rank's seconds. The residual history (the largest relative
residual estimate of the k wanted Ritz pairs after each cycle, and its time) is kept from the
last round; the restart counts do not depend on the round. Printed: per variant the restarts,
the median seconds, the matvecs and the true residuals (for ``unite``: how many times each
instance restarted from the other's state); saved in ``--out``: table
``unite_p{size}`` (one row per variant) and ``history_p{size}`` (one row per variant and cycle;
for ``unite`` each instance's estimate and the best of them).

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/graph_unite.py
    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/graph_unite.py
    python analysis/graph_unite.py runs/bench/graph_unite.h5 docs/figures/graph_unite.png

Options: ``--nodes=100000 --k=8 --m1=20 --m2=32 --tol=1e-8 --rounds=3 --seed=0
--out=runs/bench/graph_unite.h5``.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcnn import scripts  # noqa: E402
from hpcnn.graph import (DistributedMatrix, lanczos, largest_component,  # noqa: E402
                         normalized_adjacency, sbm, unite_and_conquer)
from hpcnn.log.results import save_table  # noqa: E402

VARIANTS = ("single_m1", "single_m2", "unite")


def run_variant(name, a, op, comm, o):
    """-> (seconds on the slowest rank, restarts, matvecs, largest true residual, history,
    restarts at which each unite-and-conquer instance took the other's state (0, 0: single))."""
    history = []
    comm.Barrier()
    t = time.perf_counter()
    if name == "unite":
        res = unite_and_conquer(a, comm, o.k, subspaces=(o.m1, o.m2), tol=o.tol, seed=o.seed,
                                history=history)
        restarts, matvecs, converged = res.cycles, int(res.matvecs.sum()), res.converged
        adopted = tuple(int(x) for x in res.adopted)
    else:
        m = o.m1 if name == "single_m1" else o.m2
        res = lanczos(op, o.k, m=m, tol=o.tol, seed=o.seed, history=history)
        restarts, matvecs, converged, adopted = res.restarts, res.matvecs, res.converged, (0, 0)
    seconds = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
    if not converged:
        raise SystemExit(f"{name} did not reach tol={o.tol}")
    return seconds, restarts, matvecs, float(res.residuals.max()), history, adopted


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--m1", type=int, default=20)
    ap.add_argument("--m2", type=int, default=32)
    ap.add_argument("--tol", type=float, default=1e-8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join("runs", "bench", "graph_unite.h5"))
    o = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size % 2:
        scripts.refuse(f"graph_unite: unite and conquer splits the ranks in two: got {size}")
    a = normalized_adjacency(largest_component(sbm(o.nodes, blocks=4, avg_degree=10.0,
                                                   seed=o.seed)).adjacency)
    op = DistributedMatrix.from_global(a, comm=comm)
    if rank == 0:
        print(f"SBM Â of {a.shape[0]} nodes, k={o.k}, m1={o.m1}, m2={o.m2}, tol={o.tol:g}, "
              f"{size} ranks (unite: 2 groups of {size // 2})", flush=True)
    times = {v: [] for v in VARIANTS}
    last = {}
    for r in range(o.rounds):
        for v in VARIANTS[r % 3:] + VARIANTS[: r % 3]:
            out = run_variant(v, a, op, comm, o)
            times[v].append(out[0])
            last[v] = out
    if rank != 0:
        return 0
    load = os.getloadavg()[0]
    rows, hist = [], []
    for v in VARIANTS:
        _, restarts, matvecs, resid, history, adopted = last[v]
        med = float(np.median(times[v]))
        rows.append({"variant": v, "ranks": size, "nodes": a.shape[0], "k": o.k, "m1": o.m1,
                     "m2": o.m2, "tol": o.tol, "restarts": restarts, "seconds": med,
                     "seconds_min": min(times[v]), "seconds_max": max(times[v]),
                     "matvecs": matvecs, "true_residual": resid, "adopted_m1": adopted[0],
                     "adopted_m2": adopted[1]})
        for cycle, entry in enumerate(history):
            worst = entry[1] if v == "unite" else [entry[1]]
            hist.append({"variant": v, "cycle": cycle, "seconds": entry[0],
                         "residual": min(worst), "instance_m1": worst[0],
                         "instance_m2": worst[-1]})
        print(f"  {v:10s} {restarts:3d} restarts  median {med:.3f} s  (range {min(times[v]):.3f}-"
              f"{max(times[v]):.3f})  {matvecs} matvecs  true residual {resid:.1e}"
              + (f"  adopted the other's state: m1 {adopted[0]}, m2 {adopted[1]} times"
                 if v == "unite" else ""))
    print(f"  load {load:.2f}")
    attrs = {"load_avg_1min": load, "rounds": o.rounds}
    save_table(o.out, f"unite_p{size}", rows, attrs)
    save_table(o.out, f"history_p{size}", hist, attrs)
    print(f"saved tables unite_p{size}, history_p{size} in {o.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
