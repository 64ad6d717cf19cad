"""Two checkouts of hpcnn, one process: the run log's flush of each, timed in alternation.

    git archive <old-commit> | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python benchmarks/runlog_ab.py /tmp/old . [--rounds=60] [--dir=/tmp]

Both copies of :mod:`hpcnn.log.runlog` are imported side by side (as in
``benchmarks/serial_step_ab.py``); every round logs 10 steps (``flush_every=10``: one flush) into
each variant's own file, in alternating order, and times the flush (``last_flush_s``). Variants:
the old copy, and the new copy with ``durable=False`` (no fsync) and ``durable=True`` (the
default, two fsyncs per flush) when it has that option. Workloads per step: 6 metrics; plus 8
rank rows and 32 timeline events; plus 64 rank rows and 256 events. Prints each variant's median
flush time, its cost per step, and its ratio to the old copy (the median of per-round ratios).
The files go to ``--dir`` (the file system measured) and are removed after.
"""
import inspect
import os
import statistics
import tempfile

from hpcnn import scripts

WORKLOADS = {"6 metrics": (0, 0), "+8 ranks, 32 events": (8, 32), "+64 ranks, 256 events": (64, 256)}
FLUSH_EVERY = 10


def load(root: str):
    """The ``hpcnn.log.runlog`` module of the checkout at ``root``."""
    return scripts.checkout_modules(root, "hpcnn.log.runlog")[0]


def variants(old, new) -> dict:
    """name -> (module, extra RunLog keywords)."""
    out = {"old": (old, {})}
    if "durable" in inspect.signature(new.RunLog).parameters:
        out["new, no fsync"] = (new, {"durable": False})
        out["new, fsync"] = (new, {"durable": True})
    else:
        out["new"] = (new, {})
    return out


def log_flush(log, step0: int, ranks: int, events: int) -> float:
    """Log ``FLUSH_EVERY`` steps from ``step0`` (one flush); return the flush's seconds."""
    for s in range(step0, step0 + FLUSH_EVERY):
        if ranks:
            log.log_ranks(s, [{"rank": r, "compute_s": 0.1, "comm_s": 0.01, "idle_s": 0.0,
                               "bytes_sent": 1000, "peak_mem_bytes": 2**20} for r in range(ranks)])
            log.log_events([(e % ranks, "F", e, s + 0.001 * e, s + 0.001 * e + 0.0005)
                            for e in range(events)])
        log.log_metrics(s, loss=1.0 / (s + 1), lr=0.1, step_time=0.01, samples_per_s=1e4,
                        train_acc=0.5, grad_norm=1.0)
    return log.last_flush_s


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("old", help="the old checkout's folder")
    ap.add_argument("new", help="the new checkout's folder")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--dir", default=None, help="where the log files go (the file system "
                    "measured); default: the system's temporary folder")
    return ap


def main(argv=None) -> None:
    a = parser().parse_args(argv)
    rounds = a.rounds
    old, new = load(a.old), load(a.new)
    var = variants(old, new)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        print(f"{rounds} rounds, flush_every={FLUSH_EVERY}, files in {tmp}; median flush ms "
              f"(per step), ratio to old")
        for wname, (ranks, events) in WORKLOADS.items():
            logs = {v: mod.RunLog(os.path.join(tmp, f"{wname[:3]}-{i}.h5"), {"bench": v},
                                  command_line="bench", flush_every=FLUSH_EVERY, **kw)
                    for i, (v, (mod, kw)) in enumerate(var.items())}
            times = {v: [] for v in var}
            order = list(var)
            for r in range(rounds + 2):
                for v in (order if r % 2 else order[::-1]):
                    t = log_flush(logs[v], r * FLUSH_EVERY, ranks, events)
                    if r >= 2:                      # the first two rounds: warm-up
                        times[v].append(t)
            for log in logs.values():
                log.close()
            line = []
            for v in var:
                med = statistics.median(times[v])
                ratio = statistics.median(a / b for a, b in zip(times[v], times["old"]))
                line.append(f"{v} {med * 1e3:.2f} ({med * 1e3 / FLUSH_EVERY:.3f}/step) x{ratio:.2f}")
            print(f"{wname:>22}: " + " | ".join(line))


if __name__ == "__main__":
    main()
