"""Serial training-step speed: hpcnn vs plain NumPy matmuls of the same shapes vs PyTorch.

One BLAS thread, float32. The variants are timed in alternation (median of rounds). For each
model it reports samples/s of a full step (forward, backward,
SGD update), the achieved FLOP/s as a fraction of the FLOP/s of exactly the step's matmuls run
back to back in plain NumPy (measured in the same run), and, where ``torch`` imports, the same
model's step in PyTorch. Results go to runs/bench/serial_step.h5 (tables ``mlp`` and ``gpt``).

    OMP_NUM_THREADS=1 python benchmarks/serial_step.py [--repeats=20] [--breakdown]

``--breakdown`` then runs each model's step instrumented (a separate, untimed-for-comparison
run) and prints the exclusive time of every block method per step: where the time goes beyond
the matmuls (each Linear's GEMMs and bias, the attention core, LayerNorm, GELU, loss, optimizer).

Models: MLP 4 x Linear(1024, 1024) with ReLU, batch 256 (as in shared MEASURED.md);
GPT-tiny 4 blocks, dim 128, 4 heads, context 64, vocab 81, batch 32.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from hpcnn import scripts  # noqa: E402
from hpcnn.log.results import save_table  # noqa: E402
from hpcnn.nn import models  # noqa: E402
from hpcnn.nn.optim import SGD  # noqa: E402

REPEATS = 20                    # --repeats, --breakdown: main() sets them
BREAKDOWN = False


def timeit_interleaved(fns: dict, repeats=None, warmup=3) -> dict:
    """Median seconds per call of each function, measured in alternation (round r times every
    function once) so that a change in machine load affects all of them alike; ``repeats``
    rounds (default :data:`REPEATS`)."""
    repeats = REPEATS if repeats is None else repeats
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ts = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in ts.items()}


def hpcnn_step(model, x, y, opt):
    def step():
        model.zero_grad()
        loss, caches = model.forward(x, y)
        model.backward(1.0, caches, need_dx=False)
        opt.step(1e-3)
    return step


def breakdown(step, opt, steps=10) -> dict:
    """Milliseconds per step spent in each block method itself (its callees' time excluded),
    measured by wrapping the methods of hpcnn's block classes and the optimizer for ``steps``
    steps; ``"(rest)"`` is the step time outside them (chain loop, zero_grad, dropout at p=0)."""
    from hpcnn.nn import layers, loss, transformer
    methods = {layers.Linear: ("forward", "backward_input", "backward_weight"),
               layers.LayerNorm: ("forward", "backward"), layers.ReLU: ("forward", "backward"),
               layers.GELU: ("forward", "forward_inplace", "backward", "backward_inplace"),
               transformer.Embedding: ("forward", "backward"),
               transformer.CausalSelfAttention: ("forward", "backward"),
               transformer.MLPBlock: ("forward", "backward"),
               transformer.TransformerBlock: ("forward", "backward"),
               loss.SoftmaxCrossEntropy: ("forward", "backward"), type(opt): ("step",)}
    totals, inner = {}, []          # inner: time spent in wrapped callees, per open call

    def wrap(fn, label):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            inner.append(0.0)
            try:
                return fn(*args, **kw)
            finally:
                spent = time.perf_counter() - t0
                totals[label] = totals.get(label, 0.0) + spent - inner.pop()
                if inner:
                    inner[-1] += spent
        return timed

    saved = [(cls, m, cls.__dict__[m]) for cls, ms in methods.items() for m in ms]
    for cls, m, fn in saved:
        setattr(cls, m, wrap(fn, f"{cls.__name__}.{m}"))
    try:
        step()                                           # warm-up, not counted
        totals.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        whole = time.perf_counter() - t0
    finally:
        for cls, m, fn in saved:
            setattr(cls, m, fn)
    out = {k: 1e3 * v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    out["(rest)"] = 1e3 * whole / steps - sum(out.values())
    return out


def matmul_reference(shapes):
    """The step's matmuls, (b, m, k) @ (b, k, n) each, run back to back in NumPy: (fn, flops)."""
    rng = np.random.default_rng(0)
    ops = [(rng.standard_normal((b, m, k), dtype=np.float32)[0 if b == 1 else slice(None)],
            rng.standard_normal((b, k, n), dtype=np.float32)[0 if b == 1 else slice(None)])
           for b, m, k, n in shapes]
    flops = sum(2.0 * b * m * k * n for b, m, k, n in shapes)
    return (lambda: [a @ b for a, b in ops]), flops


def mlp_case():
    B, D, L = 256, 1024, 4
    model = models.mlp(D, [D] * (L - 1), D, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, D), dtype=np.float32)
    y = rng.integers(0, D, size=B)
    # forward x@W per layer; backward x^T@dy per layer and dy@W^T for all but the first layer
    shapes = [(1, B, D, D)] * L + [(1, D, B, D)] * L + [(1, B, D, D)] * (L - 1)
    return "mlp", model, x, y, B, shapes


def gpt_case():
    B, T, C, H, V, L = 32, 64, 128, 4, 81, 4
    model = models.gpt(V, T, L, C, H, seed=0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, V, size=(B, T))
    y = rng.integers(0, V, size=(B, T))
    N, hs = B * T, C // H
    # per linear: forward, dx and dW (same flops); attention: q k^T and att v forward, and
    # 4 batched products backward (d_att, dv, dq, dk)
    lin = [(1, N, C, 3 * C), (1, N, C, C), (1, N, C, 4 * C), (1, N, 4 * C, C)]
    per_block = lin * 3 + [(B * H, T, hs, T)] * 2 + [(B * H, T, T, hs)] * 4
    shapes = per_block * L + [(1, N, C, V)] * 3
    return "gpt", model, x, y, B, shapes


def torch_step(name, B):
    try:
        import torch
        import torch.nn as tnn
        import torch.nn.functional as functional
    except ImportError:
        return None, "torch not importable"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "mlp":
        D = 1024
        layers = []
        for i in range(4):
            layers.append(tnn.Linear(D, D))
            if i < 3:
                layers.append(tnn.ReLU())
        net = tnn.Sequential(*layers)
        x = torch.randn(B, D)
        y = torch.randint(0, D, (B,))
    else:
        T, C, H, V, L = 64, 128, 4, 81, 4

        class Block(tnn.Module):
            def __init__(self):
                super().__init__()
                self.ln1, self.ln2 = tnn.LayerNorm(C), tnn.LayerNorm(C)
                self.qkv, self.proj = tnn.Linear(C, 3 * C), tnn.Linear(C, C)
                self.fc, self.out = tnn.Linear(C, 4 * C), tnn.Linear(4 * C, C)

            def forward(self, x):
                b, t, c = x.shape
                q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
                q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
                a = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
                return x + self.out(functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))

        class GPT(tnn.Module):
            def __init__(self):
                super().__init__()
                self.wte, self.wpe = tnn.Embedding(V, C), tnn.Embedding(T, C)
                self.blocks = tnn.ModuleList(Block() for _ in range(L))
                self.ln, self.head = tnn.LayerNorm(C), tnn.Linear(C, V, bias=False)

            def forward(self, idx):
                x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
                for blk in self.blocks:
                    x = blk(x)
                return self.head(self.ln(x)).view(-1, V)

        net = GPT()
        x = torch.randint(0, V, (B, T))
        y = torch.randint(0, V, (B * T,))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=False)
        functional.cross_entropy(net(x), y).backward()
        opt.step()
    return step, torch.__version__


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    scripts.flag(ap, "breakdown", False, "time the parts of each step too")
    return ap


def main(argv=None):
    global REPEATS, BREAKDOWN
    a = parser().parse_args(argv)
    REPEATS, BREAKDOWN = a.repeats, a.breakdown
    from hpcnn import backend
    backend.tune_allocator()          # as `hpcnn train` does: no page faults on step temporaries
    out = os.path.join("runs", "bench", "serial_step.h5")
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, repeats {REPEATS} (median)")
    for case in (mlp_case, gpt_case):
        name, model, x, y, B, shapes = case()
        ref, flops = matmul_reference(shapes)
        tstep, tver = torch_step(name, B)
        opt = SGD(model.params, momentum=0.9)
        fns = {"hpcnn": hpcnn_step(model, x, y, opt), "matmul": ref}
        if tstep:
            fns["torch"] = tstep
        t = timeit_interleaved(fns)
        t_ours, t_mm, t_torch = t["hpcnn"], t["matmul"], t.get("torch", float("nan"))
        row = {"model": name, "batch": B, "hpcnn_step_s": t_ours, "hpcnn_samples_per_s": B / t_ours,
               "matmul_only_s": t_mm, "matmul_gflops": flops / t_mm / 1e9,
               "hpcnn_gflops": flops / t_ours / 1e9, "fraction_of_matmul_rate": t_mm / t_ours,
               "torch_step_s": t_torch, "torch_samples_per_s": B / t_torch,
               "hpcnn_over_torch": t_torch / t_ours}
        print(f"{name}: hpcnn {t_ours * 1e3:7.2f} ms/step ({B / t_ours:8.1f} samples/s, "
              f"{row['hpcnn_gflops']:.1f} GFLOP/s) | matmuls alone {t_mm * 1e3:7.2f} ms "
              f"({row['matmul_gflops']:.1f} GFLOP/s) -> {100 * row['fraction_of_matmul_rate']:.1f} % "
              f"of the matmul rate | torch {tver}: {t_torch * 1e3:7.2f} ms/step -> hpcnn/torch "
              f"samples/s = {row['hpcnn_over_torch']:.2f}x")
        save_table(out, name, [row], attrs={"threads": os.environ.get("OMP_NUM_THREADS", ""),
                                            "torch": tver, "repeats": REPEATS})
        if BREAKDOWN:
            parts = breakdown(fns["hpcnn"], opt)
            total = sum(parts.values())
            print(f"  {name} step, instrumented: {total:.2f} ms; matmuls alone {t_mm * 1e3:.2f} ms")
            for label, ms in parts.items():
                print(f"    {label:34s} {ms:7.2f} ms  {100 * ms / total:5.1f} %")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
