"""How long `hpcnn plan` takes to price every layout of a large model (issue: under 1 s each).

Cases: GPT-3 175B (96 layers, width 12288, 96 heads, seq 2048, batch 1536) on 64, 256, 1024 and
4096 devices, and every model of the published runs (`experiments/published_runs.toml`: its
shape, global batch and device count) on its machine file (its device's, or its own system's
where the run names one: BLOOM's Jean Zay), each planned as `hpcnn plan` plans by default
(ZeRO 0, every schedule, micro-batch count, recomputation and sequence parallelism). Each round plans every case once, in order, with the planner's caches
emptied before each plan (so every plan builds its block specs and prices anew, as a fresh
`hpcnn plan` does); the table gives each case's median over the rounds and the load average
before and after. Module imports (NumPy, the blocks) are not in the times: a process pays them
once, about 0.15 s on this machine idle.

Prints the table and the largest median, and saves the rows as table ``plan_time`` in
runs/bench/plan_time.h5:

    python benchmarks/plan_time.py [--rounds=3] [--only=gpt3]
"""
import functools
import os
import statistics
import sys
import time

from hpcnn import scripts
from hpcnn.log.results import save_table
from hpcnn.plan import gemm, hybrid, machine, published, traffic

OUT = os.path.join("runs", "bench", "plan_time.h5")
A100 = published.MACHINES["A100"]


def cases(only: str = "") -> list:
    """(name, model, machine file, devices) of every case, the GPT-3 ones first."""
    gpt3 = hybrid.Transformer(96, 12288, 96, 2048, 51200, 1536, "float16")
    out = [(f"gpt3-175b-{d}", gpt3, A100, d) for d in (64, 256, 1024, 4096)]
    if only != "gpt3":
        seen = set()
        for run in published.load():
            model, name = published.model_of(run), published.machine_name(run)
            if (model, name, run.devices) not in seen:
                seen.add((model, name, run.devices))
                out.append((run.name, model, name, run.devices))
    return out


def empty_caches() -> None:
    """Every memoised function of the planner's modules, emptied."""
    for module in (hybrid, gemm, traffic, machine):
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()


def plan_seconds(model, file: str, devices: int) -> tuple:
    """(seconds, layouts) of one plan, caches emptied first."""
    empty_caches()
    mach = machine.load(file)
    t = time.perf_counter()
    ranked = hybrid.plan(model, mach, devices)
    return time.perf_counter() - t, len(ranked)


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", choices=("", "gpt3"),
                    help="gpt3: the GPT-3 cases alone")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print(f"plan_time: --rounds={args.rounds}: expected at least 1", file=sys.stderr)
        return 2
    todo = cases(args.only)
    plan_seconds(*todo[0][1:])                    # imports and first-call costs, not timed
    load_before = os.getloadavg()[0]
    times = {name: [] for name, *_ in todo}
    counts = {}
    for _ in range(args.rounds):
        for name, model, file, devices in todo:
            seconds, counts[name] = plan_seconds(model, file, devices)
            times[name].append(seconds)
    load_after = os.getloadavg()[0]
    rows = [{"case": name, "devices": devices, "machine": file, "layouts": counts[name],
             "median_s": statistics.median(times[name]), "max_s": max(times[name])}
            for name, _, file, devices in todo]
    for r in rows:
        print(f"{r['case']:<40} {r['devices']:>5} devices {r['layouts']:>6} layouts "
              f"{r['median_s']:7.3f} s median ({r['max_s']:.3f} s at most)")
    worst = max(rows, key=lambda r: r["median_s"])
    print(f"{len(rows)} cases, {args.rounds} round(s), load {load_before:.1f} before, "
          f"{load_after:.1f} after: largest median {worst['median_s']:.3f} s "
          f"({worst['case']}); {sum(r['median_s'] < 1 for r in rows)} of {len(rows)} under 1 s")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    save_table(args.out, "plan_time", rows, {"rounds": args.rounds, "load_before": load_before,
                                             "load_after": load_after})
    return 0


if __name__ == "__main__":
    sys.exit(main())
