"""The GPU check: hpcnn's device path on one GPU against NumPy, then a throughput line.

One PASS or FAIL line per check, exit 1 if any fails. Without a GPU (no CuPy, or no device) it
runs the same checks under the strict backend (NumPy behind a GPU's rules), with a small
throughput model, so that on a GPU only the arrays change. At most about 8 minutes on one GPU.

    python benchmarks/gpu_check.py [--device=auto|gpu|strict] [--size=auto|full|small]
    make gpu-check [DEVICE=strict]

Checks: every block kind's forward and backward in float64 against NumPy's; a serial GPT run;
dp=2, tp=2 and pp=2 on 2 ranks sharing the device (--share_gpus; one GPU each where there are
several), ZeRO-1, 2 and 3 on 2 ranks, each against the serial NumPy run; bf16 and fp16 mixed
precision against NumPy's (on CuPy, which has no bfloat16, bf16 is reported as skipped). Then a
GPT sized for the device (full: 12 layers, width 1024, context 1024, batch 8, fp16; small: 2
layers, width 64, context 32) trained a few steps: tokens/s, TFLOP/s (6 N + 12 L T d FLOPs a
token, PaLM's appendix B as nanoGPT's estimate_mfu) and the fraction of the device's peak
(:data:`PEAKS` by device name, dense 16-bit tensor-core rates from the vendors' datasheets;
under strict, this machine file's float32 rate), beside the same model in plain ``torch.nn``
on the same device where PyTorch is installed.

Under strict the blocks and the serial runs equal NumPy's exactly and the 2-rank runs the serial
one to 1e-10 relative (the project's parity bound: they sum in another order); on a GPU, whose
kernels sum in other orders too, float64 agrees to 1e-9 and the 16-bit runs to 2e-2.
"""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from hpcnn import backend, scripts
from hpcnn.config import parse_overrides
from hpcnn.log import read_run

# dense FP16/BF16 tensor-core TFLOP/s (vendor datasheets; "with sparsity" figures halved),
# matched against the device's name, first match wins
PEAKS = [("H200", 989.5e12), ("H100 PCIe", 756e12), ("H100", 989.5e12), ("A100", 312e12),
         ("V100", 125e12), ("A10", 125e12)]
GPT = ["--model=gpt", "--dataset=sonnet", "--dim=16", "--n_heads=2", "--block_size=8",
       "--batch_size=8", "--n_layers=2", "--steps=2", "--log_interval=2", "--eval_interval=2",
       "--eval_batches=1", "--optimizer=adamw", "--pad_vocab=2", "--dropout=0.1",
       "--progress=false"]
# (ZeRO-2 and 3 with 2 micro-batches: each reduce-scattered in its own backward and added)
LAYOUTS = {"dp=2": ["--dp=2"], "tp=2": ["--tp=2"], "pp=2": ["--pp=2", "--microbatches=2"],
           **{f"zero={z}": ["--dp=2", f"--zero={z}", *(["--grad_accum=2"] if z >= 2 else [])]
              for z in (1, 2, 3)}}
SIZES = {"full": dict(n_layers=12, dim=1024, n_heads=16, block_size=1024, batch_size=8,
                      steps=12, dataset="shakespeare"),
         "small": dict(n_layers=2, dim=64, n_heads=4, block_size=32, batch_size=4, steps=5,
                       dataset="sonnet")}
RESULTS = []


def report(name: str, ok, detail: str = "") -> None:
    """Print one check's line: PASS, FAIL or SKIP (``ok`` None)."""
    word = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    RESULTS.append(word)
    print(f"{word} {name}" + (f": {detail}" if detail else ""), flush=True)


def pick_device(asked: str) -> str:
    """gpu where CuPy sees a device, else strict (``asked``: auto | gpu | strict)."""
    if asked != "auto":
        return asked
    try:
        import cupy
        return "gpu" if cupy.cuda.runtime.getDeviceCount() > 0 else "strict"
    except Exception:                     # no CuPy, or no driver / device
        return "strict"


def close(a, b, device: str, rtol: float = 1e-9, exact: bool = True) -> tuple[bool, float]:
    """(equal within tolerance: exactly under strict when ``exact``, else ``rtol``; the
    largest relative difference)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return False, float("inf")
    err = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))) if a.size else 0.0
    return (err == 0.0 if device == "strict" and exact else err <= rtol), err


def block_cases():
    """(name, make block, input host array, targets or None) of every block kind, float64."""
    from hpcnn.nn.conv import Conv2d, MaxPool2d
    from hpcnn.nn.layers import GELU, Dropout, LayerNorm, Linear
    from hpcnn.nn.loss import SoftmaxCrossEntropy
    from hpcnn.nn.transformer import CausalSelfAttention, Embedding, MLPBlock, TransformerBlock
    rng = np.random.default_rng(0)
    f64 = dict(dtype=np.float64)
    seq, img = rng.standard_normal((2, 8, 16)), rng.standard_normal((2, 3, 6, 6))
    return [("linear", lambda: Linear(16, 8, **f64), seq, None),
            ("gelu", lambda: GELU(**f64), seq, None),
            ("layernorm", lambda: LayerNorm(16, **f64), seq, None),
            ("dropout", lambda: Dropout(0.3, **f64), seq, None),
            ("embedding", lambda: Embedding(20, 16, 8, **f64), rng.integers(0, 20, (2, 8)), None),
            ("attention", lambda: CausalSelfAttention(16, 4, dropout=0.1, **f64), seq, None),
            ("mlp", lambda: MLPBlock(16, dropout=0.1, **f64), seq, None),
            ("transformer", lambda: TransformerBlock(16, 4, dropout=0.1, **f64), seq, None),
            ("conv", lambda: Conv2d(3, 4, 3, padding=1, **f64), img, None),
            ("maxpool", lambda: MaxPool2d(2, **f64), img, None),
            ("loss", lambda: SoftmaxCrossEntropy(), rng.standard_normal((6, 20)),
             rng.integers(0, 20, 6))]


def run_block(make, x, targets, device: str) -> list:
    """The block's output (or loss), input gradient and parameter gradients as host arrays."""
    backend.set_device(device)
    try:
        block, dev = make(), backend.to_device(x)
        if targets is not None:
            y, cache = block.forward(dev, backend.to_device(targets))
            dx = block.backward(1.0, cache)
        else:
            y, cache = block.forward(dev)
            dy = np.random.default_rng(1).standard_normal(y.shape)
            dx = block.backward(backend.to_device(dy), cache)
        out = [y] + ([] if dx is None or dx.dtype.kind != "f" else [dx])
        return [backend.to_host(a) for a in out + [p.grad for p in block.params]]
    finally:
        backend.set_device("cpu")


def check_blocks(device: str) -> None:
    """Every block kind's forward and backward on the device against NumPy, float64."""
    bad, worst = [], 0.0
    for name, make, x, targets in block_cases():
        try:
            ref, got = run_block(make, x, targets, "cpu"), run_block(make, x, targets, device)
            oks = [close(g, r, device) for g, r in zip(got, ref)]
            worst = max([worst] + [e for _, e in oks])
            if len(got) != len(ref) or not all(ok for ok, _ in oks):
                bad.append(name)
        except Exception as e:             # a block that fails on the device: named
            bad.append(f"{name} ({type(e).__name__}: {e})")
    report(f"blocks on {device} vs NumPy (float64, {len(block_cases())} kinds)", not bad,
           f"failed: {', '.join(bad)}" if bad else f"largest relative difference {worst:.1e}")


def train_losses(args, device: str, tmp: str, ranks: int = 1, env=None) -> np.ndarray:
    """The losses and validation losses a run of ``hpcnn train args`` logs (``ranks`` > 1:
    under mpiexec, sharing the device)."""
    log = os.path.join(tmp, f"run{len(os.listdir(tmp))}.h5")
    args = [*args, f"--device={device}", f"--log={log}"]
    if ranks == 1:
        from hpcnn.train import train
        try:
            train(parse_overrides(args))
        finally:
            backend.set_device("cpu")
    else:
        cmd = scripts.mpi_command(ranks, ["-m", "hpcnn", "train",
                                          "--share_gpus=true", *args])
        subprocess.run(cmd, check=True, capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})), timeout=300)
    m = read_run(log).metrics
    return np.concatenate([m["loss"][np.isfinite(m["loss"])],
                           m["val_loss"][np.isfinite(m["val_loss"])]])


def check_training(device: str, tmp: str) -> None:
    """A serial GPT run, then each layout on 2 ranks, against the serial NumPy run (float64);
    bf16 and fp16 against NumPy's run of the same precision."""
    f64 = [*GPT, "--dtype=float64"]
    ref = train_losses(f64, "cpu", tmp)
    checks = [("serial GPT", f64, 1)] + [(name, [*f64, *extra], 2)
                                         for name, extra in LAYOUTS.items()]
    env = {"HPCNN_STRICT_DEVICES": "1"} if device == "strict" else None   # 2 ranks share it
    for name, args, ranks in checks:
        try:
            ok, err = close(train_losses(args, device, tmp, ranks, env), ref, device,
                            rtol=1e-10 if device == "strict" else 1e-9, exact=ranks == 1)
            report(f"{name} on {device} vs serial NumPy (float64)", ok, f"losses {err:.1e}")
        except Exception as e:
            report(f"{name} on {device}", False, f"{type(e).__name__}: {e}")
    for precision in ("bf16", "fp16"):
        if precision == "bf16" and device == "gpu":
            report("bf16 on gpu", None, "CuPy has no bfloat16 (--precision=bf16 is refused "
                                        "with --device=gpu)")
            continue
        args = [*GPT, f"--precision={precision}"]
        try:
            ok, err = close(train_losses(args, device, tmp), train_losses(args, "cpu", tmp),
                            device, rtol=2e-2)
            report(f"{precision} on {device} vs NumPy {precision}", ok, f"losses {err:.1e}")
        except Exception as e:
            report(f"{precision} on {device}", False, f"{type(e).__name__}: {e}")


def peak(device: str) -> tuple[float, str]:
    """(the device's peak FLOP/s in the throughput run's precision, its source)."""
    if device == "strict":
        from hpcnn.plan.machine import this_machine
        m = this_machine()
        return m.device.rate("float32"), f"machine file {m.name}, float32"
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    for key, flops in PEAKS:
        if key in name:
            return flops, f"{name}, dense fp16 tensor cores (datasheet)"
    return float("nan"), f"{name}: not in the table of peaks"


def throughput(device: str, size: str, tmp: str) -> dict:
    """hpcnn's GPT of ``SIZES[size]`` in fp16 on ``device``: tokens/s, FLOP/s, peak share."""
    from hpcnn.train import train
    s = SIZES[size]
    log = os.path.join(tmp, "throughput.h5")
    args = ["--model=gpt", "--precision=fp16", "--eval_interval=0", "--progress=false",
            f"--log={log}", f"--log_interval={s['steps']}", f"--device={device}",
            *(f"--{k}={v}" for k, v in s.items())]
    try:
        out = train(parse_overrides(args))
    finally:
        backend.set_device("cpu")
    n = sum(int(p.size) for p in out["model"].params)
    step = float(np.median(read_run(log).metrics["step_time"][2:]))
    tokens = s["batch_size"] * s["block_size"] / step
    flops = tokens * (6 * n + 12 * s["n_layers"] * s["block_size"] * s["dim"])
    top, source = peak(device)
    return dict(tokens=tokens, flops=flops, share=flops / top, source=source, params=n,
                per_token=flops / tokens, vocab=int(out["model"].params[0].shape[0]))


def torch_gpt(vocab: int, s: dict):
    """The same GPT in plain ``torch.nn`` (pre-LN blocks: attention, 4x GELU MLP; tied to no
    weights), on CUDA."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln1, self.ln2, self.h = nn.LayerNorm(d), nn.LayerNorm(d), h
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).unbind(2)
            y = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))   # (B, T, C)
            return x + self.mlp(self.ln2(x))

    d, layers = s["dim"], s["n_layers"]
    model = nn.Sequential(nn.Embedding(vocab, d), *[Block(d, s["n_heads"]) for _ in range(layers)],
                          nn.LayerNorm(d), nn.Linear(d, vocab))
    return model.cuda(), torch


def torch_throughput(vocab: int, size: str) -> str:
    """The same model's training steps in PyTorch (fp16 autocast, fp32 master weights, AdamW,
    a loss scale), tokens/s; or why there is none."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch not installed"
    s = SIZES[size]
    model, torch = torch_gpt(vocab, s)
    if not torch.cuda.is_available():
        return "PyTorch without CUDA"
    pos = torch.nn.Parameter(torch.zeros(s["block_size"], s["dim"], device="cuda"))
    opt = torch.optim.AdamW([*model.parameters(), pos], lr=3e-4)
    scaler = torch.cuda.amp.GradScaler()
    x = torch.randint(0, vocab, (s["batch_size"], s["block_size"]), device="cuda")
    times = []
    for _ in range(s["steps"]):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):
            h = model[0](x) + pos
            for m in list(model)[1:]:
                h = m(h)
            loss = torch.nn.functional.cross_entropy(h.float().view(-1, vocab), x.view(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return f"{s['batch_size'] * s['block_size'] / float(np.median(times[2:])):,.0f} tokens/s"


def main(argv=None) -> int:
    ap = scripts.parser(__doc__)
    ap.add_argument("--device", default="auto", choices=("auto", "gpu", "strict"),
                    help="gpu (CuPy), strict (no GPU needed), auto: gpu where one is seen")
    ap.add_argument("--size", default="auto", choices=("auto", "full", "small"),
                    help="the throughput GPT: full on a GPU, small under strict (auto)")
    a = ap.parse_args(argv)
    device = pick_device(a.device)
    size = a.size if a.size != "auto" else "full" if device == "gpu" else "small"
    print(f"gpu-check on {device}" + (" (no GPU: NumPy behind a GPU's rules)"
                                      if device == "strict" else ""), flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        check_blocks(device)
        check_training(device, tmp)
        try:
            r = throughput(device, size, tmp)
            other = torch_throughput(r["vocab"], size) if device == "gpu" else \
                "not run without a GPU"
            report(f"throughput ({size} GPT, fp16, {r['params'] / 1e6:.1f} M parameters)", True,
                   f"{r['tokens']:,.0f} tokens/s, {r['flops'] / 1e12:.3f} TFLOP/s, "
                   f"{r['share']:.1%} of peak ({r['source']}); PyTorch: {other}")
        except Exception as e:
            report("throughput", False, f"{type(e).__name__}: {e}")
    failed = RESULTS.count("FAIL")
    print(f"gpu-check: {RESULTS.count('PASS')} passed, {failed} failed, "
          f"{RESULTS.count('SKIP')} skipped in {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
