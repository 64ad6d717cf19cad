"""The two-level allreduce against the library's flat one across a throttled link, measured
beside what the planner's machine model predicts from the link's own figures.

Run as root, it builds an emulated cluster (:mod:`netns_cluster`: N nodes as network
namespaces, q ranks each, every node's link throttled to ``--rate`` per direction, TCP between
nodes) and starts itself in it. There, on the N x q ranks:

1. **The machine, measured** (every figure a median over ``--rounds``): between nodes, the
   latency (an 8-byte ping-pong) and the rate of one stream alone (a 4 MiB ping-pong between
   rank 0 and rank q, the others idle: ``stream_bandwidth``) and of every rank of a node at
   once (node 0's q ranks each sending 4 MiB to its peer on node 1: ``bandwidth`` per rank,
   one direction of the link, as the machine files count it), and the library's own ring step
   across the link (its allreduce of two 4 MiB parts between rank 0 and rank q alone, as
   calibration fits a level's ``reduce_bandwidth`` from the library's allreduce); inside the
   nodes, every node at once, one ring step (a 4 MiB part exchanged with the next local rank
   and summed: ``reduce_bandwidth``) and its copy (``bandwidth``). These make a two-level
   :class:`hpcnn.plan.machine.Machine`, priced by the planner's own rule
   (:func:`hpcnn.plan.hybrid.dp_allreduce_forms`): ``flat``, a ring over the N q ranks, one
   stream a node crossing (for ``lib``, at the library's step rate where slower); ``hier``, the
   nodes' reduce-scatter and all-gather around the rails' rings, q streams a node crossing.
2. **The allreduces, timed** on float32 buffers of ``--sizes`` MiB, rounds alternated in a fresh
   random order each, the slowest rank's time, medians: ``lib``, the MPI library's flat
   Allreduce forced to a ring over the whole communicator (MPICH:
   ``MPIR_CVAR_ALLREDUCE_COMPOSITION=2``, ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring``, so that
   it is the algorithm priced as ``flat``); ``ring``, hpcnn's flat ring; ``hier``, hpcnn's
   two-level allreduce (:mod:`hpcnn.parallel.collectives.hier`), checked bitwise identical on
   every rank and equal to ``lib``'s sum to rounding.

It prints, per size, the measured ``lib / hier`` (the median of the rounds' ratios) beside the
predicted ``flat / hier`` and their relative difference (the target: within 20 %), the same for
``ring / hier``, and saves tables ``throttled_link`` (the sizes)
and ``throttled_link_machine`` (the measured figures) to runs/bench/throttled_link.h5.

    sudo .venv/bin/python benchmarks/throttled_link.py [--nodes=2] [--per-node=2]
        [--rate=500mbit] [--sizes=16,64] [--rounds=7]

Every node's ranks share this machine's cores: an emulation, so named in the output and the
tables. Without root, or without namespaces or tbf, it says why in one line and exits 2.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = 4 << 20                       # bytes of the machine's microbenchmarks
OUT = os.path.join("runs", "bench", "throttled_link.h5")
LIBRARY_RING = {"MPIR_CVAR_ALLREDUCE_COMPOSITION": "2",
                "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--rate", default="500mbit", help="each node's link per direction (tc)")
    ap.add_argument("--sizes", default="16,64", help="message sizes, MiB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def slowest(world, fn) -> float:
    """The slowest rank's seconds of ``fn()``, the ranks lined up by a barrier before it."""
    world.Barrier()
    t = time.perf_counter()
    fn()
    return world.allreduce(time.perf_counter() - t, op=_mpi().MAX)


def median_of(world, fn, rounds: int) -> float:
    """The median over ``rounds`` of :func:`slowest` of ``fn()``."""
    return float(np.median([slowest(world, fn) for _ in range(rounds)]))


def _mpi():
    from mpi4py import MPI
    return MPI


def link_figures(world, node, rounds: int) -> dict:
    """The machine's figures (module docstring, step 1): seconds and bytes per second."""
    r, q = world.Get_rank(), node.Get_size()
    big, small = np.ones(PROBE // 4, np.float32), np.ones(2, np.float32)
    got, tmp = np.empty_like(big), np.empty_like(big)

    def pingpong(buf):
        if r == 0:
            world.Send(buf, q)
            world.Recv(buf, q)
        elif r == q:
            world.Recv(buf, 0)
            world.Send(buf, 0)

    def everyone(buf, comm, shift, add=False):
        k, n = comm.Get_rank(), comm.Get_size()
        comm.Sendrecv(buf, (k + shift) % n, recvbuf=tmp[:buf.size], source=(k - shift) % n)
        if add:
            np.add(got[:buf.size], tmp[:buf.size], out=got[:buf.size])

    def node_sends(buf):                # every rank of node 0 to its peer on node 1, at once
        if r < q:
            world.Send(buf, r + q)
        elif r < 2 * q:
            world.Recv(tmp[:buf.size], r - q)

    pair = world.Split(0 if r in (0, q) else 1, r)     # rank 0 and rank q: one a node

    def library_pair():                 # the library's allreduce of 2 parts across the link
        if r in (0, q):
            pair.Allreduce(_mpi().IN_PLACE, both)

    both = np.ones(PROBE // 2, np.float32)
    inter_lat = median_of(world, lambda: pingpong(small), rounds) / 2
    lib_step = PROBE / (median_of(world, library_pair, rounds) / 2 - inter_lat)
    pair.Free()
    stream = PROBE / (median_of(world, lambda: pingpong(big), rounds) / 2 - inter_lat)
    inter_all = PROBE / (median_of(world, lambda: node_sends(big), rounds) - inter_lat)
    intra_lat = median_of(world, lambda: everyone(small, node, 1), rounds)
    copy = PROBE / (median_of(world, lambda: everyone(big, node, 1), rounds) - intra_lat)
    reduce = PROBE / (median_of(world, lambda: everyone(big, node, 1, add=True), rounds)
                      - intra_lat)
    return {"inter_latency_s": inter_lat, "inter_stream_Bps": stream, "inter_lib_step_Bps": lib_step,
            "inter_all_Bps": inter_all, "intra_latency_s": intra_lat,
            "intra_copy_Bps": copy, "intra_reduce_Bps": reduce}


def machine_of(fig: dict, nodes: int, q: int, library: bool = False):
    """The two-level machine of the measured figures (a nominal device: only the
    communication is priced here); with ``library``, the links' ring step is the library's
    (``reduce_bandwidth``: its 2-rank allreduce across the link, as calibration fits a level's
    from the library's allreduce)."""
    from hpcnn.plan.machine import Device, Level, Machine
    inf = float("inf")
    node = Level(name="node", fanout=q, latency_s=fig["intra_latency_s"],
                 bandwidth=[[inf, fig["intra_copy_Bps"]]],
                 reduce_bandwidth=[[inf, fig["intra_reduce_Bps"]]])
    links = Level(name="links", fanout=nodes, latency_s=fig["inter_latency_s"],
                  bandwidth=[[inf, fig["inter_all_Bps"]]],
                  stream_bandwidth=[[inf, fig["inter_stream_Bps"]]],
                  reduce_bandwidth=[[inf, fig["inter_lib_step_Bps"]]] if library else ())
    device = Device(name="rank", flops={"float32": 1e9}, memory_bandwidth=1e9, memory_bytes=1e9)
    return Machine(name="netns-emulated", levels=(node, links), device=device,
                   source="measured by benchmarks/throttled_link.py in the same run")


def digest(a) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def time_sizes(world, comm, sizes, rounds: int) -> list:
    """Per size: the medians of ``lib``, ``ring`` and ``hier`` (module docstring, step 2)."""
    MPI = _mpi()
    rows = []
    for mib in sizes:
        n = (mib << 20) // 4
        src = (np.arange(n, dtype=np.float32) % 7 + world.Get_rank() + 1) / 8
        bufs = {k: np.empty_like(src) for k in ("lib", "ring", "hier")}
        run = {"lib": lambda: world.Allreduce(MPI.IN_PLACE, bufs["lib"]),
               "ring": lambda: comm.allreduce(bufs["ring"], algorithm="ring"),
               "hier": lambda: comm.allreduce(bufs["hier"], algorithm="hier")}
        ts = {k: [] for k in run}
        order = list(run)
        rng = random.Random(mib)                    # the same order on every rank
        for _ in range(rounds):
            rng.shuffle(order)
            for k in order:
                np.copyto(bufs[k], src)
                ts[k].append(slowest(world, run[k]))
        same = len(set(world.allgather(digest(bufs["hier"])))) == 1
        close = bool(np.allclose(bufs["hier"], bufs["lib"], rtol=1e-6, atol=0))
        rows.append({"mib": mib, **{f"{k}_s": float(np.median(v)) for k, v in ts.items()},
                     "measured": float(np.median(np.divide(ts["lib"], ts["hier"]))),
                     "ring_measured": float(np.median(np.divide(ts["ring"], ts["hier"]))),
                     **{f"{k}_spread": float(np.subtract(*np.percentile(v, [75, 25])))
                        for k, v in ts.items()},
                     "hier_bitwise_same": int(same), "hier_matches_lib": int(close)})
    return rows


def worker(a) -> int:
    MPI = _mpi()
    from hpcnn.parallel.collectives import Communicator
    from hpcnn.plan.hybrid import Layout, dp_allreduce_forms
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    q, p = node.Get_size(), world.Get_size()
    nodes = p // q
    fig = link_figures(world, node, a.rounds)
    machine, library = machine_of(fig, nodes, q), machine_of(fig, nodes, q, library=True)
    rows = time_sizes(world, Communicator(world), [int(s) for s in a.sizes.split(",")], a.rounds)
    for row in rows:
        forms = dp_allreduce_forms(row["mib"] << 20, Layout(p, 1, 1, 1), machine)
        lib = dp_allreduce_forms(row["mib"] << 20, Layout(p, 1, 1, 1), library)["flat"]
        row.update(pred_lib_s=lib, pred_flat_s=forms["flat"], pred_hier_s=forms["hier"],
                   predicted=lib / forms["hier"], ring_predicted=forms["flat"] / forms["hier"])
        row["error"] = row["measured"] / row["predicted"] - 1
        row["ring_error"] = row["ring_measured"] / row["ring_predicted"] - 1
    if world.Get_rank() == 0:
        report(a, fig, rows, nodes, q)
    return 0


def report(a, fig: dict, rows: list, nodes: int, q: int) -> None:
    from hpcnn.log.results import save_table
    link = os.environ.get("HPCNN_EMULATED_LINK", "?")
    print(f"emulated cluster: {nodes} nodes x {q} ranks on one machine ({os.cpu_count()} cores), "
          f"link {link}; load {os.getloadavg()[0]:.2f}")
    print(f"measured: between nodes latency {fig['inter_latency_s'] * 1e6:.0f} us, one stream "
          f"{fig['inter_stream_Bps'] / 1e6:.0f} MB/s, all ranks {fig['inter_all_Bps'] / 1e6:.0f} "
          f"MB/s each, the library's ring step {fig['inter_lib_step_Bps'] / 1e6:.0f} MB/s; in a "
          f"node latency {fig['intra_latency_s'] * 1e6:.0f} us, copy "
          f"{fig['intra_copy_Bps'] / 1e9:.2f} GB/s, reduce step {fig['intra_reduce_Bps'] / 1e9:.2f}"
          " GB/s")
    print(f"{'MiB':>4} | {'lib':>6} {'ring':>6} {'hier':>6} ms measured | {'lib':>6} {'ring':>6} "
          f"{'hier':>6} ms predicted | lib/hier: {'pred':>4} {'meas':>4} {'error':>6} | "
          f"ring/hier: {'pred':>4} {'meas':>4} {'error':>6} | hier bitwise")
    for r in rows:
        print(f"{r['mib']:>4} | {r['lib_s'] * 1e3:>6.0f} {r['ring_s'] * 1e3:>6.0f} "
              f"{r['hier_s'] * 1e3:>6.0f}             | {r['pred_lib_s'] * 1e3:>6.0f} "
              f"{r['pred_flat_s'] * 1e3:>6.0f} {r['pred_hier_s'] * 1e3:>6.0f}              | "
              f"          {r['predicted']:>4.2f} {r['measured']:>4.2f} {r['error']:>+6.1%} | "
              f"           {r['ring_predicted']:>4.2f} {r['ring_measured']:>4.2f} "
              f"{r['ring_error']:>+6.1%} | "
              f"{'same' if r['hier_bitwise_same'] else 'DIFFER'}"
              f"{'' if r['hier_matches_lib'] else ' (not the library sum!)'}")
    print("(times: medians of the slowest rank's; ratios: medians of the rounds' ratios)")
    ok = all(abs(r[e]) <= 0.2 and r[m] > 1 for r in rows
             for e, m in (("error", "measured"), ("ring_error", "ring_measured")))
    print(f"verdict: hier beats lib and ring by the predicted factors within 20 % at every size: "
          f"{'yes' if ok else 'no'}")
    attrs = {"emulated_link": link, "nodes": nodes, "per_node": q, "rounds": a.rounds}
    save_table(a.out, "throttled_link", rows, attrs)
    save_table(a.out, "throttled_link_machine", [fig], attrs)
    print(f"tables throttled_link, throttled_link_machine -> {a.out}")


def _sibling(name: str):
    """The module ``benchmarks/NAME.py`` beside this script (benchmarks/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.worker:
        return worker(a)
    netns_cluster = _sibling("netns_cluster")
    why = netns_cluster.usable()
    if why:
        print(f"throttled_link: {why}", file=sys.stderr)
        return 2
    with netns_cluster.cluster(a.nodes, a.rate) as (names, launcher):
        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", os.path.dirname(HERE)), **LIBRARY_RING}
        line = netns_cluster.mpiexec_line(names, launcher, a.per_node, a.rate, env)
        argv = sys.argv[1:] if argv is None else list(argv)
        return subprocess.run(line + [sys.executable, os.path.abspath(__file__), "--worker",
                                      *argv]).returncode


if __name__ == "__main__":
    sys.exit(main())
