"""What-if at scale: the layouts the planner chooses for GPT models from 1.3 B to 1 T parameters.

What: for the GPT family of Narayanan et al. (SC 2021, "Efficient large-scale language model
training on GPU clusters using Megatron-LM", Table 1: layers, width, heads, devices and batch),
``hpcnn.plan.hybrid.plan`` ranks every dp x tp x pp x schedule x micro-batches x remat layout on
a machine file (default: the DGX A100 cluster, ``machines/dgx-a100-cluster.toml``), without
profiling. Recorded per model: the chosen layout, its predicted step time, model FLOP/s per device
(and the fraction of the device's peak), memory per device, how many layouts were priced and the
search's wall time (the issue's bar: under a second each).

These are predictions from the machine file's public figures (datasheets, published
benchmarks); nothing here was measured on the GPUs. The
comparison with Megatron's reported layouts (its Table 1: tp = 8 within a node from 39 B up, pp
growing with the model) is the analysis's.

    python experiments/plan_scale.py [--machine=machines/dgx-a100-cluster.toml] [--out=runs/plan_scale]
    python analysis/plan_scale.py runs/plan_scale/results.h5 docs/figures/plan_scale.png

Output: table ``scale`` in OUT/results.h5 (one row per model).
"""
import os
import sys
import time

from hpcnn import scripts  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.plan import hybrid, machine  # noqa: E402

# name, layers, width, heads, devices, global batch (Narayanan et al. 2021, Table 1), seq 2048
FAMILY = [("1.7B", 24, 2304, 24, 32, 512), ("3.6B", 30, 3072, 32, 64, 512),
          ("7.5B", 36, 4096, 32, 128, 512), ("18B", 40, 6144, 48, 256, 1024),
          ("39B", 48, 8192, 64, 512, 1536), ("76B", 60, 10240, 80, 1024, 1792),
          ("145B", 80, 12288, 96, 1536, 2304), ("310B", 96, 16384, 128, 1920, 2160),
          ("530B", 105, 20480, 128, 2520, 2520), ("1T", 128, 25600, 160, 3072, 3072)]


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--machine", default="machines/dgx-a100-cluster.toml")
    ap.add_argument("--models", default=",".join(f[0] for f in FAMILY))
    ap.add_argument("--out", default="runs/plan_scale")
    a = ap.parse_args(argv)
    mach = machine.load(a.machine)
    wanted = a.models.split(",")
    unknown = [w for w in wanted if w not in {f[0] for f in FAMILY}]
    if unknown:
        scripts.refuse(f"unknown model(s) {unknown}; expected some of {[f[0] for f in FAMILY]}")
    rows = []
    for name, layers, dim, heads, devices, batch in FAMILY:
        if name not in wanted:
            continue
        model = hybrid.Transformer(layers, dim, heads, seq=2048, batch=batch, dtype="bfloat16")
        t0 = time.perf_counter()
        ranked = hybrid.plan(model, mach, devices)
        search_s = time.perf_counter() - t0
        best = ranked[0]
        per_device = hybrid.flops_per_step(model) / best.step_s / devices
        peak = mach.device.flops.get("bfloat16") or max(mach.device.flops.values())
        rows.append({"model": name, "params": float(model.params()), "devices": devices,
                     "batch": batch, "dp": best.layout.dp, "tp": best.layout.tp,
                     "pp": best.layout.pp, "microbatches": best.layout.microbatches,
                     "schedule": best.layout.schedule, "remat": best.layout.remat,
                     "step_s": best.step_s, "tflops_per_device": per_device / 1e12,
                     "fraction_of_peak": per_device / peak,
                     "memory_gb": best.memory_bytes / 1e9, "feasible": int(best.feasible),
                     "layouts": len(ranked), "search_s": search_s})
        r = rows[-1]
        print(f"{name:>5} ({r['params'] / 1e9:7.1f} B) on {devices:>4}: {best.layout}; "
              f"{best.step_s:7.2f} s/step, {r['tflops_per_device']:6.1f} TFLOP/s/device "
              f"({r['fraction_of_peak']:.0%} of peak), {r['memory_gb']:5.1f} GB/device, "
              f"{len(ranked)} layouts in {search_s:.3f} s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    save_table(os.path.join(a.out, "results.h5"), "scale", rows,
               attrs={"machine": mach.name, "source": mach.source})
    print(f"wrote {os.path.join(a.out, 'results.h5')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
