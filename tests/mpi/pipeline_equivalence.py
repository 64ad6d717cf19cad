"""Pipeline parallelism against the serial run of the same global batches (float64, 1e-10).

    mpiexec -n 2 python -m mpi4py tests/mpi/pipeline_equivalence.py
    mpiexec -n 4 python -m mpi4py tests/mpi/pipeline_equivalence.py
    mpiexec -n 3 python -m mpi4py tests/mpi/pipeline_equivalence.py zb_h1,zb_v

pp = world size. For an MLP on digits (7 blocks) and a small GPT on the fallback text (8 blocks),
every schedule (GPipe, 1F1B, ZB-H1, and with 2 stages per rank where the block count allows:
interleaved where M allows, ZB-V in its V placement), or those named in the argument, M in
{1, 2, 4} micro-batches (uneven micro-batch sizes: the global batch does not divide by 4),
uneven stage layouts: after several SGD steps every local parameter and every loss equals the
serial run. Also: one event per instruction, compute events complete, micro-batches in flight
as the simulator predicts, and the first stage holds M micro-batches in flight under GPipe
against min(S, M) under 1F1B.
"""
import sys

import numpy as np
from mpi4py import MPI

from hpcnn import datasets as data
from hpcnn.schedule.ops import PIPELINE
from hpcnn.nn import models
from hpcnn.nn.optim import SGD
from hpcnn.engine import pipelined as pipeline
from hpcnn.schedule import pipeline as schedules
from hpcnn.parallel.collectives import Communicator

world = MPI.COMM_WORLD
r, P = world.Get_rank(), world.Get_size()
pp = Communicator(world, name="pp")
TOL, STEPS, LR = 1e-10, 3, 0.05

digits = data.digits()
text = data.shakespeare(fallback=True)
BATCH = {"mlp": 10, "gpt": 6}                  # 4 micro-batches: sizes 3,3,2,2 and 2,2,1,1
LAYOUTS = {                                    # (one stage per rank, two stages per rank)
    ("mlp", 2): (["2|5", None], "1|3|2|1"),
    ("mlp", 3): (["2|3|2"], "1|1|2|1|1|1"),    # odd pp: 3 stages, or 6 in a V
    ("mlp", 4): (["1|3|2|1"], None),           # 7 blocks < 8 stages: no interleaving, no V
    ("gpt", 2): (["5|3"], "2|1|3|2"),
    ("gpt", 3): ([None], "1|2|1|1|2|1"),
    ("gpt", 4): (["3|2|2|1", None], "1|1|1|1|1|1|1|1"),
}
NAMES = sys.argv[1].split(",") if len(sys.argv) > 1 else list(schedules.SCHEDULES)


def make(kind):
    if kind == "mlp":
        return models.mlp(64, (32, 32, 32), 10, seed=3, dtype=np.float64)
    return models.gpt(text.vocab, 8, 5, 16, 2, dropout=0.0, seed=3, dtype=np.float64)


def batch(kind, step):
    if kind == "mlp":
        idx = data.batch_indices(len(digits.y_train), BATCH[kind], step, seed=1)
        return digits.x_train[idx].astype(np.float64), digits.y_train[idx]
    return data.text_batch(text.train, BATCH[kind], 8, step, seed=1)


def serial(kind):
    """The reference: one process, the whole global batch, the mean loss; params and losses."""
    model = make(kind)
    opt = SGD(model.params, momentum=0.9, weight_decay=1e-3)
    losses = []
    for s in range(STEPS):
        x, y = batch(kind, s)
        model.zero_grad()
        loss, caches = model.forward(x, y)
        model.backward(1.0, caches, need_dx=False)
        opt.step(LR)
        losses.append(loss)
    return model, losses


def check_events(out, lst, name):
    """One event per instruction, in order, with t_start <= t_end; every compute one recorded."""
    ev = out["events"]
    assert [(k, mb) for _, k, mb, _, _ in ev] == [(i.kind, i.mb) for i in lst], name
    assert all(rk == r and 0 <= a <= b for rk, _, _, a, b in ev), name
    n_compute = sum(i.kind in PIPELINE for i in lst)
    assert sum(k in PIPELINE for _, k, _, _, _ in ev) == n_compute > 0, name


def pipelined(kind, name, layout, virtual, M):
    """STEPS pipelined steps; returns (model, losses, last step's output, this rank's list)."""
    model = make(kind)
    opt, losses, out = None, [], None
    for s in range(STEPS):
        x, y = batch(kind, s)
        out = pipeline.train_step(name, model, pp, x, y, M, layout=layout, virtual=virtual)
        if opt is None:                        # only this rank's stages' parameters
            opt = SGD([p for st in out["stages"] for p in st.chain.params], momentum=0.9,
                      weight_decay=1e-3)
        opt.step(LR)
        losses.append(out["loss"])
    n_stages = P * virtual
    lst = schedules.SCHEDULES[name](n_stages, M, P)[r]
    return model, losses, out, lst


runs = {}
for kind in ("mlp", "gpt"):
    ref, ref_losses = serial(kind)
    flat, inter = LAYOUTS[(kind, P)]
    configs = [(n, lay, 1) for n in ("gpipe", "1f1b", "zb_h1") for lay in flat]
    configs += [(n, inter, 2) for n in ("interleaved", "zb_v")] if inter else []
    for name, layout, virtual in [c for c in configs if c[0] in NAMES]:
        for M in (1, 2, 4):
            if name == "interleaved" and M % P:
                continue                       # interleaved needs M % pp == 0
            tag = f"{kind} {name} layout={layout} M={M} on {P} ranks"
            model, losses, out, lst = pipelined(kind, name, layout, virtual, M)
            for st in out["stages"]:           # every local parameter, against the serial run
                a, b = out["ranges"][st.index]
                for p, q in zip(st.chain.params, ref[a:b].params):
                    d = float(np.abs(p.data - q.data).max())
                    assert d < TOL, f"{tag}: {p.name} differs by {d}"
            d = max(abs(u - v) for u, v in zip(losses, ref_losses))
            assert d < TOL, f"{tag}: losses differ by {d}"
            check_events(out, lst, tag)
            split = any(k == "W" for _, k, _, _, _ in out["events"])
            assert split == (name in ("zb_h1", "zb_v")), tag
            assert out["peak_bytes"] > 0, tag
            sim = schedules.simulate(schedules.SCHEDULES[name](P * virtual, M, P), 1, 1, 1)
            assert out["peak_inflight"] == sim.peak_inflight[r], tag
            if r == 0 and virtual == 1:        # stage 0: GPipe holds M, 1F1B at most S
                peak = out["peak_inflight_stage"][0]
                want = M if name == "gpipe" else min(P, M)
                assert peak == want, f"{tag}: {peak} micro-batches in flight, expected {want}"
                assert name == "gpipe" or peak <= P, tag
            runs[name] = runs.get(name, 0) + 1

if r == 0:
    print(f"pipeline_equivalence OK on {P} ranks ({sum(runs.values())} runs: "
          + ", ".join(f"{k} {v}" for k, v in runs.items()) + ")")
