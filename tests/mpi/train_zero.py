"""--zero=1, 2 and 3 equal --zero=0 (float64, 1e-10): losses, parameters and the whole
optimizer state (read back from each run's final checkpoint), on every layout this world size
allows (zero 3: not with a pipeline); each rank's optimizer holds 1/dp of the slots, at zero 2
1/dp of the gradient, at zero 3 1/dp of all three plus at most two blocks gathered (the run
log's account); a checkpoint saved at one stage resumes at another as the uninterrupted run.

    mpiexec -n N python -m mpi4py tests/mpi/train_zero.py TMPDIR [--every]
"""
import os
import sys

import h5py
import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp = sys.argv[1]
every = "--every" in sys.argv[2:]        # every case at every size (make test-long)
GPT = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=12",
       "--batch_size=12"]
MLP = ["--model=mlp", "--hidden=16,24", "--batch_size=24"]


def run(name, *args):
    """A 10-step float64 run that checkpoints at its end; returns (summary, log, checkpoint)."""
    log, ck = os.path.join(tmp, name + ".h5"), os.path.join(tmp, name + ".ckpt.h5")
    cfg = parse_overrides([f"--log={log}", f"--checkpoint={ck}", "--progress=false",
                           "--dtype=float64", "--steps=10", "--eval_interval=5",
                           "--log_interval=5", *args])
    return train(cfg, comm=world), log, ck


def arrays(ck):
    """Every parameter and optimizer slot of a checkpoint, by path."""
    out = {}
    with h5py.File(ck, "r") as f:
        f.visititems(lambda k, v: out.__setitem__(k, v[...]) if isinstance(v, h5py.Dataset)
                     else None)
    return out


def same(name, a, b):
    """Rank 0: the two runs' losses and every checkpointed array within 1e-10."""
    if rank:
        return
    la, lb = read_run(a[1]).metrics["loss"], read_run(b[1]).metrics["loss"]
    assert np.max(np.abs(la - lb)) < 1e-10, (name, la - lb)
    xa, xb = arrays(a[2]), arrays(b[2])
    assert sorted(xa) == sorted(xb) and any("/m" in k or "momentum" in k for k in xa), name
    for k in xa:
        if k.startswith(("params/", "optim/")):
            assert np.max(np.abs(xa[k] - xb[k])) < 1e-10, (name, k, np.max(np.abs(xa[k] - xb[k])))


layouts = {"mlp-adamw": [*MLP, f"--dp={p}"],
           "mlp-sgd-clip-accum": [*MLP, f"--dp={p}", "--optimizer=sgd", "--lr=0.05",
                                  "--clip=0.5", "--grad_accum=3", "--weight_decay=0.01"],
           "mlp-speeds-weighted": [*MLP, f"--dp={p}", "--balance=proportional",
                                   "--speeds=" + ",".join(str(i + 1) for i in range(p))],
           "gpt": [*GPT, f"--dp={p}", "--clip=1.0"],
           "gpt-remat": [*GPT, f"--dp={p}", "--remat=sqrt"],
           "gpt-shm": [*GPT, f"--dp={p}", "--allreduce=shm"],
           "gcn": ["--model=gcn", f"--dp={p}"],
           # the two-level collectives over nodes (HPCNN_NODES: emulated; one node: the library)
           "mlp-hier": [*MLP, f"--dp={p}", "--allreduce=hier", "--bucket_mb=0.01"]}
if p == 3 and not every:     # (uneven parts: three cases; the rest ran at 2 ranks)
    layouts = {k: layouts[k] for k in ("mlp-sgd-clip-accum", "mlp-speeds-weighted", "gpt")}
if p == 4:      # the layouts that need 4 ranks, and (unless every) one at dp = 4
    layouts = {**(layouts if every else {"mlp-adamw": layouts["mlp-adamw"],
                                         "mlp-hier": layouts["mlp-hier"]}),
               "gpt-tp2": [*GPT, "--dp=2", "--tp=2"],
               "gpt-pp2-1f1b": [*GPT, "--dp=2", "--pp=2", "--n_layers=2",
                                "--microbatches=2", "--schedule=1f1b"],
               "gpt-pp2-zbh1": [*GPT, "--dp=2", "--pp=2", "--n_layers=2",
                                "--microbatches=2", "--schedule=zb_h1"]}

if os.environ.get("HPCNN_NODES"):   # emulated nodes: no shared window across them
    layouts.pop("gpt-shm", None)


def plans(*runs):
    return [read_run(r[1]).plan for r in runs]


for name, args in layouts.items():
    zero0, zero1 = run(f"{name}-z0", *args), run(f"{name}-z1", *args, "--zero=1")
    same(name, zero0, zero1)
    zero2 = None if "--allreduce=shm" in args else run(f"{name}-z2", *args, "--zero=2")
    if zero2 is not None:
        same(name + " zero 2", zero0, zero2)
    zero3 = None if zero2 is None or "--pp=2" in args else run(f"{name}-z3", *args, "--zero=3")
    if zero3 is not None:
        same(name + " zero 3", zero0, zero3)
    if rank == 0:             # each rank's optimizer: its part of the slots, plus its scratch
        p0, p1 = plans(zero0, zero1)
        held = [p["optimizer_bytes_per_rank"] for p in (p0, p1)]
        dp = int(p1["dp"])
        assert max(held[1]) <= max(held[0]) / dp * 1.5, (name, held)
        assert sum(held[1]) < sum(held[0]), (name, held)
        assert p1["grad_bytes_per_rank"] == p0["grad_bytes_per_rank"], name
    if rank == 0 and zero2 is not None:       # stage 2: the gradient's parts, 1/dp each
        p2, = plans(zero2)
        whole, parts = max(p0["grad_bytes_per_rank"]), p2["grad_bytes_per_rank"]
        if dp == p:           # (the parts of every dp group: one group when dp is the world)
            assert 0 <= whole - sum(parts) <= 2 * 8, (name, whole, parts)  # less the sentinels
        assert max(parts) <= whole / dp + 2 * 8, (name, whole, parts)
        assert max(p2["grad_buffer_peak_bytes_per_rank"]) <= whole, name
    if rank == 0 and zero3 is not None:       # stage 3: the parameters' parts, 1/dp each, the
        p3, = plans(zero3)                    # gradients' and slots' as at stages 2 and 1
        whole, parts = max(p0["param_bytes_per_rank"]), p3["param_bytes_per_rank"]
        if dp == p:
            assert sum(parts) == whole, (name, whole, parts)
        assert max(parts) <= whole / dp + 8, (name, whole, parts)
        assert p3["grad_bytes_per_rank"] == p2["grad_bytes_per_rank"], name
        assert p3["optimizer_bytes_per_rank"] == p1["optimizer_bytes_per_rank"], name
        gathered = max(p3["param_gather_peak_bytes_per_rank"])   # at most two blocks at once
        assert 0 < gathered <= 2 * 8 * max(sum(q.size for q in b.params)
                                           for b in zero3[0]["model"].blocks), (name, gathered)

# the planner's price of what a rank holds (parameters, gradients or their part and, at zero 2
# and 3, the reduction's buckets, optimizer state and its scratch: hpcnn.plan.hybrid.
# _stage_memory less the activations) is the runs' account within 5 %, at each stage
if rank == 0 and "gpt" in layouts:
    from hpcnn import datasets
    from hpcnn.config import padded_vocab
    from hpcnn.plan import hybrid
    cfg = parse_overrides([*GPT, f"--dp={p}"]).resolved()
    model = hybrid.Transformer(cfg.n_layers, cfg.dim, cfg.n_heads, seq=cfg.block_size,
                               vocab=padded_vocab(datasets.for_config(cfg).vocab, cfg),
                               batch=cfg.batch_size, dtype="float64")
    for zero in (0, 1, 2, 3):
        plan = read_run(os.path.join(tmp, f"gpt-z{zero}.h5")).plan
        held = max(map(sum, zip(*(plan[k] for k in ("param_bytes_per_rank", "grad_bytes_per_rank",
                                                     "optimizer_bytes_per_rank",
                                                     "param_gather_peak_bytes_per_rank",
                                                     "grad_buffer_peak_bytes_per_rank")))))
        lay = hybrid.Layout(p, 1, 1, 1, zero=zero)
        priced = (hybrid._stage_memory(model, lay, 0, cfg.n_layers, True, "adamw")
                  - hybrid._held_bytes(model, lay, 0, cfg.n_layers))
        assert abs(priced / held - 1) < 0.05, (zero, priced, held)

# a checkpoint moves between zero stages: a 20-step run at zero 1 saves at step 10; resumed
# there at zero 0, its last 10 steps are the straight run's; likewise 0 -> 2 and 2 -> 1
def twenty(name, *args):
    log = os.path.join(tmp, name + ".h5")
    train(parse_overrides([f"--log={log}", "--progress=false", "--dtype=float64", "--steps=20",
                           "--eval_interval=0", "--log_interval=5", *MLP, f"--dp={p}", *args]),
          comm=world)
    return log


for first, then in ((1, 0), (0, 2), (2, 1), (3, 0), (0, 3)) if p == 2 or every else ():
    ck = os.path.join(tmp, f"at-{first}-{{step}}.h5")
    whole = twenty(f"whole-{first}", f"--zero={first}", f"--checkpoint={ck}",
                   "--checkpoint_every=10")
    resumed = twenty(f"resumed-{first}", f"--zero={then}", f"--resume={ck.format(step=10)}")
    if rank == 0:
        a, b = read_run(whole).metrics["loss"][10:], read_run(resumed).metrics["loss"]
        assert len(b) == 10 and np.max(np.abs(a - b)) < 1e-10, (first, a - b)
# the buckets stage 2 holds whole, as the planner prices them (hybrid.grad_buffer_params): with
# small buckets, a step holds at least the largest block's gradient and at most three blocks'
# and a bucket each, whether it accumulates micro-batches (each reduced in its backward) or not
if p == 2:
    from hpcnn.plan.hybrid import grad_buffer_params
    deep = [*GPT, "--n_layers=4", "--dp=2", "--zero=2", "--bucket_mb=0.001", "--steps=2",
            "--eval_interval=0", "--progress=false", "--dtype=float64"]
    logs = {accum: os.path.join(tmp, f"buckets-{accum}.h5") for accum in (1, 2)}
    for accum, log in logs.items():
        train(parse_overrides([*deep, f"--log={log}", f"--grad_accum={accum}"]), comm=world)
    if rank == 0:
        peak = {a: max(read_run(log).plan["grad_buffer_peak_bytes_per_rank"])
                for a, log in logs.items()}
        from hpcnn import datasets
        from hpcnn.config import padded_vocab
        cfg = parse_overrides(deep).resolved()
        dim, vocab = cfg.dim, padded_vocab(datasets.for_config(cfg).vocab, cfg)
        params = read_run(log).plan["param_bytes_per_rank"][0] / 8
        block = 12 * dim * dim + 13 * dim        # a transformer block's weights and biases
        assert block > (vocab + cfg.block_size) * dim, "the largest block is a transformer's"
        priced = grad_buffer_params(params, block, 8, False, bucket=0.001 * 2 ** 20)
        assert priced < params and all(block * 8 <= peak[a] <= priced * 8 for a in peak), \
            (peak, block, priced)

# stage 2 on its own: a NaN in rank 1's batch is named on every rank (its part of the reduced
# gradient is not finite), then the next step's parts are finite again; between steps no
# gradient storage is bound
if p == 2:
    from hpcnn.nn import models
    from hpcnn.parallel.collectives import world as communicator
    from hpcnn.parallel.data.sharded import ShardedGradients
    model = models.mlp(8, (16, 16), 4, dtype=np.float64)
    engine = ShardedGradients(model, communicator(), bucket_mb=1e-3)
    x = np.random.default_rng(rank).standard_normal((6, 8))
    y = np.arange(6) % 4
    for step, bad in ((7, rank == 1), (8, False)):
        xs = x.copy()
        if bad:
            xs[0, 3] = np.nan
        engine.zero_grad()
        _, caches = model.forward(xs, y)
        engine.backward(0.5, caches)
        try:
            engine.finish(step)
            assert step == 8, "a NaN gradient was not reported"
        except FloatingPointError as e:
            assert step == 7 and str(e) == "non-finite gradient at step 7 on rank(s) 1", e
        assert all(q.grad_storage() is None for q in model.params), step
    assert all(np.isfinite(f).all() for f in engine.flats)
    engine.release()
if rank == 0:
    print(f"train_zero OK on {p} ranks", flush=True)
