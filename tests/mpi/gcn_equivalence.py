"""The distributed GCN equals the serial one (float64, 1e-10), and its halo bytes are the partition's.

    mpiexec -n N python -m mpi4py tests/mpi/gcn_equivalence.py TMPDIR

Blocks: a 2-layer GCN on the karate club and on a 300-node SBM, contiguous rows and a scattered
part vector: the loss (weighted over ranks as the training loop weighs it), every parameter
gradient (summed over ranks) and each rank's rows of the input gradient equal the one-process
model's; the bytes each rank sends in one forward+backward equal its send and ghost rows times
the layer widths, and summed over ranks twice the partition's send-list total (computed from the
whole matrix, without communication). Training: ``hpcnn train --model=gcn`` on N ranks gives
the serial run's losses, test metrics and final parameters, and its step-3 checkpoint resumed on
one process ends at the same parameters; so do ``--partition=random`` and ``spectral`` on the
2000-node SBM, whose /plan records the partition a rank-0 recomputation gives (part sizes, halo
rows, edge cut; spectral cutting fewer edges than contiguous blocks), and a partition of unequal
parts (a stand-in partitioner's) gives the serial run too.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.graph import RowPartition, build_halo
from hpcnn.graph.rows import halo_sizes
from hpcnn.graph.partitioners import random_partition, spectral_bisection
from hpcnn.graph.nodes import graph_data
from hpcnn.log import read_run
from hpcnn.nn.gcn import GraphOperator, gcn
from hpcnn.parallel.collectives import Communicator
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp = sys.argv[1]
TOL = 1e-10
HIDDEN = (8,)


def loss_and_grads(model, x, y, n_nodes):
    """Loss and its gradients of this rank's rows, scaled as the training step scales them."""
    model.zero_grad()
    share = x.shape[0] / n_nodes
    loss, caches = model.forward(x, y)
    dx = model.backward(share, caches)
    return loss * share, [q.grad.copy() for q in model.params], dx


def check_blocks(data, part, label):
    n = data.n_nodes
    x, y = data.features, data.targets()
    serial = gcn(GraphOperator.from_global(data.a_hat, dtype="float64"), x.shape[1], HIDDEN, data.n_classes,
                 n_train=data.train.size, n_nodes=n, seed=3, dtype="float64")
    loss_s, grads_s, dx_s = loss_and_grads(serial, x, y, n)

    comm = Communicator(world, name="graph")
    op = GraphOperator.from_global(data.a_hat, part, comm, "float64")
    dist = gcn(op, x.shape[1], HIDDEN, data.n_classes, n_train=data.train.size, n_nodes=n,
               seed=3, dtype="float64")
    rows = part.rows(rank)
    before = comm.stats.bytes_sent
    loss_d, grads_d, dx_d = loss_and_grads(dist, x[rows], y[rows], n)
    sent = comm.stats.bytes_sent - before

    loss_d = world.allreduce(loss_d)
    assert abs(loss_d - loss_s) <= TOL * max(1.0, abs(loss_s)), (label, loss_d, loss_s)
    for q, gd, gs in zip(serial.params, grads_d, grads_s):
        total = np.empty_like(gd)
        world.Allreduce(gd, total)
        assert np.abs(total - gs).max() <= TOL * max(1.0, np.abs(gs).max()), (label, q.name)
    assert np.abs(dx_d - dx_s[rows]).max() <= TOL * max(1.0, np.abs(dx_s).max()), label

    widths = [b.n_out for b in dist.blocks if hasattr(b, "op")]
    mine = (int(op.halo.send_counts.sum()) + op.n_ghost) * sum(widths) * 8
    assert sent == mine, (label, sent, mine)
    formula = sum(int(build_halo(data.a_hat, part, r).send_counts.sum()) for r in range(p))
    assert world.allreduce(sent) == 2 * formula * sum(widths) * 8, label
    assert sum(b.spec((rows.size, b.n_in)).comm_bytes for b in dist.blocks
               if hasattr(b, "op")) == mine, label
    return formula


karate = graph_data("karate", seed=1)
assert check_blocks(karate, RowPartition.contiguous(karate.n_nodes, p), "karate") > 0
scattered = RowPartition.from_parts(np.arange(karate.n_nodes) % p, p)   # rows dealt round-robin
check_blocks(karate, scattered, "karate-scattered")

sbm = graph_data("sbm", seed=0)
sub = np.arange(300)                                  # a smaller graph: the first 300 nodes
small = type(sbm)("sbm300", sbm.a_hat[sub][:, sub].tocsr(), sbm.features[sub], sbm.labels[sub],
                  sbm.train[sbm.train < 300], np.setdiff1d(sub, sbm.train), sbm.n_classes)
check_blocks(small, RowPartition.contiguous(300, p), "sbm300")


def run(comm, name, *extra, dataset="karate"):
    cfg = parse_overrides([f"--log={os.path.join(tmp, name)}", "--progress=false",
                           "--dtype=float64", "--model=gcn", f"--dataset={dataset}", "--hidden=8",
                           "--steps=6", "--eval_interval=3", "--log_interval=2", "--lr=0.02",
                           "--clip=1", f"--dp={1 if comm is None else p}", *extra])
    return train(cfg, comm=comm)


par = run(world, "par.h5", "--checkpoint=" + os.path.join(tmp, "ck{step}.h5"),
          "--checkpoint_every=3")
ser = run(None, f"ser{rank}.h5")
resumed = run(None, f"res{rank}.h5", "--resume=" + os.path.join(tmp, "ck3.h5"))  # p ranks -> 1
assert abs(par["loss"] - ser["loss"]) <= TOL, (par["loss"], ser["loss"])
assert par["test_acc"] == ser["test_acc"] and abs(par["test_loss"] - ser["test_loss"]) <= TOL
for a, b, c in zip(par["model"].params, ser["model"].params, resumed["model"].params):
    assert np.abs(a.data - b.data).max() <= TOL and np.abs(c.data - b.data).max() <= TOL, a.name
if rank == 0:
    log_p, log_s = read_run(os.path.join(tmp, "par.h5")), read_run(os.path.join(tmp, "ser0.h5"))
    np.testing.assert_allclose(log_p.metrics["loss"], log_s.metrics["loss"], rtol=0, atol=TOL)
    layout = log_p.plan["operator_layout"]
    assert layout["ranks"] == p and sum(layout["rows_per_rank"]) == karate.n_nodes, layout
    assert layout["halo_bytes_per_layer"] == [sum(layout["halo_rows_per_rank"]) * w * 8
                                              for w in (8, karate.n_classes)], layout


def pattern(a_hat):
    """The adjacency pattern the partitioners see: Â without its diagonal."""
    a = a_hat.tolil()
    a.setdiag(0)
    a = a.tocsr()
    a.eliminate_zeros()
    return a


# --partition: only who computes which rows changes; the 2000-node SBM takes the spectral
# bisection through Lanczos (more than partitioners.DENSE nodes)
ser = run(None, f"sbm-ser{rank}.h5", dataset="sbm")
from hpcnn.graph.partitioners import metis_available, partition  # noqa: E402
for kind in ("random", "spectral") + (("metis",) if metis_available() else ()):
    par = run(world, f"sbm-{kind}.h5", f"--partition={kind}", dataset="sbm")
    assert abs(par["loss"] - ser["loss"]) <= TOL, (kind, par["loss"], ser["loss"])
    assert par["test_acc"] == ser["test_acc"], (kind, par["test_acc"], ser["test_acc"])
    assert abs(par["test_loss"] - ser["test_loss"]) <= TOL, kind
    for a, b in zip(par["model"].params, ser["model"].params):
        assert np.abs(a.data - b.data).max() <= TOL, (kind, a.name)
    if rank == 0:
        log_p = read_run(os.path.join(tmp, f"sbm-{kind}.h5"))
        log_s = read_run(os.path.join(tmp, "sbm-ser0.h5"))
        np.testing.assert_allclose(log_p.metrics["loss"], log_s.metrics["loss"], rtol=0, atol=TOL)
        layout = log_p.plan["operator_layout"]
        expected = (random_partition(sbm.n_nodes, p, seed=0) if kind == "random" else
                    spectral_bisection(pattern(sbm.a_hat), p, seed=0) if kind == "spectral" else
                    partition(pattern(sbm.a_hat), p, kind, seed=0))
        assert layout["graph_partition"] == kind and layout["partition_seconds"] > 0, layout
        assert layout["rows_per_rank"] == expected.counts().tolist(), (kind, layout)
        assert layout["halo_rows_per_rank"] == halo_sizes(sbm.a_hat, expected).tolist(), kind
        assert layout["edge_cut"] == expected.edge_cut(sbm.a_hat), kind
        contiguous = RowPartition.contiguous(sbm.n_nodes, p).edge_cut(sbm.a_hat)
        if kind != "random":                  # the SBM's numbering is random: these cut less
            assert layout["edge_cut"] < contiguous, (layout["edge_cut"], contiguous)

# unequal parts (as METIS returns, within its tolerance): the data-parallel shares follow them;
# the partitioner is replaced by one that gives rank 0 ten more karate rows than the others
import hpcnn.graph.partitioners as partitioners  # noqa: E402
owners = np.repeat(np.arange(p), RowPartition.contiguous(karate.n_nodes - 10, p).counts())
owners = np.concatenate([np.zeros(10, dtype=np.int64), owners])[::-1].copy()   # scattered
partitioners.partition = lambda a, parts, method, seed=0: RowPartition.from_parts(owners, parts)
uneven = run(world, "uneven.h5", "--partition=random")
ser = run(None, f"ser-again{rank}.h5")
assert abs(uneven["loss"] - ser["loss"]) <= TOL and uneven["test_acc"] == ser["test_acc"]
for a, b in zip(uneven["model"].params, ser["model"].params):
    assert np.abs(a.data - b.data).max() <= TOL, ("uneven", a.name)
if rank == 0:
    layout = read_run(os.path.join(tmp, "uneven.h5")).plan["operator_layout"]
    assert layout["rows_per_rank"] == np.bincount(owners).tolist(), layout
    print(f"OK on {p} ranks")
