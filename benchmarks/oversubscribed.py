"""What a rank computes at when ranks outnumber cores and the others wait in MPI.

The planner's machine (:mod:`hpcnn.plan.machine`) gives each device a core; ``hpcnn calibrate``
on a node with more ranks than cores records what a rank gets while every rank computes. In a
step, ranks also wait: in a pipeline bubble, in a collective whose partner is late. Whether a
waiting rank frees its core decides what the others compute at. This script measures it on the
ranks at hand: for k = 1 .. N, ranks 0 .. k-1 run a fixed amount of work while the other N - k
wait, either in a blocking ``Recv`` (how hpcnn's pipeline and collectives wait: MPICH polls)
or in a ``Test`` + 1 ms sleep loop (a rank that really leaves its core), and the active ranks'
seconds are compared with all N computing at once. Two kinds of work: ``matmul`` (a 384 x 384
float32 product, in cache) and ``stream`` (three element-wise passes over 16 MiB float32
arrays: memory traffic). Rounds alternate the two ways of waiting; medians over rounds.

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/oversubscribed.py [--rounds=5]
        [--out=runs/bench/oversubscribed.h5]

Prints, per kind of work, way of waiting and k, the active ranks' median seconds as a ratio to
all N computing (1.00: the waiting ranks took as much of the cores as computing ones; N / k
at most, k >= cores: no gain), and saves the table ``oversubscribed`` (rows: work, wait, active,
seconds, ratio) with the cores and ranks as attributes.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcnn import scripts  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.plan.calibrate import cores_here  # noqa: E402

TAG = 7


def works(stream_mib: int):
    """name -> a function doing one fixed unit of work."""
    a = np.random.default_rng(0).random((384, 384), dtype=np.float32)
    x = np.ones(stream_mib * 2**18, np.float32)
    y = np.empty_like(x)

    def matmul():
        for _ in range(40):
            a @ a

    def stream():
        for _ in range(8):
            np.multiply(x, 1.0001, out=y)
            np.add(y, x, out=y)
            np.maximum(y, 0, out=y)
    return {"matmul": matmul, "stream": stream}


def wait(req, how: str) -> None:
    """Complete ``req`` polling (MPICH's blocking wait) or sleeping 1 ms between tests."""
    if how == "recv":
        req.Wait()
        return
    while not req.Test():
        time.sleep(1e-3)


def one(comm, work, k: int, how: str) -> float:
    """Seconds of ``work`` on ranks < k (their mean) while the others wait ``how``: each active
    rank but 0 tells rank 0 it is done, rank 0 then releases the waiting ranks."""
    rank, n = comm.Get_rank(), comm.Get_size()
    flag = np.zeros(1)
    comm.Barrier()
    seconds = None
    if rank < k:
        t0 = time.perf_counter()
        work()
        seconds = time.perf_counter() - t0
    if rank == 0:
        for q in range(1, k):
            wait(comm.Irecv(flag, source=q, tag=TAG), how)
        for q in range(k, n):
            comm.Send(flag, dest=q, tag=TAG)
    elif rank < k:
        comm.Send(flag, dest=0, tag=TAG)
    else:
        wait(comm.Irecv(flag, source=0, tag=TAG), how)
    got = [s for s in comm.allgather(seconds) if s is not None]
    return float(np.mean(got))


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stream_mib", type=int, default=16)
    ap.add_argument("--out", default="runs/bench/oversubscribed.h5")
    a = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    todo = works(a.stream_mib)
    for w in todo.values():                                   # warm: pages, caches
        w()
    times = {}
    for r in range(a.rounds):
        ways = ("recv", "sleep") if r % 2 == 0 else ("sleep", "recv")
        for how in ways:
            for name, work in todo.items():
                for k in range(1, n + 1):
                    times.setdefault((name, how, k), []).append(one(comm, work, k, how))
    if comm.Get_rank() == 0:
        cores = cores_here()
        rows = []
        for (name, how, k), ts in sorted(times.items()):
            all_n = np.median(times[(name, how, n)])
            rows.append({"work": name, "wait": how, "active": k,
                         "seconds": float(np.median(ts)), "ratio": float(np.median(ts) / all_n)})
        print(f"{n} ranks on {cores} cores, {a.rounds} rounds; active ranks' seconds / all {n} "
              f"computing:")
        for name in todo:
            for how in ("recv", "sleep"):
                line = ", ".join(f"k={r['active']}: {r['ratio']:.2f}" for r in rows
                                 if r["work"] == name and r["wait"] == how)
                way = "a blocking Recv" if how == "recv" else "Test + sleep"
                print(f"  {name:6s} others waiting in {way}: {line}")
        save_table(a.out, "oversubscribed", rows, attrs={"ranks": n, "cores": cores,
                                                         "rounds": a.rounds,
                                                         "stream_mib": a.stream_mib})
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
