"""What the hang watchdog's recording costs (hpcnn/parallel/collectives/watchdog.py).

Every blocking communication call records itself (``enter``/``leave``: a counter, a tuple and
two list stores). This measures, alternating the variants in rounds and taking medians:

- ``enter+leave``: one recorded call with nothing inside it (one process, no MPI), in ns: what a
  Communicator method other than the allreduce hot path adds;
- on 2+ ranks, ``allreduce 8 B``: the allreduce hot path (the C module when built) recording
  each call against the same path with recording off (``lean.record = None``), in us per call
  and as a ratio: the worst case, a call that does almost nothing.

    OMP_NUM_THREADS=1 python benchmarks/watchdog_overhead.py
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/watchdog_overhead.py [--rounds=15]

Prints one line per figure (rank 0) with the load average, so that a figure is read with the
load it was measured under.
"""
import os
import statistics
import time

import numpy

from hpcnn import scripts
from hpcnn.parallel.collectives import watchdog


def per_call(fn, n: int) -> float:
    """Seconds per call of ``fn()`` over ``n`` calls."""
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def recording_ns(rounds: int, n: int = 200_000) -> tuple[float, float]:
    """Median ns per call of an empty body and of one enter+leave pair."""
    enter, leave = watchdog.enter, watchdog.leave

    def recorded():
        leave(enter("allreduce", "dp", -1, 8))

    def empty():
        pass
    base, rec = [], []
    for r in range(rounds):
        for name in (("empty", "recorded") if r % 2 == 0 else ("recorded", "empty")):
            (base if name == "empty" else rec).append(per_call(empty if name == "empty"
                                                               else recorded, n))
    return statistics.median(base) * 1e9, statistics.median(rec) * 1e9


def allreduce_us(rounds: int, n: int = 20000):
    """Median us per 8-byte allreduce on the C hot path with recording off and on, the median
    per-round ratio, rank and size; None if the C module is not built."""
    from mpi4py import MPI
    from hpcnn.parallel.collectives import Communicator
    comm = Communicator(MPI.COMM_WORLD)
    lean = comm.allreduce
    if not hasattr(lean, "record"):
        return None
    buf = numpy.ones(1)
    out = {None: [], "on": []}
    for r in range(rounds):
        for mode in ((None, "on") if r % 2 == 0 else ("on", None)):
            lean.record = watchdog._calls if mode else None
            comm.comm.Barrier()
            out[mode].append(per_call(lambda: lean(buf), n))
    lean.record = watchdog._calls
    ratios = [a / b for a, b in zip(out["on"], out[None])]
    return (statistics.median(out[None]) * 1e6, statistics.median(out["on"]) * 1e6,
            statistics.median(ratios), comm.rank, comm.size)


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    return ap


def main(argv=None) -> None:
    rounds = parser().parse_args(argv).rounds
    load = os.getloadavg()[0]
    under_mpi = any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))
    rank = 0
    if under_mpi:
        got = allreduce_us(rounds)
        if got is None:
            from mpi4py import MPI
            rank = MPI.COMM_WORLD.Get_rank()
            if rank == 0:
                print("allreduce: the C hot path is not built (make): no A/B on ranks")
        else:
            b, r, ratio, rank, size = got
            if rank == 0:
                print(f"allreduce 8 B on {size} ranks, C hot path: recording off {b:.2f} us, on "
                      f"{r:.2f} us, ratio {ratio:.3f} (median of {rounds} alternating rounds)")
    if rank == 0:
        base, rec = recording_ns(rounds)
        print(f"enter+leave: {rec - base:.0f} ns per recorded call ({rec:.0f} ns with the loop, "
              f"empty loop {base:.0f} ns); load average {load:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
