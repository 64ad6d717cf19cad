"""Search time of the planner's three searches vs operators and vs devices (thesis claim (a)).

Random chains of Linear operators (batch 1024, widths 2**6 .. 2**12, seed 0). For each point,
the median of 3 runs of the search and its SAPP cost evaluation:

- DRA (:func:`hpcnn.plan.search.dra`): 10**2 .. 10**5 operators on 4096 devices, and 2 .. 4096
  devices with 10**4 operators;
- chain DP (:func:`hpcnn.plan.search.chain_dp`): 10**2 .. 10**4 operators on 16 devices, and
  2 .. 256 devices with 100 operators (its state is a cut sequence: 4**log2(p) of them);
- exhaustive: 1 .. 3 operators on 4 devices (16 sequences each: 16**n plans).

Prints the table and the log-log slope of time against each varied size (1 = linear), checks the
target "10**4 operators on 4096 devices under 1 s" for the DRA, and saves the rows as table
``plan_search`` in runs/bench/plan_search.h5 (one row per point, ``sweep`` naming its sweep;
slopes as attributes), which analysis/plan_search.py draws:

    PYTHONPATH=$PWD python benchmarks/plan_search.py [--quick]
    python analysis/plan_search.py runs/bench/plan_search.h5 docs/figures/plan_search.png

About 40 s on one idle core (``--quick``: 10**4 operators and 64 devices at most, a few seconds;
``--tiny``: 10**3 operators, for a smoke test).
"""
import os
import random
import statistics
import time

import numpy as np

from hpcnn import scripts
from hpcnn.log.results import save_table
from hpcnn.plan.cost import Matmul, chain
from hpcnn.plan.search import chain_dp, dra, exhaustive

OUT = os.path.join("runs", "bench", "plan_search.h5")


def random_chain(n: int, seed: int = 0):
    rng = random.Random(seed)
    dims = [2 ** rng.randint(6, 12) for _ in range(n + 1)]
    return chain([Matmul(1024, dims[t], dims[t + 1]) for t in range(n)])


def median_seconds(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def sweep(name, search, points):
    """Rows {search, operators, devices, seconds} for (n, p) in points."""
    rows = []
    for n, p in points:
        g = random_chain(n)
        s = median_seconds(lambda: search(g, p))
        rows.append({"search": name, "operators": n, "devices": p, "seconds": s})
        print(f"{name:>10} {n:>7} ops {p:>5} devices {s * 1e3:10.2f} ms", flush=True)
    return rows


def slope(rows, key):
    """Least-squares slope of log(seconds) against log(rows[key])."""
    x = np.log([r[key] for r in rows])
    y = np.log([r["seconds"] for r in rows])
    return float(np.polyfit(x, y, 1)[0])


def parser():
    ap = scripts.parser(__doc__)
    scripts.flag(ap, "quick", False, "10**4 operators and 64 devices at most")
    scripts.flag(ap, "tiny", False, "a smoke run: 10**3 operators, 64 devices at most")
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    quick, tiny = a.quick, a.tiny
    max_ops = 10 ** 3 if tiny else 10 ** 4 if quick else 10 ** 5
    max_p = 64 if tiny or quick else 4096

    def keep(points):
        return [(n, p) for n, p in points if n <= max_ops and p <= max_p]
    sweeps = {
        "dra_blocks": ("dra", dra, keep([(n, 4096 if not tiny else 64)
                                         for n in (100, 1000, 10_000, 100_000)])),
        "dra_devices": ("dra", dra, keep([(10_000 if not tiny else 1000, p)
                                          for p in (2, 16, 128, 1024, 4096)])),
        "dp_blocks": ("chain_dp", chain_dp, keep([(n, 16) for n in (100, 1000, 10_000)])),
        "dp_devices": ("chain_dp", chain_dp, keep([(100, p) for p in (2, 4, 16, 64, 256)])),
        "exhaustive_blocks": ("exhaustive", exhaustive, [(n, 4) for n in (1, 2, 3)]),
    }
    rows, attrs = [], {"load_avg_1min": os.getloadavg()[0]}
    for key, (name, search, points) in sweeps.items():
        part = [dict(r, sweep=key) for r in sweep(name, search, points)]
        varied = "devices" if key.endswith("devices") else "operators"
        attrs[f"slope_{key}"] = slope(part, varied)
        print(f"  log-log slope of {key} (time vs {varied}): {attrs[f'slope_{key}']:.2f}")
        rows += part
    target = next((r["seconds"] for r in rows if r["search"] == "dra"
                   and r["operators"] == 10_000 and r["devices"] == 4096), None)
    if target is not None:
        attrs["dra_1e4_ops_4096_devices_s"] = target
        print(f"DRA, 10^4 operators on 4096 devices: {target:.3f} s "
              f"({'under' if target < 1 else 'OVER'} the 1 s target); "
              f"load {attrs['load_avg_1min']:.2f}")
    save_table(OUT, "plan_search", rows, attrs)
    print(f"saved table plan_search in {OUT}")


if __name__ == "__main__":
    main()
