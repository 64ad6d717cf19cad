"""Mixed precision under data parallelism: dp = P at bf16 and fp16 against the serial run at the
same precision (to the precision's tolerance), gradients reduced in fp32 and in the parameters'
16 bits; an fp16 run whose first steps overflow skips the same steps on every rank and as the
serial run, without the non-finite error; the replicas stay identical.

    mpiexec -n 2 python -m mpi4py tests/mpi/train_precision.py TMPDIR
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.config import parse_overrides
from hpcnn.log import read_run
from hpcnn.train import train

world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
tmp = sys.argv[1]
GPT = ["--model=gpt", "--dataset=sonnet", "--n_layers=1", "--dim=32", "--n_heads=4",
       "--block_size=16", "--batch_size=8", "--eval_batches=2", "--steps=6", "--eval_interval=6",
       "--log_interval=2", "--progress=false", "--bucket_mb=0.01"]
# relative tolerance of the parameters (all of them as one vector) and the losses: the sums run
# in another order (in 16 bits with --grad_reduce_dtype=param), which may round a master copy's
# value to a neighbouring 16-bit number, and AdamW turns the rounding noise of a gradient that
# is zero in exact arithmetic (the key bias: the softmax ignores it) into steps of lr
TOL = {"bf16": 1e-2, "fp16": 2e-3}


def cfg(name, *extra):
    return parse_overrides([f"--log={os.path.join(tmp, name)}", *GPT, *extra])


def same_everywhere(model) -> bool:
    """Every rank holds bit-identical parameters."""
    mine = np.concatenate([q.data.astype(np.float64).ravel() for q in model.params])
    everyone = world.allgather(mine)
    return all(np.array_equal(everyone[0], other) for other in everyone)


cases = {"bf16": ["--precision=bf16"],
         "bf16-param": ["--precision=bf16", "--grad_reduce_dtype=param"],
         "fp16": ["--precision=fp16"],
         "fp16-param": ["--precision=fp16", "--grad_reduce_dtype=param"],
         "fp16-overflow": ["--precision=fp16", "--loss_scale_init=1099511627776",
                           "--loss_scale_growth_interval=2"]}
for name, args in cases.items():
    serial = train(cfg(f"{name}-serial.h5", *args), comm=None) if rank == 0 else None
    par = train(cfg(f"{name}-dp.h5", *args, f"--dp={p}"), comm=world)
    assert same_everywhere(par["model"]), name
    if rank == 0:
        tol = TOL[args[0].split("=")[1]]
        a, b = (np.concatenate([q.data.astype(np.float64).ravel() for q in r["model"].params])
                for r in (serial, par))
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(a), (name, np.linalg.norm(a - b))
        s = read_run(os.path.join(tmp, f"{name}-serial.h5")).metrics
        d = read_run(os.path.join(tmp, f"{name}-dp.h5")).metrics
        assert np.abs(s["loss"] - d["loss"]).max() < tol * s["loss"].max(), name
        assert abs(serial["val_loss"] - par["val_loss"]) < tol * serial["val_loss"], name
        if "loss_scale" in s:            # fp16: the same scales and skips (one agreed flag)
            assert np.array_equal(s["loss_scale"], d["loss_scale"]), name
            assert np.array_equal(s["skipped"], d["skipped"]), name
        if name == "fp16-overflow":
            assert d["skipped"][0] == 1 and par["skipped_steps"] >= 1, d["skipped"]

# ZeRO 1, 2 and 3 at 16 bits against zero 0 at the same precision: each master element gets
# the same float32 arithmetic but for the vectorised loops' rounding (a fused multiply-add in
# one, not in another: the parts' cuts move elements between them), so to the precision's
# tolerance, as dp against serial; the same fp16 scales and skips; a checkpoint holds the
# float32 masters and slots assembled over the ranks
def arrays(path):
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda k, v: out.__setitem__(k, v[...]) if isinstance(v, h5py.Dataset)
                     else None)
    return out


def close(a, b, tol) -> bool:
    return np.linalg.norm(np.ravel(a) - np.ravel(b)) <= tol * np.linalg.norm(np.ravel(a)) + 1e-30


for prec in ("bf16", "fp16"):
    runs = {}
    for zero in (0, 1, 2, 3):
        ck = os.path.join(tmp, f"z{zero}-{prec}.ckpt.h5")
        runs[zero] = train(cfg(f"z{zero}-{prec}.h5", f"--precision={prec}", f"--dp={p}",
                               f"--zero={zero}", f"--checkpoint={ck}",
                               "--loss_scale_growth_interval=2"), comm=world)
    if rank == 0:
        tol = TOL[prec]
        m0 = read_run(os.path.join(tmp, f"z0-{prec}.h5")).metrics
        c0 = arrays(os.path.join(tmp, f"z0-{prec}.ckpt.h5"))
        assert any(k.startswith("params/") and v.dtype == np.float32 for k, v in c0.items())
        for zero in (1, 2, 3):
            m = read_run(os.path.join(tmp, f"z{zero}-{prec}.h5")).metrics
            c = arrays(os.path.join(tmp, f"z{zero}-{prec}.ckpt.h5"))
            assert np.abs(m["loss"] - m0["loss"]).max() <= tol * m0["loss"].max(), (prec, zero)
            if "loss_scale" in m0:
                assert np.array_equal(m["loss_scale"], m0["loss_scale"]), (prec, zero)
                assert np.array_equal(m["skipped"], m0["skipped"]), (prec, zero)
            assert sorted(c) == sorted(c0), (prec, zero)
            for k in c0:
                if k.startswith(("params/", "optim/")):
                    assert c[k].dtype == c0[k].dtype and close(c0[k], c[k], tol), (prec, zero, k)
            a, b = (np.concatenate([q.data.astype(np.float64).ravel() for q in runs[z]["model"]
                                    .params]) for z in (0, zero))
            assert close(a, b, tol), (prec, zero)
        # the account: 16-bit parameters (each rank its part at zero 3), float32 master copies
        # and slots (each rank its part at zero >= 1)
        plans = [read_run(os.path.join(tmp, f"z{z}-{prec}.h5")).plan for z in range(4)]
        n = sum(q.size for q in runs[0]["model"].params)
        assert plans[0]["param_bytes_per_rank"] == [2 * n] * p, prec
        assert plans[0]["master_bytes_per_rank"] == [4 * n] * p, prec
        assert sum(plans[3]["param_bytes_per_rank"]) == 2 * n, prec
        for z in (1, 2, 3):
            assert sum(plans[z]["master_bytes_per_rank"]) == 4 * n, (prec, z)
            assert max(plans[z]["master_bytes_per_rank"]) <= 4 * (n // p + 1), (prec, z)

# the float64 twin of the sharded master copy: the same machinery (segments' master copies,
# their write-down and gather, the static loss scale 2**10, unscaling, the skip check) with
# float64 storage equals the plain float64 zero 0 run to 1e-10 at every stage
from types import MappingProxyType
from hpcnn.nn import precision

plain = train(cfg("twin-plain.h5", "--dtype=float64", f"--dp={p}"), comm=world)
formats = precision.FORMATS
precision.FORMATS = MappingProxyType({"fp32": None, "bf16": None,
                                      "fp16": precision.Format("float64", "float64", True)})
for zero in (1, 2, 3):
    twin = train(cfg(f"twin-z{zero}.h5", "--precision=fp16", "--loss_scale_init=1024",
                     "--loss_scale_growth_interval=100", f"--dp={p}", f"--zero={zero}"),
                 comm=world)
    for a, b in zip(plain["model"].params, twin["model"].params):
        assert b.data.dtype == np.float64 and np.abs(a.data - b.data).max() < 1e-10, (zero, a.name)
    if rank == 0:
        la = read_run(os.path.join(tmp, "twin-plain.h5")).metrics["loss"]
        lb = read_run(os.path.join(tmp, f"twin-z{zero}.h5")).metrics["loss"]
        assert np.abs(la - lb).max() < 1e-10, zero
precision.FORMATS = formats

# resume across stages, precisions and data-parallel sizes: saved at zero 3, dp = P, bf16 and
# resumed at zero 0, dp = P/2, fp32 (P = 2: serial), and the reverse; the losses go on as the
# uninterrupted run's within bf16's tolerance
half = max(1, p // 2)
sub = world.Split(0 if rank < half else MPI.UNDEFINED)
on_half = (sub if half > 1 else None) if rank < half else False     # False: not in it
big = ([f"--dp={p}", "--zero=3", "--precision=bf16"], world)
small = ([f"--dp={half}"], on_half)
for (first, comm_a), (then, comm_b) in ((big, small), (small, big)):
    tag = "-".join(a.split("=")[1] for a in first)
    ck = os.path.join(tmp, f"mid-{tag}-{{step}}.h5")
    base = [a for a in GPT if not a.startswith(("--steps", "--eval_interval", "--log_interval"))]
    base += ["--steps=12", "--eval_interval=0", "--log_interval=1"]
    whole, resumed = os.path.join(tmp, f"whole-{tag}.h5"), os.path.join(tmp, f"resumed-{tag}.h5")
    if comm_a is not False:
        train(parse_overrides([f"--log={whole}", *base, *first, f"--checkpoint={ck}",
                               "--checkpoint_every=6"]), comm=comm_a)
    world.Barrier()
    if comm_b is not False:
        train(parse_overrides([f"--log={resumed}", *base, *then,
                               f"--resume={ck.format(step=6)}"]), comm=comm_b)
    world.Barrier()
    if rank == 0:
        a, b = read_run(whole).metrics["loss"][6:], read_run(resumed).metrics["loss"]
        assert len(b) == 6 and np.abs(a - b).max() < 0.05 * a.max(), (tag, a, b)
if sub != MPI.COMM_NULL:
    sub.Free()

world.Barrier()
if rank == 0:
    print(f"train_precision OK on {p} ranks")
