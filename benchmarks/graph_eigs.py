"""hpcnn's thick-restart Lanczos against ARPACK (scipy's eigsh) on the normalised adjacency of an SBM.

The k largest eigenvalues of Â = D̃^{-1/2}(A+I)D̃^{-1/2} of a stochastic block model (largest
connected component), same matrix, same k, same basis size (eigsh's default ncv = max(2k+1, 20))
and same tolerance, in one run. Each round times, in an order that rotates from round to round:

- ``eigsh``: ARPACK on rank 0 (one process);
- ``lanczos_1``: :func:`hpcnn.graph.lanczos` on rank 0 alone (``comm=None``, no MPI);
- ``lanczos_p``: the same on all ranks of the run (only when there are 2 or more).

Ranks with nothing to do wait in a sleeping poll, not a busy MPI barrier, so that they leave the
cores to the timed process. The medians over rounds are printed with the ratios
eigsh / lanczos_1 and lanczos_1 / lanczos_p (above 1: the second is faster), the largest relative
difference of the eigenvalues, and the machine's load; table ``graph_eigs_p{size}`` goes to
runs/bench/graph_eigs.h5.

    OMP_NUM_THREADS=1 python benchmarks/graph_eigs.py [--nodes=100000] [--k=8] [--tol=1e-8]
        [--rounds=5] [--degree=10] [--blocks=4]
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/graph_eigs.py

``--nodes=1000000`` for the large case; ``--build-only`` times the SBM's construction alone.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import time  # noqa: E402

import numpy as np  # noqa: E402
import scipy.sparse.linalg as sla  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcnn import scripts  # noqa: E402
from hpcnn.graph import (DistributedMatrix, lanczos, largest_component,  # noqa: E402
                         normalized_adjacency, sbm)
from hpcnn.log.results import save_table  # noqa: E402

OUT = os.path.join("runs", "bench", "graph_eigs.h5")
OPTS = {"nodes": 100_000, "k": 8, "tol": 1e-8, "rounds": 5, "degree": 10.0, "blocks": 4,
        "build-only": 0}


def whole(raw: str) -> int:
    """An integer, also written as a float (``1e5``)."""
    return int(float(raw))


def parser():
    ap = scripts.parser(__doc__)
    for key in ("nodes", "k", "rounds", "blocks"):
        ap.add_argument(f"--{key}", type=whole, default=OPTS[key])
    ap.add_argument("--tol", type=float, default=OPTS["tol"])
    ap.add_argument("--degree", type=float, default=OPTS["degree"], help="average degree")
    scripts.flag(ap, "build-only", False, "time building the graph only")
    return ap


def options(argv):
    """The options as a dict keyed as :data:`OPTS`."""
    a = vars(parser().parse_args(argv))
    return {k: int(a[k.replace("-", "_")]) if k == "build-only" else a[k] for k in OPTS}


def wait_for(comm, rank0_work):
    """Run ``rank0_work`` on rank 0 while the others sleep-poll; -> its seconds (on every rank)."""
    if comm.Get_rank() == 0:
        t = time.perf_counter()
        out = rank0_work()
        seconds = time.perf_counter() - t
        comm.Ibarrier().Wait()
    else:
        out, req = None, comm.Ibarrier()
        while not req.Test():
            time.sleep(0.002)
    return comm.bcast(seconds if comm.Get_rank() == 0 else None), out


def main(argv=None):
    opts = options(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    t = time.perf_counter()
    g = sbm(opts["nodes"], blocks=opts["blocks"], avg_degree=opts["degree"], seed=0)
    build = time.perf_counter() - t
    if opts["build-only"]:
        if rank == 0:
            print(f"SBM {g.n_nodes} nodes, {g.n_edges} edges (average degree "
                  f"{2 * g.n_edges / g.n_nodes:.2f}) built in {build:.2f} s; "
                  f"load {os.getloadavg()[0]:.2f}")
        return
    a = normalized_adjacency(largest_component(g).adjacency)
    k, tol, ncv = opts["k"], opts["tol"], max(2 * opts["k"] + 1, 20)
    serial = DistributedMatrix.from_global(a) if rank == 0 else None
    dist = DistributedMatrix.from_global(a, comm=comm) if size > 1 else None
    if rank == 0:
        print(f"SBM {g.n_nodes} nodes, {g.n_edges} edges built in {build:.2f} s; largest component "
              f"{a.shape[0]} nodes; k={k}, ncv={ncv}, tol={tol:g}, {size} rank(s)")
    variants = ["eigsh", "lanczos_1"] + (["lanczos_p"] if size > 1 else [])
    times = {v: [] for v in variants}
    values, info = {}, {}
    for r in range(opts["rounds"]):
        for v in variants[r % len(variants):] + variants[: r % len(variants)]:
            if v == "eigsh":
                s, out = wait_for(comm, lambda: sla.eigsh(a, k, which="LA", tol=tol, ncv=ncv))
                if rank == 0:
                    values[v] = np.sort(out[0])[::-1]
            elif v == "lanczos_1":
                s, out = wait_for(comm, lambda: lanczos(serial, k, m=ncv, tol=tol))
                if rank == 0:
                    values[v], info[v] = out.values, out
            else:
                comm.Barrier()
                t = time.perf_counter()
                out = lanczos(dist, k, m=ncv, tol=tol)
                s = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
                values[v], info[v] = out.values, out
            times[v].append(s)
    if rank != 0:
        return
    med = {v: float(np.median(ts)) for v, ts in times.items()}
    diff = max(float(np.max(np.abs(values[v] - values["eigsh"]) / np.abs(values["eigsh"])))
               for v in variants[1:])
    load = os.getloadavg()[0]
    row = {"nodes": a.shape[0], "edges": a.nnz, "ranks": size, "k": k, "ncv": ncv, "tol": tol,
           **{f"{v}_s": med[v] for v in variants}, "eig_rel_diff": diff, "build_s": build,
           "restarts": info["lanczos_1"].restarts, "matvecs": info["lanczos_1"].matvecs}
    for v in variants:
        print(f"  {v:10s} median {med[v]:.3f} s over {len(times[v])} rounds")
    print(f"  eigsh / lanczos_1 = {med['eigsh'] / med['lanczos_1']:.2f}  "
          f"({info['lanczos_1'].restarts} restarts, {info['lanczos_1'].matvecs} matvecs)")
    if size > 1:
        row["speedup"] = med["lanczos_1"] / med["lanczos_p"]
        row["halo_bytes"] = info["lanczos_p"].bytes_sent
        print(f"  lanczos_1 / lanczos_p = {row['speedup']:.2f} on {size} ranks "
              f"(rank 0 sent {info['lanczos_p'].bytes_sent / 2**20:.1f} MiB of halo)")
    print(f"  largest relative eigenvalue difference to eigsh {diff:.1e}; load {load:.2f}")
    save_table(OUT, f"graph_eigs_p{size}", [row], {"load_avg_1min": load})
    print(f"saved table graph_eigs_p{size} in {OUT}")


if __name__ == "__main__":
    main()
