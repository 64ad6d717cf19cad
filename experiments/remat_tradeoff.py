"""Rematerialization and offloading trade-off: time overhead vs peak memory, predicted and measured.

What: for a heterogeneous CNN (conv/pool/linear blocks, digits images) and a GPT (embedding,
transformer blocks, head; Shakespeare characters), the latter also with each layer split into
its attention and MLP residual halves (``gpth``, :func:`hpcnn.nn.residual.split_layers`: twice
the stages, half the size), float32, one process, the script profiles the
chain with measured times and transients (``profile.measure``), builds one rotor table
(``rotor.Solver``) and, for ``--points`` budgets from the least feasible one up to the store-all
peak, runs these arms on the real chain through ``memory.executor.Executor``:

    store_all         every x̄ kept (one point, the reference: overhead 1)
    sqrt              ⌈√blocks⌉ uniform segments, PyTorch's checkpoint_sequential (one point)
    optimal           rotor's optimal rematerialization at the budget (Beaumont et al., TOMS)
    optimal+offload   ``combine.solve`` at the budget for each channel bandwidth

The offload channel is ``OffloadChannel("file", bandwidth=bw)``: a FILE ON LOCAL DISK, THROTTLED
to ``bw`` bytes/s to EMULATE a host link (the worker sleeps so that a copy of n bytes takes at
least n / bw). The default bandwidths are 0.5 and 2 GB/s: at 0.5 GB/s the copy of the GPT's
largest x̄ (9.5 MiB) takes 20 ms, about one transformer block's forward (13 ms) or backward
(19 ms), at 2 GB/s a quarter of it. 4 GB/s is not emulated faithfully here: next to the compute
the file round trip itself reaches only 2.3-2.9 GB/s on this machine (table "channel" records
the achieved rate of each run).

Why: the issue asks what this implementation reaches on the curve of Beaumont, Eyraud-Dubois,
Shilova (NeurIPS 2021), who report offloading removing about a third of the rematerialization
overhead, and 4-6x less activation memory at under 20 % overhead.

Measured per arm: ``--warmup`` untimed steps; one step under ``tracemalloc`` (growth over the step
plus the input's bytes: it includes each block's transient, which the executor's account leaves
out, and which the budget counts); then ``--repeats`` rounds in which every arm, in a shuffled
order, times one step (``chain.zero_grad()`` then ``ex.run(x, y)``) next to one store-all step
(which one first: random). overhead = median over the rounds of arm step / paired store-all step:
the two share the machine's load, which other jobs on these 2 cores change from second to second
(``overhead_unpaired`` = median step / median store-all step is kept too). Every arm's loss and
parameter gradients are checked against store-all (``grad_err``: 0, the same float32 operations
run in the same order). Solver time: ``rotor.Solver`` construction on random heterogeneous chains
of L stages for several slot counts, and one ``combine.solve`` at a mid budget.

    OMP_NUM_THREADS=1 python experiments/remat_tradeoff.py --repeats=9     # ~1.5 min, 2 cores
    OMP_NUM_THREADS=1 python experiments/remat_tradeoff.py --quick --out=/tmp/rt   # < 20 s

(the figures in docs/figures come from the first command). Sizes: the CNN is
``models.cnn(1, 8, channels=(32, 64), hidden=128)`` on 256 digits images (store-all step
~35 ms), the GPT 6 layers, dim 128, 4 heads, block 64, batch 16 of Shakespeare characters
(~115 ms). Predicted times, sizes and transients come from ``profile.measure`` (stage times:
medians of untraced passes; transients: one pass under tracemalloc). Arms that run the same sequence the same way (remat-only sequences are
shared by several budgets) are executed once and reported on each of their rows (``run_id``).

Outputs: runs/remat_tradeoff/results.h5 with tables "tradeoff" (one row per model, arm,
bandwidth, budget), "models" (chain, batch, profile totals), "headline" (the numbers printed at
the end: see :func:`headline`), "solver" (kind, L, slots, seconds) and "channel" (bytes moved and
achieved bandwidth per model and bandwidth). Figures: analysis/remat_tradeoff.py.
"""
import gc
import os
import sys
import time
import tracemalloc
from contextlib import ExitStack
from dataclasses import replace

import numpy as np

from hpcnn import scripts  # noqa: E402
from hpcnn import backend  # noqa: E402
from hpcnn import datasets as data  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.memory import combine, rotor
from hpcnn.schedule import sequences as sequence  # noqa: E402
from hpcnn.memory import profile  # noqa: E402
from hpcnn.memory.executor import Executor  # noqa: E402
from hpcnn.memory.offload import OffloadChannel  # noqa: E402
from hpcnn.memory.simulate import simulate  # noqa: E402
from hpcnn.nn import models  # noqa: E402
from hpcnn.nn.residual import split_layers  # noqa: E402

F32 = np.float32
LIMIT = 1.20            # "under 20 % overhead"
MiB = 2.0 ** 20


def build(name, quick, seed):
    """(chain, x, targets, description): a store-all step of the full sizes takes ~35 ms (CNN)
    and ~115 ms (GPT) on one core, long next to the executor's bookkeeping (< 1 ms); the quick
    ones ~1 ms."""
    if name == "cnn":
        ch, hidden, batch = ((4, 8), 16, 32) if quick else ((32, 64), 128, 256)
        d = data.digits(image=True)
        idx = data.batch_indices(len(d.y_train), batch, 0, seed)
        chain = models.cnn(1, 8, channels=ch, hidden=hidden, seed=seed, dtype=F32)
        return (chain, d.x_train[idx].astype(F32), d.y_train[idx],
                f"cnn conv{list(ch)} hidden {hidden}, digits 8x8, batch {batch}")
    if name in ("gpt", "gpth"):
        layers, dim, block, batch = (2, 32, 16, 4) if quick else (6, 128, 64, 16)
        t = data.shakespeare(max_plays=1 if quick else None)
        x, y = data.text_batch(t.train, batch, block, 0, seed)
        chain = models.gpt(t.vocab, block, layers, dim, 4, seed=seed, dtype=F32)
        if name == "gpth":                         # each layer as two stages (residual halves)
            chain = split_layers(chain)
        return (chain, x, y, f"gpt {layers} layers{' split in halves' if name == 'gpth' else ''}"
                             f" dim {dim} 4 heads block {block}, "
                             f"{t.name} chars, batch {batch}")
    raise SystemExit(f"unknown model {name!r}; expected cnn, gpt or gpth")


def plan(prof, solver, points, bandwidths):
    """The arms to run: dicts with the sequence, its budget and the predictions."""
    n, top = len(prof), solver.top
    quiet = replace(prof, of=0 * prof.of, ob=0 * prof.ob)       # the account has no transients

    def arm(name, bw, budget, seq, t, peak, solve_s):
        sim = simulate(seq, quiet, bandwidth=bw or None, budget=budget if bw else None)
        return {"arm": name, "bandwidth": float(bw), "budget": float(budget), "seq": seq,
                "predicted_time": float(t), "predicted_peak": float(peak),
                "predicted_account_peak": float(sim.peak), "solve_s": solve_s,
                "n_offload": sum(op.kind == "OFF" for op in seq)}
    sqrt_seq = sequence.segments(n)
    sq = simulate(sqrt_seq, prof)
    arms = [arm("store_all", 0, top, sequence.store_all(n), prof.store_all_time, top, 0.0),
            arm("sqrt", 0, sq.peak, sqrt_seq, sq.time, sq.peak, 0.0)]
    for budget in np.linspace(solver.least, top, points):
        t0 = time.perf_counter()
        sol = solver.solve(budget)
        arms.append(arm("optimal", 0, budget, sol.sequence, sol.time, sol.peak,
                        time.perf_counter() - t0))
        for bw in bandwidths:
            t0 = time.perf_counter()
            sol = combine.solve(prof, budget, bw, solver=solver)
            arms.append(arm("optimal+offload", bw, budget, sol.sequence, sol.time, sol.peak,
                            time.perf_counter() - t0))
    return arms


def flat_grads(chain):
    return np.concatenate([p.grad.ravel() for p in chain.params])


def unique_runs(arms, prof, channels, chain):
    """One executor per distinct execution: the same sequence runs the same way whatever the
    budget unless it offloads (then the budget decides when an op waits for the channel)."""
    runs, index = [], {}
    for a in arms:
        off = a["n_offload"] > 0
        key = (tuple(a["seq"]), a["bandwidth"] if off else 0.0, a["budget"] if off else None)
        if key not in index:
            index[key] = len(runs)
            runs.append({"ex": Executor(chain, a["seq"], channel=channels.get(a["bandwidth"]),
                                        prof=prof, budget=a["budget"], need_dx=False),
                         "times": [], "ratios": [], "label": f"{a['arm']} {a['budget']:.0f}"})
        a["run"] = index[key]
    return runs


def execute(chain, x, y, prof, arms, args):
    """Warm-up and one traced step per distinct run, then ``repeats`` rounds in which every run,
    in a shuffled order, times one step next to a store-all step (in a random order; the pair
    shares the machine's load: overhead = median over rounds of run / store-all). Returns the
    channel's statistics per bandwidth."""
    rng = np.random.default_rng(args.seed)

    def step(ex):
        chain.zero_grad()
        t0 = time.perf_counter()
        res = ex.run(x, y)
        return time.perf_counter() - t0, res
    with ExitStack() as stack:
        channels = {bw: stack.enter_context(OffloadChannel("file", bandwidth=bw))
                    for bw in sorted({a["bandwidth"] for a in arms if a["bandwidth"]})}
        runs = unique_runs(arms, prof, channels, chain)          # runs[0] is store-all
        ref = None
        for run in runs:
            for _ in range(args.warmup):
                step(run["ex"])
            chain.zero_grad()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                res = run["ex"].run(x, y)
                grown = tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()
            g = flat_grads(chain)
            ref = ref or (res.loss, g, float(np.abs(g).max()))
            if not np.isclose(res.loss, ref[0], rtol=1e-6, atol=0):
                raise RuntimeError(f"{run['label']}: loss {res.loss} != store-all {ref[0]}")
            run.update(traced=int(grown + x.nbytes), peak=int(res.peak),
                       grad_err=float(np.abs(g - ref[1]).max() / ref[2]))
        sa = []
        gc.collect()
        gc.disable()                     # no cycle collection inside a timed step
        try:
            for _ in range(args.repeats):
                for k in rng.permutation(len(runs)):
                    if rng.random() < 0.5:               # which of the pair goes first: random
                        t_ref, _ = step(runs[0]["ex"])
                        t, res = step(runs[k]["ex"])
                    else:
                        t, res = step(runs[k]["ex"])
                        t_ref, _ = step(runs[0]["ex"])
                    sa.append(t_ref)
                    runs[k]["times"].append(t)
                    runs[k]["ratios"].append(t / t_ref)
                    runs[k]["peak"] = max(runs[k]["peak"], int(res.peak))
                gc.collect()
        finally:
            gc.enable()
        chan = [{"bandwidth": bw, "bytes": ch.stats["bytes_out"] + ch.stats["bytes_in"],
                 "seconds": ch.stats["seconds_out"] + ch.stats["seconds_in"],
                 "transfers": ch.stats["transfers"]} for bw, ch in channels.items()]
    for a in arms:
        a.update(runs[a["run"]])
        a["sa_median"] = float(np.median(sa))
    return chan


def rows_of(model, prof, arms):
    top = arms[0]["predicted_peak"]
    rows = []
    for a in arms:
        t = float(np.median(a["times"]))
        rows.append({
            "model": model, "arm": a["arm"], "bandwidth": a["bandwidth"],
            "budget_bytes": a["budget"], "budget_frac": a["budget"] / top,
            "predicted_time": a["predicted_time"], "measured_time": t,
            "overhead": float(np.median(a["ratios"])),
            "overhead_q25": float(np.percentile(a["ratios"], 25)),
            "overhead_q75": float(np.percentile(a["ratios"], 75)),
            "overhead_unpaired": t / a["sa_median"],
            "predicted_overhead": a["predicted_time"] / prof.store_all_time,
            "predicted_peak": a["predicted_peak"],
            "predicted_account_peak": a["predicted_account_peak"],
            "measured_peak": a["peak"], "traced_peak": a["traced"],
            "store_all_peak": arms[0]["peak"], "n_recompute": sequence.recomputations(a["seq"]),
            "n_offload": a["n_offload"], "grad_err": a["grad_err"],
            "solve_seconds": a["solve_s"], "run_id": a["run"]})
    return rows


def synthetic(L, rng):
    """A random heterogeneous chain of L stages (the last a loss): sizes spread over ~30x, times
    over ~10x, x̄ 1-10x its x, transients up to the output's size."""
    wx = np.round(rng.lognormal(np.log(1e6), 1.0, L + 1)).astype(np.int64)
    wx[L] = 0
    wbar = wx + np.round(wx * rng.uniform(0.0, 9.0, L + 1)).astype(np.int64)
    wbar[0] = 0
    wd = wx.copy()
    wd[0] = 0
    uf = rng.lognormal(np.log(1e-3), 0.8, L)
    return profile.ChainProfile(tuple(f"s{i}" for i in range(L)), uf, uf * rng.uniform(1.5, 2.5, L),
                          wx, wbar, wd, np.round(wx[1:] * rng.uniform(0, 1, L)).astype(np.int64),
                          np.round(wx[:-1] * rng.uniform(0, 1, L)).astype(np.int64))


def solver_times(Ls, slots_list, seed):
    """rotor table construction for each (L, slots); combine.solve at a mid budget with a link
    that moves the mean x̄ in the mean forward time."""
    rows = []
    for L in Ls:
        prof = synthetic(L, np.random.default_rng([seed, L]))
        for slots in slots_list:
            t0 = time.perf_counter()
            solver = rotor.Solver(prof, slots)
            rows.append({"kind": "rotor", "L": L, "slots": slots,
                         "seconds": time.perf_counter() - t0})
            bw = float(prof.wbar.mean() / prof.uf.mean())
            t0 = time.perf_counter()
            combine.solve(prof, 0.5 * (solver.least + solver.top), bw, solver=solver)
            rows.append({"kind": "combine", "L": L, "slots": slots,
                         "seconds": time.perf_counter() - t0})
            print(f"solver L={L:3d} slots={slots:4d}: table {rows[-2]['seconds']:7.3f} s, "
                  f"combine.solve {rows[-1]['seconds']:7.3f} s", flush=True)
    return rows


def headline(rows, model, bandwidths):
    """Per arm (optimal, and optimal+offload per bandwidth):

    mem_gain_account    store-all account peak / least account peak of the arm's rows with
                        measured overhead < LIMIT (the executor's account: stored values only)
    mem_gain_traced     the same with the tracemalloc peaks (transients included)
    mem_gain_predicted  the same with the predicted overheads and peaks (transients included)
    share_removed_*     mean over the budgets where remat's overhead > 1.02 of
                        (ov_remat - ov_offload) / (ov_remat - 1): the part of rematerialization's
                        overhead that offloading removes (offload arms; NaN for optimal)
    share_pooled_*      sum of (ov_remat - ov_offload) / sum of (ov_remat - 1) over the same
                        budgets: less sensitive to noise where remat's overhead is small
    """
    r = {k: np.array([row[k] for row in rows if row["model"] == model]) for k in rows[0]}
    sa = r["arm"] == "store_all"
    gains = {"account": ("overhead", "measured_peak"), "traced": ("overhead", "traced_peak"),
             "predicted": ("predicted_overhead", "predicted_peak")}
    out = []
    for arm, bw in [("optimal", 0.0)] + [("optimal+offload", float(b)) for b in bandwidths]:
        sel = (r["arm"] == arm) & (r["bandwidth"] == bw)
        row = {"model": model, "arm": arm, "bandwidth": bw}
        for tag, (ov, peak) in gains.items():
            ok = sel & (r[ov] < LIMIT)
            row[f"mem_gain_{tag}"] = float(r[peak][sa][0] / r[peak][ok].min()) if ok.any() \
                else np.nan
        for tag, ov in (("measured", "overhead"), ("predicted", "predicted_overhead")):
            shares = []
            for b in r["budget_bytes"][sel]:
                o_r = r[ov][(r["arm"] == "optimal") & (r["budget_bytes"] == b)][0]
                o_o = r[ov][sel & (r["budget_bytes"] == b)][0]
                if arm != "optimal" and o_r > 1.02:
                    shares.append((o_r - o_o, o_r - 1.0))
            row[f"share_removed_{tag}"] = float(np.mean([a / b for a, b in shares])) \
                if shares else np.nan
            row[f"share_pooled_{tag}"] = float(sum(a for a, _ in shares) /
                                               sum(b for _, b in shares)) if shares else np.nan
            row[f"share_budgets_{tag}"] = len(shares)
        out.append(row)
    return out


def summary(rows, heads, model_rows, chan_rows):
    """The table of every arm, then the headline numbers, the agreement and the channel."""
    print("\nmodel arm              GB/s  budget MiB (frac)  pred ms  meas ms  ov pred  ov meas"
          "  account MiB  traced MiB  recomp  off")
    for r in rows:
        print(f"{r['model']:5s} {r['arm']:15s} {r['bandwidth'] / 1e9:5.2f}  "
              f"{r['budget_bytes'] / MiB:8.2f} ({r['budget_frac']:.2f})  "
              f"{1e3 * r['predicted_time']:7.1f}  {1e3 * r['measured_time']:7.1f}  "
              f"{r['predicted_overhead']:7.3f}  {r['overhead']:7.3f}  "
              f"{r['measured_peak'] / MiB:11.2f}  {r['traced_peak'] / MiB:10.2f}  "
              f"{r['n_recompute']:6d}  {r['n_offload']:3d}")
    print(f"\nHEADLINE  mem gain = store-all peak / least peak of the arm with overhead < "
          f"{LIMIT:.2f}\n          share removed = mean over budgets with remat overhead > 1.02 "
          f"of (ov_remat - ov_offload) / (ov_remat - 1)\n          pooled = sum of "
          f"(ov_remat - ov_offload) / sum of (ov_remat - 1) over the same budgets")
    for h in heads:
        bw = f"{h['bandwidth'] / 1e9:g} GB/s" if h["bandwidth"] else "-"
        line = (f"  {h['model']:4s} {h['arm']:15s} {bw:9s} mem gain {h['mem_gain_account']:4.2f}x "
                f"account, {h['mem_gain_traced']:4.2f}x traced ({h['mem_gain_predicted']:4.2f}x "
                f"predicted)")
        if h["arm"] != "optimal":
            line += (f"\n{'':31s}share removed {h['share_removed_measured']:6.1%} measured "
                     f"(pooled {h['share_pooled_measured']:6.1%}) over "
                     f"{h['share_budgets_measured']} budgets, {h['share_removed_predicted']:6.1%}"
                     f" predicted (pooled {h['share_pooled_predicted']:6.1%}) over "
                     f"{h['share_budgets_predicted']}")
        print(line)
    for r in rows:
        if r["arm"] == "sqrt":
            sa = [q for q in rows if q["model"] == r["model"] and q["arm"] == "store_all"][0]
            print(f"  {r['model']:4s} sqrt (one point)          mem gain "
                  f"{sa['measured_peak'] / r['measured_peak']:4.2f}x account, "
                  f"{sa['traced_peak'] / r['traced_peak']:4.2f}x traced at overhead "
                  f"{r['overhead']:.3f} measured ({r['predicted_overhead']:.3f} predicted)")
    print("\nAGREEMENT  time: measured / predicted step, median [min, max]; peak: account / "
          "model without transients [min, max]; counts of account and traced peaks > budget")
    for m in model_rows:
        for arm in ("store_all", "sqrt", "optimal", "optimal+offload"):
            sel = [r for r in rows if r["model"] == m["model"] and r["arm"] == arm]
            q = np.array([r["measured_time"] / r["predicted_time"] for r in sel])
            acc = np.array([r["measured_peak"] / r["predicted_account_peak"] for r in sel])
            over = sum(r["measured_peak"] > r["budget_bytes"] for r in sel)
            tover = sum(r["traced_peak"] > r["budget_bytes"] for r in sel)
            print(f"  {m['model']:4s} {arm:15s} time {np.median(q):.3f} [{q.min():.3f}, "
                  f"{q.max():.3f}]  peak [{acc.min():.4f}, {acc.max():.4f}]  account > budget "
                  f"{over}/{len(sel)}  traced > budget {tover}/{len(sel)}")
    for c in chan_rows:
        print(f"  {c['model']:4s} channel {c['bandwidth'] / 1e9:g} GB/s: {c['transfers']} "
              f"transfers, {c['bytes'] / MiB:.0f} MiB, achieved {c['achieved'] / 1e9:.2f} GB/s")


def main(argv=None):
    ap = scripts.parser(__doc__)
    ap.add_argument("--models", default="cnn,gpt,gpth")     # gpth: the GPT in half layers
    ap.add_argument("--points", type=int, default=12)       # budgets from least to store-all
    ap.add_argument("--repeats", type=int, default=5)       # interleaved timed rounds
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bandwidths", default="5e8,2e9")     # bytes/s of the emulated link
    ap.add_argument("--slots", type=int, default=500)       # rotor's memory discretisation
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/remat_tradeoff")
    ap.add_argument("--quick", action="store_true", help="tiny models, 4 points, 3 repeats")
    args = ap.parse_args(argv)
    backend.tune_allocator()          # as the training loop does: freed steps' memory stays mapped
    if args.quick:
        args.points, args.repeats, args.warmup = 4, 3, 1      # 3 pairs: a median, not one sample
    bandwidths = [float(b) for b in args.bandwidths.split(",")]
    if args.points < 2 or args.repeats < 1 or args.warmup < 0 or min(bandwidths) <= 0:
        scripts.refuse(f"need --points >= 2 (got {args.points}), --repeats >= 1 "
                       f"({args.repeats}), --warmup >= 0 ({args.warmup}), bandwidths > 0 "
                       f"({bandwidths})")
    t_start = time.perf_counter()
    rows, heads, model_rows, chan_rows = [], [], [], []
    for name in args.models.split(","):
        chain, x, y, desc = build(name, args.quick, args.seed)
        prof = profile.measure(chain, x, y, need_dx=False, repeats=3 if args.quick else 15)
        t0 = time.perf_counter()
        solver = rotor.Solver(prof, args.slots)
        build_s = time.perf_counter() - t0
        print(f"{desc}: {len(prof)} stages, store-all {solver.top / MiB:.2f} MiB predicted "
              f"{1e3 * prof.store_all_time:.1f} ms, least budget {solver.least / MiB:.2f} "
              f"MiB, largest x̄ {prof.wbar.max() / MiB:.2f} MiB, largest transient "
              f"{max(prof.of.max(), prof.ob.max()) / MiB:.2f} MiB", flush=True)
        arms = plan(prof, solver, args.points, bandwidths)
        print(f"  planned {len(arms)} arms in {time.perf_counter() - t0:.1f} s; running",
              flush=True)
        chan = execute(chain, x, y, prof, arms, args)
        print(f"  {len({a['run'] for a in arms})} distinct executions", flush=True)
        chan_rows += [dict(model=name, **c, achieved=c["bytes"] / max(c["seconds"], 1e-12))
                      for c in chan]
        rows += rows_of(name, prof, arms)
        heads += headline(rows, name, bandwidths)
        big = int(np.argmax(prof.wbar[1:]))
        model_rows.append({
            "model": name, "description": desc, "stages": len(prof),
            "store_all_predicted_peak": solver.top, "least_budget": solver.least,
            "slot_bytes": solver.slot_bytes, "solver_build_s": build_s,
            "store_all_predicted_time": prof.store_all_time,
            "store_all_measured_time": arms[0]["sa_median"],
            "forward_time": float(prof.uf.sum()), "backward_time": float(prof.ub.sum()),
            "largest_xbar": float(prof.wbar.max()),
            "largest_xbar_stage_time": float(prof.uf[big] + prof.ub[big]),
            "largest_transient": float(max(prof.of.max(), prof.ob.max()))})
        print(f"  done at {time.perf_counter() - t_start:.0f} s", flush=True)
    Ls = [8, 16] if args.quick else [8, 16, 32, 64]
    solver_rows = solver_times(Ls, [100, 250, 500], args.seed)
    summary(rows, heads, model_rows, chan_rows)
    path = os.path.join(args.out, "results.h5")
    attrs = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
             "cores": os.cpu_count() or 1, "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
             "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "quick": bool(args.quick),
             "bandwidths": bandwidths, "points": args.points, "repeats": args.repeats,
             "warmup": args.warmup, "slots": args.slots, "overhead_limit": LIMIT,
             "channel": "file on local disk, throttled to the bandwidth (emulated link)",
             "dtype": "float32", "seconds": time.perf_counter() - t_start}
    save_table(path, "tradeoff", rows, attrs)
    save_table(path, "models", model_rows, attrs)
    save_table(path, "headline", heads, attrs)
    save_table(path, "solver", solver_rows, attrs)
    save_table(path, "channel", chan_rows, attrs)
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
