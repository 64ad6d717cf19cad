"""Step time and communication share of a tensor-parallel transformer block, tp = 1, 2, 4.

A :class:`~hpcnn.parallel.tensor.attention.ParallelTransformerBlock` (float32, B=8, T=128, 8 heads,
MLP 4C, no dropout) at two widths (C = 256, 512), sequence parallelism off and on (tp > 1), for
every tp in {1, 2, 4} that divides the world size. A step is one forward + backward of the block
(+ the once-per-step sync of the partial LayerNorm/bias gradients under sequence parallelism),
no optimizer.

Layout: COMM_WORLD is split into world/tp groups of tp consecutive ranks (tp fastest, as in
:class:`~hpcnn.parallel.collectives.grid.ProcessGrid`), and ALL groups run at the same time: with 4 ranks,
tp=1 is 4 independent replicas, tp=2 two groups, tp=4 one group. Every configuration keeps every
rank busy, so the machine load is the same and tp values compare at equal load; ``machine tok/s``
= groups x B x T / step is the throughput of the whole machine in that layout.

Figures, per configuration: ``step`` = median over repeats of the slowest rank's step time (each
repeat starts on every rank after one world barrier); ``comm`` = median over repeats of the mean
over ranks of the seconds spent inside the Communicator's collectives (``CommStats.comm_seconds``
delta: with MPICH a rank waiting for a slower peer spins inside the call, so this includes load
imbalance); ``share`` = comm / step; ``bytes`` = ``CommStats.bytes_sent`` delta of one step
(checked equal on every rank and every repeat) and ``spec`` = ``block.spec(x).comm_bytes`` plus
the sync volume: they must agree. Configurations are interleaved round by round so that drifts of
a shared host hit them all alike; round 0 is a warm-up.

    mpiexec -n 4 python -m mpi4py benchmarks/tensor_parallel.py [--repeats=10]
    mpiexec -n 2 python -m mpi4py benchmarks/tensor_parallel.py        (tp in {1, 2})

Table ``tp_p{world}`` in runs/bench/tensor_parallel.h5. On a 2-vCPU machine 4 ranks oversubscribe
the cores: absolute times are inflated (each rank gets about half a core) and the collectives much
more so (latency 6-9x worse oversubscribed, see /work/shared/MEASURED.md; MPICH busy-polls, so a
rank waiting in a collective takes CPU from the rank sharing its core). Read the 4-rank shares as
an upper bound; the 2-rank run (one rank per vCPU) is the cleaner measurement.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcnn import scripts  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.parallel.collectives import CommStats, Communicator  # noqa: E402
from hpcnn.parallel.tensor.attention import ParallelTransformerBlock  # noqa: E402

REPEATS = 10                            # --repeats: main() sets it
BATCH, SEQ, HEADS, WIDTHS = 8, 128, 8, (256, 512)   # B, T of the brief; 8 heads split by tp<=8
OUT = os.path.join("runs", "bench", "tensor_parallel.h5")

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()


def say(*a):
    scripts.say(*a, rank=rank)


class Config:
    """One (tp, width, sp) configuration: this rank's block, its input slice and its counters."""

    def __init__(self, group, tp, width, sp):
        self.tp, self.width, self.sp = tp, width, sp
        self.stats = CommStats()
        self.comm = Communicator(group, self.stats, name=f"tp{tp}")
        self.block = ParallelTransformerBlock(self.comm, width, HEADS, sequence_parallel=sp,
                                              seed=0, index=1, dtype=np.float32)
        rng = np.random.default_rng([1, width])          # the same x, dy in every group
        x = rng.standard_normal((BATCH, SEQ, width), dtype=np.float32)    # (B, T, C)
        dy = rng.standard_normal((BATCH, SEQ, width), dtype=np.float32)
        if sp:                                            # (B, T/tp, C): this rank's slice
            t = SEQ // tp
            sl = slice(self.comm.rank * t, (self.comm.rank + 1) * t)
            x, dy = x[:, sl].copy(), dy[:, sl].copy()
        self.x, self.dy = x, dy
        vol = self.block.sync_volume().sent(tp) if sp else 0
        self.spec_bytes = self.block.spec(x.shape).comm_bytes + vol
        self.rows = []                                    # (step s, comm s, bytes) per repeat

    def step(self):
        dy = self.dy.copy()                               # the backward may reduce it in place
        world.Barrier()                                   # every group starts together
        s0, b0 = self.stats.comm_seconds, self.stats.bytes_sent
        t = time.perf_counter()
        self.block.zero_grad()
        _, cache = self.block.forward(self.x)
        self.block.backward(dy, cache)
        if self.sp:
            self.block.sync_replicated_grads()
        t = time.perf_counter() - t
        return t, self.stats.comm_seconds - s0, self.stats.bytes_sent - b0

    def summary(self):
        a = np.asarray(self.rows, dtype=np.float64)       # (repeats, 3)
        slow = np.empty_like(a[:, 0])
        world.Allreduce(a[:, 0].copy(), slow, op=MPI.MAX)
        mean_comm = np.empty_like(a[:, 1])
        world.Allreduce(a[:, 1].copy(), mean_comm, op=MPI.SUM)
        mean_comm /= size
        nbytes = {int(b) for b in a[:, 2]}
        every = world.allgather(nbytes)
        agree = all(s == {self.spec_bytes} for s in every)
        step, comm = float(np.median(slow)), float(np.median(mean_comm))
        groups = size // self.tp
        return {"tp": self.tp, "groups": groups, "width": self.width, "sp": int(self.sp),
                "step_ms": 1e3 * step, "comm_ms": 1e3 * comm, "comm_share": comm / step,
                "bytes_per_step": int(min(nbytes)), "spec_bytes": int(self.spec_bytes),
                "bytes_match": int(agree), "machine_tok_s": groups * BATCH * SEQ / step}


def table(rows):
    head = ["tp", "groups", "width", "SP", "step ms", "comm ms", "share", "bytes/step",
            "spec bytes", "match", "machine tok/s"]
    cells = [head] + [[str(r["tp"]), str(r["groups"]), str(r["width"]),
                       "on" if r["sp"] else "off", f"{r['step_ms']:.1f}", f"{r['comm_ms']:.1f}",
                       f"{100 * r['comm_share']:.1f}%", f"{r['bytes_per_step']:,}",
                       f"{r['spec_bytes']:,}", "yes" if r["bytes_match"] else "NO",
                       f"{r['machine_tok_s']:,.0f}"] for r in rows]
    widths = [max(len(c[j]) for c in cells) for j in range(len(head))]
    for c in cells:
        say("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    return ap


def main(argv=None):
    global REPEATS
    REPEATS = parser().parse_args(argv).repeats
    tps = [tp for tp in (1, 2, 4) if size % tp == 0 and tp <= size]
    groups = {tp: world.Split(color=rank // tp, key=rank % tp) for tp in tps}
    configs = [Config(groups[tp], tp, w, sp) for tp in tps for w in WIDTHS
               for sp in ((False, True) if tp > 1 else (False,))]
    lib = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    say(f"{size} ranks on {os.cpu_count()} vCPUs, ParallelTransformerBlock float32 B={BATCH} "
        f"T={SEQ} heads={HEADS}, {REPEATS} repeats (+1 warm-up), all groups concurrent, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, MPI: {lib}")
    t0 = time.perf_counter()
    for rnd in range(REPEATS + 1):                        # interleaved rounds
        for c in configs:
            row = c.step()
            if rnd:
                c.rows.append(row)
    rows = [c.summary() for c in configs]
    say(f"({time.perf_counter() - t0:.0f} s)")
    table(rows)
    if rank == 0:
        save_table(OUT, f"tp_p{size}", rows, attrs={
            "ranks": size, "vcpus": os.cpu_count(), "batch": BATCH, "seq": SEQ, "heads": HEADS,
            "repeats": REPEATS, "dtype": "float32", "layout": "all tp groups concurrent",
            "omp_threads": os.environ["OMP_NUM_THREADS"], "mpi": lib})
        print(f"wrote {OUT} (table tp_p{size})")
    for g in groups.values():
        g.Free()


if __name__ == "__main__":
    main()
