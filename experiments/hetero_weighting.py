"""Heterogeneous replicas: equal vs proportional batch shares, uniform vs weighted gradients.

Reproduces on one machine the claim of Moreno-Álvarez, Paoletti, Rico-Gallego, Haut,
"Heterogeneous gradient computing optimization for scalable deep neural networks"
(J. Supercomputing 2022): giving each replica a batch share proportional to its speed equalises
the step time, and weighting each replica's gradient by its share (b_i/B) makes the update the
exact full-batch gradient, which is at least as accurate as the plain mean of the replicas'
gradients used by earlier static balancing.

The last rank is slowed by an EMULATED factor r (extra time proportional to its real compute,
see hpcnn.parallel.data.hetero.Slowdown). Arms: equal shares; proportional + uniform mean;
proportional + weighted. The proportional arms measure the replicas online (no fixed speeds):
every 5 steps the balancer refits each replica's compute time as fixed + per-sample cost and
takes the shares that minimise the slowest predicted time (hpcnn.parallel.data.hetero.Balancer).
Until this version it balanced by measured samples/s, which a step's fixed part biases against
a replica with a small share. Each (shard layout, r, arm, seed) is a full training run of an MLP
on digits with its own HDF5 log under runs/hetero_weighting/; the summary table goes to
runs/hetero_weighting/results.h5 (table "runs"), and the serial large-batch reference of each seed
to table "serial". Besides time, accuracy and loss, each run records the slow replica's share
(mean after the first rebalance, and final) and the spread of the replicas' median compute
times over the second half of the run, (max - min) / max, from the log's per-rank rows. Plot
with analysis/hetero_weighting.py.

What changed with the fixed + per-sample balancer (docs/figures/hetero_weighting_p2.png, 3 seeds,
2-core machine shared with other jobs): the slow replica ends with 24 % of the batch at r = 2 and
5.5 % at r = 4 (time proportional to the share would give 33 % and 20 %: this MLP's fixed part
is large), the replicas' compute times 2.7 % apart (median); an epoch at r = 4 took 31 ms
(contiguous) and 27 ms (skewed) with the weighted arm, 46 and 29 ms in the previous figure,
64-66 ms with equal shares in both. The smaller slow share makes each of its samples weigh more
in the uniform mean: its final loss at r = 4 is 0.005 and 0.004 (0.004 in the previous figure;
serial 0.002). On 4 ranks sharing 2 cores the wait for a core is a fixed part of every step and
the slow replica gets the minimum share (docs/figures/hetero_weighting_p4.png).

    mpiexec -n 2 python -m mpi4py experiments/hetero_weighting.py --seeds=3
    mpiexec -n 4 python -m mpi4py experiments/hetero_weighting.py --factors=1,2,4 --seeds=3
"""
import os
import time

import numpy as np
from mpi4py import MPI

from hpcnn import scripts  # noqa: E402
from hpcnn.config import TrainConfig  # noqa: E402
from hpcnn.datasets import steps_per_epoch  # noqa: E402
from hpcnn.log import read_run  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.train import train  # noqa: E402

ARMS = {"equal": dict(balance="equal", combine="weighted"),
        "prop-uniform": dict(balance="proportional", combine="uniform"),
        "prop-weighted": dict(balance="proportional", combine="weighted")}


def base_config(args, seed, out, name):
    # MLP wide enough that a step is compute-bound (~5 ms on one core), so that the emulated
    # slowdown, not MPI latency, decides the step time.
    return TrainConfig(model="mlp", dataset="digits", hidden=(512, 512), batch_size=args.batch,
                       epochs=args.epochs, lr=args.lr, seed=seed, eval_interval=0,
                       log=os.path.join(out, name + ".h5"), log_interval=10, progress=False,
                       rebalance_every=args.rebalance_every, allreduce=args.allreduce)


def per_epoch_time(log_path, batch):
    m = read_run(log_path).metrics
    spe = steps_per_epoch(1437, batch)
    return float(np.median(m["step_time"]) * spe), float(np.sum(m["step_time"]) / (len(m["step_time"]) / spe))


def balance_summary(log_path, batch):
    """(slow rank's mean share after the first rebalance, its final share, both / batch;
    spread (max - min) / max of the ranks' median compute seconds over the run's second half)."""
    run = read_run(log_path)
    hist = run.plan.get("shares_history", [])
    shares = [h[1][-1] / batch for h in hist]
    mean = float(np.mean(shares[1:])) if len(shares) > 1 else shares[0]
    r = run.ranks
    late = r["step"] >= r["step"].max() / 2
    med = [float(np.median(r["compute_s"][late & (r["rank"] == k)])) for k in np.unique(r["rank"])]
    return mean, shares[-1], (max(med) - min(med)) / max(med)


def main(argv=None):
    ap = scripts.parser(__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--factors", default="1,2,4")
    ap.add_argument("--shards", default="contiguous,skewed")
    ap.add_argument("--epochs", type=float, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rebalance-every", type=int, default=5)
    ap.add_argument("--allreduce", default="mpi")
    ap.add_argument("--slowdown-mode", default="sleep")
    ap.add_argument("--out", default="runs/hetero_weighting")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    if p < 2:
        scripts.refuse("run under mpiexec with 2 or more ranks")
    factors = [float(f) for f in args.factors.split(",")]
    os.makedirs(args.out, exist_ok=True)
    serial_rows, rows, serial_params = [], [], {}
    for shard in args.shards.split(","):
        for seed in range(args.seeds):
            name = f"serial-{shard}-s{seed}"
            if rank == 0:    # the serial large-batch reference (same global batches)
                cfg = base_config(args, seed, args.out, name)
                cfg.shard = shard
                r = train(cfg, comm=None)
                serial_params[(shard, seed)] = [q.data.copy() for q in r["model"].params]
                serial_rows.append({"shard": shard, "seed": seed, "test_acc": r["test_acc"],
                                    "final_loss": r["loss"]})
            world.Barrier()
            for f in factors:
                for arm, opts in ARMS.items():
                    name = f"{shard}-r{f:g}-{arm}-s{seed}"
                    cfg = base_config(args, seed, args.out, name)
                    cfg.shard, cfg.dp = shard, p
                    cfg.slowdown = f"{p - 1}:{f}" if f != 1 else ""
                    cfg.slowdown_mode = args.slowdown_mode
                    for k, v in opts.items():
                        setattr(cfg, k, v)
                    t = time.perf_counter()
                    r = train(cfg, comm=world)
                    wall = time.perf_counter() - t
                    if rank == 0:
                        med, mean = per_epoch_time(cfg.log, args.batch)
                        ref = serial_params[(shard, seed)]
                        diff = max(float(np.max(np.abs(a.data - b))) for a, b in zip(r["model"].params, ref))
                        slow_share, slow_final, spread = balance_summary(cfg.log, args.batch)
                        rows.append({"shard": shard, "factor": f, "arm": arm, "seed": seed,
                                     "epoch_time_s": med, "epoch_time_mean_s": mean, "wall_s": wall,
                                     "test_acc": r["test_acc"], "final_loss": r["loss"],
                                     "max_param_diff_vs_serial": diff, "slow_rank_share": slow_share,
                                     "slow_rank_share_final": slow_final, "compute_spread": spread})
                        print(f"{name:32s} epoch {med * 1e3:7.1f} ms  acc {r['test_acc']:.4f}  "
                              f"loss {r['loss']:.4f}  |dtheta| vs serial {diff:.2e}  "
                              f"slow share {slow_share:.3f} (final {slow_final:.3f})  "
                              f"compute spread {spread:.1%}", flush=True)
    if rank == 0:
        path = os.path.join(args.out, "results.h5")
        attrs = {"ranks": p, "emulated_slowdown_mode": args.slowdown_mode, "batch": args.batch,
                 "epochs": args.epochs, "model": "mlp 64-512-512-10", "slowed_rank": p - 1,
                 "rebalance_every": args.rebalance_every,
                 "balancer": "online fixed + per-sample time model, min-max shares"}
        save_table(path, "runs", rows, attrs)
        save_table(path, "serial", serial_rows, attrs)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
