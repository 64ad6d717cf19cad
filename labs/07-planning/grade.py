"""Grade lab 7 (planning) on 2 ranks: the BSP cost of an MLP's layouts by hand against hpcnn's
planner, then the layouts measured.

    python labs/07-planning/grade.py [FILE]    # default: student.py beside this file

Checks, in order: ``ring_allreduce`` against a machine level's (``hpcnn.plan.machine.Level``);
for two MLPs on two made-up machines of one level (p = 4 and p = 2) and four layouts
(replicated, data parallel, Megatron's column then row, and dp 2 x tp 2), each operator's
supersteps and the step's total against :func:`hpcnn.plan.cost.strategy_cost` on the same
machine (float64, SGD, no loss) to 1e-10. Then, on this machine's file
(:func:`hpcnn.plan.machine.this_machine`) and on the ranks of this job, each layout of a larger
MLP runs with hpcnn's layout executor (``hpcnn.parallel.layout.layout_mlp``): its measured step
against hpcnn's price, with the planner's own choice (``hpcnn.plan.search.dra_sequences``). The
table ``layouts`` of the results file holds them for plot.py.
"""
import os
import sys
import time
from collections import namedtuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # labs/: labkit
import labkit  # noqa: E402

TITLE = "lab 7 (planning)"
Machine = namedtuple("Machine", "p flops latency g mem_bw")
CASES = [((64, 256, 16), 32, Machine(4, 2e9, 1e-5, 1 / 5e8, 1e10)),     # dims, batch, machine
         ((32, 128, 8), 16, Machine(2, 5e8, 3e-6, 1 / 2e9, 4e9))]
MEASURE = ((256, 1024, 64), 64)          # the measured MLP: dims, batch
WORD = 8                                 # float64
ERROR_HINT = "run the file on its own under mpiexec to see the whole traceback"
HANG_HINT = "the functions you write make no MPI call: a loop that does not end?"


def layouts(p):
    from hpcnn.schedule.placement import Cut
    out = {"replicated": [Cut(1, 1, 1)] * 2, "data parallel": [Cut(p, 1, 1)] * 2,
           "megatron (column, row)": [Cut(1, 1, p), Cut(1, p, 1)]}
    if p == 4:
        out["dp 2 x tp 2"] = [Cut(2, 1, 2), Cut(2, 2, 1)]
    return out


def hpcnn_machine(m):
    from hpcnn.plan.machine import Device, Level
    from hpcnn.plan.machine import Machine as HMachine
    device = Device("lab", {"float64": m.flops}, m.mem_bw, 1e12)
    return HMachine("lab", (Level("node", m.p, m.latency, ((float("inf"), 1 / m.g),)),), device)


def check_ring(ck):
    ck.step("ring_allreduce")
    m = CASES[0][2]
    level = hpcnn_machine(m).levels[0]
    for n, nbytes in ((1, 800), (2, 800), (4, 8000), (4, 0), (3, 1e6)):
        ck.close(f"ring_allreduce({n}, {nbytes:g}, L, g)",
                 ck.call("ring_allreduce", n, nbytes, m.latency, m.g),
                 level.allreduce_seconds(nbytes, n), "2 (n - 1) steps, each a message of "
                 "nbytes / n: 2 (n-1) (L + nbytes / n * g); nothing to do on one device")


def chain_ops(dims, batch):
    """(graph, [(i, k, j), ...]) of an MLP: the ReLU's between the Linears have no cut."""
    from hpcnn.plan.cost import mlp_graph
    graph = mlp_graph(dims, batch)
    return graph, [(op.i, op.k, op.j) for op in graph.ops]


HINTS = {"compute": "forward, input gradient and weight gradient: 3 * 2 i k j FLOPs, shared by "
         "the nb nk nj devices of the cut", "update": "SGD: 4 passes of 3 words over the local "
         "weight part and its bias, (k/nk + 1) * j/nj numbers", "reduce y": "the partial y "
         "[i/nb, j/nj] summed over the nk devices splitting k", "reduce dx": "the partial dx "
         "[i/nb, k/nk] summed over the nj devices splitting j", "grad allreduce": "one buffer "
         "of the local weight and bias parts, over the nb devices of different rows"}


def check_layouts(ck, dims, batch, m):
    """Each layout's terms and total against strategy_cost on the same machine."""
    from hpcnn.plan.cost import strategy_cost
    graph, ops = chain_ops(dims, batch)
    machine = hpcnn_machine(m)
    for name, cuts in layouts(m.p).items():
        ck.step(f"{name} on p={m.p}, MLP {dims}, batch {batch}")
        ref = strategy_cost(graph, cuts, machine, "float64", "sgd", loss=False)
        terms = {t.what: t.seconds for t in ref.terms}
        for n, (op, c) in enumerate(zip(ops, cuts)):
            got = ck.call("operator_terms", op, (c.batch, c.reduce, c.out), m, WORD)
            for what, hint in HINTS.items():
                ck.close(f"{name}, Linear {n} {op} cut {(c.batch, c.reduce, c.out)}: the "
                         f"'{what}' superstep", float(dict(got).get(what, 0.0)),
                         terms.get(f"op{n} {what}", 0.0), hint)
        ck.close(f"layout_cost of {name}", ck.call("layout_cost", ops, [
            (c.batch, c.reduce, c.out) for c in cuts], m, WORD), ref.seconds,
            "the sum of every operator's supersteps")


def simple_machine(machine):
    """This machine's file read as the lab's simple machine (its first bandwidth piece)."""
    level, dev = machine.levels[0], machine.device
    return Machine(machine.p, dev.flops.get("float64", max(dev.flops.values())),
                   level.latency_s, 1 / level.bandwidth[0][1], dev.memory_bandwidth)


def measure_step(model, x, y, comm, steps=10):
    """Median seconds of a forward and backward, the slowest rank's."""
    from mpi4py import MPI
    times = []
    for s in range(steps + 1):
        comm.Barrier()
        start = time.perf_counter()
        model.zero_grad()
        loss, caches = model.forward(x, y)
        model.backward(1.0, caches)
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times[1:]))


def measured(ck, comm):
    """Each layout of the MEASURE MLP run on this job's ranks, against hpcnn's price."""
    from hpcnn.parallel.collectives import world
    from hpcnn.parallel.layout import free_layout, layout_mlp
    from hpcnn.plan.cost import strategy_cost, to_cut
    from hpcnn.plan.machine import MACHINES, load, this_machine
    from hpcnn.plan.search import dra_sequences
    (dims, batch), p = MEASURE, comm.Get_size()
    machine = this_machine()
    if machine.p != p:              # a calibrated file of other ranks: the 2-vCPU defaults
        ck.info(f"this machine's file is for p = {machine.p}, not {p}: priced on "
                f"machines/local-2vcpu.toml")
        machine = load(os.path.join(MACHINES, "local-2vcpu.toml"))
    if machine.p != p:
        ck.fail(f"machines/local-2vcpu.toml is for p = {machine.p}, this job has {p} ranks",
                "grade lab 7 on 2 ranks (--np 2)")
    graph, ops = chain_ops(dims, batch)
    options = dict(layouts(p))
    planned = [to_cut(s, p) for s in dra_sequences(graph, p)]
    if planned not in options.values():
        options["planner's choice"] = planned
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((batch, dims[0])), rng.integers(0, dims[-1], batch)
    c, rows = world(), []
    for name, cuts in options.items():
        ck.step(f"measured: {name}")
        model = layout_mlp(dims[0], dims[1:-1], dims[-1], cuts, c, seed=0, dtype=np.float64)
        seconds = measure_step(model, x, y, comm)
        free_layout(model)
        by_hand = ck.call("layout_cost", ops, [(q.batch, q.reduce, q.out) for q in cuts],
                          simple_machine(machine), WORD)
        rows.append({"layout": name, "cuts": str([(q.batch, q.reduce, q.out) for q in cuts]),
                     "measured_s": seconds, "by_hand_s": by_hand,
                     "hpcnn_s": strategy_cost(graph, cuts, machine, "float64", "sgd").seconds,
                     "planner": cuts == planned})
    return rows


def checks(ck, comm, out):
    check_ring(ck)
    for dims, batch, m in CASES:
        check_layouts(ck, dims, batch, m)
    rows = measured(ck, comm)
    if ck.rank == 0:
        from hpcnn.log.results import save_table
        save_table(out, "layouts", rows, attrs={"ranks": comm.Get_size(), "dims": str(MEASURE[0]),
                                                "batch": MEASURE[1]})
        for r in rows:
            ck.info(f"{r['layout']:>24}: measured {r['measured_s'] * 1e3:7.2f} ms, hpcnn's price "
                    f"{r['hpcnn_s'] * 1e3:7.2f} ms, yours on this machine's numbers "
                    f"{r['by_hand_s'] * 1e3:7.2f} ms" + ("  <- the planner's choice"
                                                          if r["planner"] else ""))


if __name__ == "__main__":
    sys.exit(labkit.grade_main(__file__, TITLE, ranks=2, timeout=120, hang_hint=HANG_HINT))
