"""Two checkouts of hpcnn, one process: the serial training step of each, timed in alternation.

Timing two commits in two processes mixes their difference with whatever the machine did
between the runs (on a shared machine: several percent). Here both copies of the package are
imported side by side (the second import replaces the first in ``sys.modules``, but the first
copy's functions keep their own module globals) and every round times one step of each, in
alternating order, on the same data: the ratio of the medians is the change, at equal load.

    git archive <old-commit> | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    OMP_NUM_THREADS=1 python benchmarks/serial_step_ab.py /tmp/old . [--rounds=40]

Models as in ``benchmarks/serial_step.py``: MLP 4 x Linear(1024, 1024) with ReLU, batch 256;
GPT-tiny 4 blocks, dim 128, 4 heads, context 64, vocab 81, batch 32; float32, SGD with momentum.
Prints, per model, each copy's median step time and new/old (the median of the per-round ratios
too). A lazy import inside a step's code path would run the second copy's module for both: the
step path (blocks, Chain, SGD) has none.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import inspect  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from hpcnn import scripts  # noqa: E402


def load(root: str):
    """The ``hpcnn.nn.models`` and ``hpcnn.nn.optim`` modules of the checkout at ``root``."""
    return scripts.checkout_modules(root, "hpcnn.nn.models", "hpcnn.nn.optim")


def steps(models, optim) -> dict:
    """model name -> a function running one training step of that copy's model."""
    rng = np.random.default_rng(0)
    mlp = models.mlp(1024, [1024] * 3, 1024, seed=0)
    gpt = models.gpt(81, 64, 4, 128, 4, seed=0)
    data = {"mlp": (mlp, rng.standard_normal((256, 1024)).astype(np.float32),
                    rng.integers(0, 1024, 256)),
            "gpt": (gpt, rng.integers(0, 81, (32, 64)), rng.integers(0, 81, (32, 64)))}
    out = {}
    # Chain.backward(dloss, caches) now; older copies took (caches, dloss=1.0)
    dloss_first = list(inspect.signature(type(mlp).backward).parameters)[1] == "dloss"
    for name, (model, x, y) in data.items():
        opt = optim.SGD(model.params, momentum=0.9)

        def step(model=model, x=x, y=y, opt=opt):
            model.zero_grad()
            loss, caches = model.forward(x, y)
            if dloss_first:
                model.backward(1.0, caches, need_dx=False)
            else:
                model.backward(caches, need_dx=False)
            opt.step(1e-3)
        out[name] = step
    return out


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("old", help="the old checkout's folder")
    ap.add_argument("new", help="the new checkout's folder")
    ap.add_argument("--rounds", type=int, default=40, help="N >= 1")
    return ap


def main(argv=None) -> None:
    ap = parser()
    a = ap.parse_args(argv)
    roots, rounds = [a.old, a.new], a.rounds
    if rounds < 1:
        ap.error(f"--rounds={rounds}: expected N >= 1")
    copies = {"old": steps(*load(roots[0])), "new": steps(*load(roots[1]))}
    print(f"old={roots[0]} new={roots[1]} rounds={rounds} "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    for model in ("mlp", "gpt"):
        fns = {v: copies[v][model] for v in copies}
        for fn in fns.values():
            for _ in range(3):
                fn()
        times = {v: [] for v in fns}
        for r in range(rounds):
            for v in (("old", "new") if r % 2 == 0 else ("new", "old")):
                t = time.perf_counter()
                fns[v]()
                times[v].append(time.perf_counter() - t)
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        paired = statistics.median(b / a for a, b in zip(times["old"], times["new"]))
        print(f"{model}: old {old * 1e3:.2f} ms, new {new * 1e3:.2f} ms per step, "
              f"new/old {new / old:.4f} (median of per-round ratios {paired:.4f})")


if __name__ == "__main__":
    main()
