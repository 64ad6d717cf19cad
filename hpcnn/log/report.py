"""Figures and text summaries made from a run log (HDF5 only; never imports MPI).

::

    python -c "from hpcnn.log.report import make_report, summary; \\
               print(summary('runs/mlp.h5')); make_report('runs/mlp.h5')"
"""
from __future__ import annotations

import os

import numpy as np

from .runlog import RunData, read_run

THROUGHPUT_NAMES = ("samples_per_s", "samples_per_sec", "samples_s", "tokens_per_s", "throughput")


def log_kind(path) -> str:
    """What ``path`` holds: "run log" (:class:`hpcnn.log.RunLog`'s, readable by :func:`read_run`)
    or "checkpoint" (:mod:`hpcnn.checkpoint`'s: a root attribute ``format`` and no
    ``schema_version``); a ValueError of one line naming the path and what is wrong otherwise
    (missing, a directory, not HDF5, truncated or damaged, another HDF5 file)."""
    import h5py

    from . import journal
    from .runlog import _open
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{path}: a directory, not a run log")
    view = None
    try:
        view = journal.committed_view(path)        # as read_run reads it
        with (h5py.File(view, "r") if view is not None else _open(path, "r")) as f:
            attrs = set(f.attrs)
    except OSError as e:
        why = str(e).partition("(")[2].rstrip(")") or str(e)
        kind = "a damaged HDF5 file" if h5py.is_hdf5(path) else "not an HDF5 file"
        raise ValueError(f"{path}: {kind} ({why})") from None
    finally:
        if view is not None:
            view.close()
    if "schema_version" not in attrs:
        if {"format", "step", "layout"} <= attrs:
            return "checkpoint"
        raise ValueError(f"{path}: an HDF5 file but neither a run log nor a checkpoint")
    try:
        read_run(path)
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: a damaged run log ({' '.join(str(e).split())})") from None
    return "run log"


def _model_name(config: dict) -> str:
    """``config["model"]`` as a string, or its ``name`` when it is a nested dict; "" if absent."""
    model = config.get("model", config.get("model_name", ""))
    if isinstance(model, dict):
        model = model.get("name", model.get("kind", ""))
    return str(model)


def _finite(run: RunData, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(step, value)`` of a metric with the NaN (not logged) rows removed."""
    step, y = run.metrics["step"], run.metrics[name]
    keep = np.isfinite(y)
    return step[keep], y[keep]


def _names(run: RunData, test) -> list[str]:
    return sorted(k for k in run.metrics if k != "step" and test(k) and np.isfinite(run.metrics[k]).any())


def _accuracy_names(run: RunData) -> list[str]:
    return _names(run, lambda k: "acc" in k)


def _best_test_accuracy(run: RunData) -> tuple[str, float] | None:
    """The test accuracy metric (``test_*`` first, then ``val_*``/``eval_*``, then any) and its max."""
    names = _accuracy_names(run)
    for prefix in ("test", "val", "eval", ""):
        for name in names:
            if name.startswith(prefix):
                return name, float(np.nanmax(run.metrics[name]))
    return None


def summary(h5_path) -> str:
    """A few lines describing a run: steps, final loss, best test accuracy, median step time, status.

    Parameters
    ----------
    h5_path : str or os.PathLike
        Run log written by :class:`hpcnn.log.RunLog`.

    Returns
    -------
    str
    """
    run = read_run(h5_path)
    step = run.metrics.get("step", np.zeros(0, dtype=np.int64))
    model = _model_name(run.config)
    lines = [f"run      {run.path}" + (f" ({model})" if model else ""),
             f"status   {run.status}, world size {run.attrs.get('world_size', '?')}, "
             f"backend {run.attrs.get('backend', '?')}"]
    lines.append(f"steps    {len(step)}" + (f" (last step {int(step[-1])})" if len(step) else ""))
    if run.plan.get("divergence"):
        lines.append(f"warning  {run.plan['divergence']}")
    if "loss" in run.metrics and np.isfinite(run.metrics["loss"]).any():
        s, y = _finite(run, "loss")
        lines.append(f"loss     final {y[-1]:.6g} at step {int(s[-1])}, min {y.min():.6g}")
    best = _best_test_accuracy(run)
    if best is not None:
        lines.append(f"accuracy best {best[0]} {best[1]:.4f}")
    if "step_time" in run.metrics and np.isfinite(run.metrics["step_time"]).any():
        lines.append(f"time     median step_time {np.nanmedian(run.metrics['step_time']) * 1e3:.3f} ms")
    return "\n".join(lines + _memory_lines(run.plan))


MEMORY_PARTS = (("parameters", "param_bytes_per_rank"), ("gradients", "grad_bytes_per_rank"),
                ("optimizer", "optimizer_bytes_per_rank"),
                ("activations", "peak_activation_bytes_per_rank"))


def _memory_lines(plan: dict, shown: int = 8) -> list[str]:
    """One line per rank (the first ``shown``) of the bytes it held: parameters, gradients,
    optimizer state and scratch, peak activations, the float32 master copy of 16-bit parameters
    (the run's own account, :func:`hpcnn.engine.record.record_memory`), with the ZeRO stage
    when it shards (at stages 2 and 3 also the peak of the gradient buckets' storage, at stage
    3 that of the gathered blocks)."""
    if "param_bytes_per_rank" not in plan:
        return []
    zero = int(plan.get("zero", 0) or 0)
    masters = any(plan.get("master_bytes_per_rank") or ())
    parts = MEMORY_PARTS + ((("master copy", "master_bytes_per_rank"),) if masters else ()) \
        + ((("gradient buckets' peak", "grad_buffer_peak_bytes_per_rank"),) if zero >= 2 else ()) \
        + ((("gathered blocks' peak", "param_gather_peak_bytes_per_rank"),) if zero == 3 else ())
    got = [plan.get(key) or [] for _, key in parts]
    out = [f"memory   per rank{f' (zero {zero})' if zero else ''}, MiB: "
           + ", ".join(name for name, _ in parts)]
    for r in range(min(shown, len(got[0]))):
        out.append(f"         rank {r}: " + ", ".join(
            f"{float(g[r]) / 2**20:.1f}" if r < len(g) else "-" for g in got))
    if len(got[0]) > shown:
        out.append(f"         ({len(got[0]) - shown} more ranks in /plan)")
    return out


def _mib(nbytes) -> str:
    return f"{float(nbytes) / 2**20:.1f} MiB"


def _learning(run: RunData) -> str:
    """What the model learned: the last validation loss against the data's unigram entropy
    (text; a model that learns nothing sits at that entropy), or the last test accuracy."""
    for name in ("val_loss", "test_loss"):
        if name in run.metrics and np.isfinite(run.metrics[name]).any() and \
                "unigram_entropy_nats" in run.attrs:
            v, u = float(_finite(run, name)[1][-1]), float(run.attrs["unigram_entropy_nats"])
            side = "below" if v < u else "ABOVE"
            return f"{name} {v:.3f} nats, {abs(u - v):.2f} {side} the unigram entropy {u:.3f}"
    if "test_acc" in run.metrics and np.isfinite(run.metrics["test_acc"]).any():
        return f"test_acc {float(_finite(run, 'test_acc')[1][-1]):.3f}"
    if "loss" in run.metrics and np.isfinite(run.metrics["loss"]).any():
        return f"loss {float(_finite(run, 'loss')[1][-1]):.4g}"
    return "no metric logged"


def _remat_figures(run: RunData) -> str:
    """Budget, store-all peak, predicted and measured peaks, predicted and measured overheads.

    Predicted overhead: the sequence's simulated time over store-all's (rotor's cost model).
    Measured overhead: a rank's compute time over that time less its recomputed forwards
    (``remat_recompute_s_per_rank``, timed by the executor), the worst rank; a store-all run
    would run each forward once, so this is the time the plan costs on this machine."""
    plan = run.plan
    recs = plan.get("remat_plans") or []
    if not recs:
        return ""
    worst = max(recs, key=lambda r: r["predicted_time_s"] / max(r["store_all_time_s"], 1e-30))
    parts = [f"remat {plan.get('remat')}",
             f"budget {_mib(plan.get('memory_budget_bytes', 0))}" if plan.get("remat") == "optimal"
             else "", f"store-all {_mib(max(r['store_all_bytes'] * r['inflight'] for r in recs))}",
             f"predicted peak {_mib(max(r['predicted_peak_bytes'] * r['inflight'] for r in recs))}"]
    measured = plan.get("remat_measured_peak_bytes_per_rank")
    if measured:
        parts.append(f"measured peak {_mib(max(measured))}")
    parts.append(f"predicted overhead {worst['predicted_time_s'] / worst['store_all_time_s']:.2f}x")
    again = plan.get("remat_recompute_s_per_rank")
    if again and run.ranks and len(run.ranks.get("rank", ())):
        ratios = []
        for k, t in enumerate(again):
            compute = float(np.sum(run.ranks["compute_s"][run.ranks["rank"] == k]))
            if compute > t >= 0:
                ratios.append(compute / (compute - t))
        if ratios:
            parts.append(f"measured overhead {max(ratios):.2f}x")
    return ", ".join(p for p in parts if p)


def stopped_early(run: RunData) -> str:
    """A run's status with the steps it did (its metrics' last step + 1) and, when its config
    names them, the steps it planned: "interrupted after 3 of 100 steps"."""
    step = run.metrics.get("step", ())
    done = int(step[-1]) + 1 if len(step) else 0
    planned = int(run.config.get("steps") or 0)
    return (f"{run.status or 'no status'} after {done}" + (f" of {planned}" if planned else "")
            + f" step{'' if done == 1 and not planned else 's'}")


def headline(h5_path) -> str:
    """The one line of figures a run exists to show: what it learned (against the unigram
    entropy, or its accuracy), its layout and median throughput, and for a rematerialized run
    the memory budget, peaks and overheads (:func:`_remat_figures`); first, unless the run
    finished, its status and steps done (:func:`stopped_early`). ``make demo`` prints it."""
    run = read_run(h5_path)
    plan, parts = run.plan, [_learning(run)]
    if run.status != "finished":
        parts.insert(0, stopped_early(run))
    if plan.get("divergence"):
        parts.insert(0, plan["divergence"])
    layout = f"dp={plan.get('dp', 1)} x tp={plan.get('tp', 1)} x pp={plan.get('pp', 1)}"
    if int(plan.get("zero", 0) or 0):
        layout += f" zero {int(plan['zero'])}"
    if int(plan.get("pp", 1)) > 1:
        layout += f" ({plan.get('schedule')}, {plan.get('microbatches')} micro-batches)"
    parts.append(layout)
    if "samples_per_s" in run.metrics and np.isfinite(run.metrics["samples_per_s"]).any():
        parts.append(f"median {np.nanmedian(run.metrics['samples_per_s']):,.0f} samples/s")
    peaks = plan.get("peak_activation_bytes_per_rank")
    if peaks:
        parts.append("peak activations per rank " + "/".join(_mib(b) for b in peaks))
    remat = _remat_figures(run)
    if remat:
        parts.append(remat)
    return f"{os.path.basename(str(h5_path))}: " + "; ".join(parts)


def _draw_panel(ax, run: RunData, title: str, names: list[str]) -> None:
    """One panel of :func:`make_report`: the metrics ``names`` against the step (step time in ms
    with its median; the loss on a log scale, with the unigram entropy of a text run)."""
    for name in names:
        s, y = _finite(run, name)
        scale = 1e3 if name == "step_time" else 1.0
        ax.plot(s, y * scale, marker="o" if len(s) < 30 else None, ms=3, label=name)
        if name == "step_time":
            med = float(np.median(y)) * scale
            ax.axhline(med, color="k", ls="--", lw=1)
            ax.annotate(f"median {med:.3g} ms", xy=(0.98, 0.95), xycoords="axes fraction",
                        ha="right", va="top")
    if title == "loss" and "unigram_entropy_nats" in run.attrs:
        ax.axhline(float(run.attrs["unigram_entropy_nats"]), color="gray", ls=":", lw=1.2,
                   label="unigram entropy")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel({"step time": "ms", "throughput": "per second"}.get(title, title))
    if title == "loss" and all(np.nanmin(run.metrics[k]) > 0 for k in names):
        ax.set_yscale("log")
    ax.legend(loc="best", fontsize="small")
    ax.grid(True, alpha=0.3)


def make_report(h5_path, png_path=None) -> str:
    """Draw the training curves of one run into a PNG (matplotlib, Agg backend).

    Panels, each only when its data exist: loss (every metric whose name contains ``loss``),
    accuracy (names containing ``acc``), ``step_time`` with its median, and throughput
    (``samples_per_s`` or a similar name).

    Parameters
    ----------
    h5_path : str or os.PathLike
        Run log written by :class:`hpcnn.log.RunLog`.
    png_path : str or os.PathLike, optional
        Output file; default: ``h5_path`` with the suffix ``.png``.

    Returns
    -------
    str
        The PNG path.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = read_run(h5_path)
    png_path = os.fspath(png_path) if png_path is not None else os.path.splitext(run.path)[0] + ".png"
    panels = []
    for title, names in (("loss", _names(run, lambda k: "loss" in k)),
                         ("accuracy", _accuracy_names(run)),
                         ("step time", _names(run, lambda k: k == "step_time")),
                         ("throughput", _names(run, lambda k: k in THROUGHPUT_NAMES))):
        if names:
            panels.append((title, names))
    n = max(len(panels), 1)
    ncols = 1 if n == 1 else 2
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.6 * nrows), squeeze=False)
    for ax, (title, names) in zip(axes.flat, panels):
        _draw_panel(ax, run, title, names)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if not panels:
        axes.flat[0].text(0.5, 0.5, "no metrics logged", ha="center", va="center")
    model = _model_name(run.config)
    fig.suptitle(f"{model or os.path.basename(run.path)}  [{run.status}]")
    return save_figure(fig, png_path, dpi=100)


def save_figure(fig, path, *, rect=None, dpi: int = 110) -> str:
    """Lay ``fig`` out (within ``rect``, figure fractions), write it to ``path``, close it;
    returns ``path``. The analysis scripts' figures all end here; a missing folder is made."""
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


GANTT_COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green", "compute": "tab:blue",
                "optimizer": "tab:gray", "allreduce": "tab:purple", "allreduce_wait": "tab:purple",
                "alltoall": "tab:red", "held": "tab:brown"}


def step_events(run: RunData, step: int = -1) -> dict:
    """One step of a run's ``/timeline``: ``{rank: [(kind, microbatch, t_start, t_end), ...]}``,
    each rank's times from its own first event of that step (a measured run logs each rank's
    own clock: the clocks of two ranks are not aligned; a rank whose step begins by waiting
    starts with that wait, a RECV); a predicted log's times as they are (one clock). A measured run's ranks each end a step with their
    ``optimizer`` event: step ``step`` (Python index: -1 the last, 0 the first, which includes
    warm-up) is what lies between two of them; a log without such events (a predicted one) is
    one step."""
    t = run.timeline
    if not t or len(t.get("rank", ())) == 0:
        raise ValueError(f"{run.path}: the run log has no timeline events")
    per_rank = {}
    for r in sorted(set(t["rank"].tolist())):
        rows = np.flatnonzero(t["rank"] == r)
        rows = rows[np.argsort(t["t_start"][rows], kind="stable")]
        steps, cur = [], []
        for i in rows:
            cur.append((str(t["kind"][i]), int(t["microbatch"][i]), float(t["t_start"][i]),
                        float(t["t_end"][i])))
            if cur[-1][0] == "optimizer":
                steps, cur = steps + [cur], []
        steps += [cur] if cur else []
        try:
            per_rank[r] = steps[step]
        except IndexError:
            raise ValueError(f"{run.path}: rank {r} logged {len(steps)} steps, no step {step}") \
                from None
    if run.attrs.get("predicted"):          # one clock: the prediction's, from 0
        return per_rank
    return {r: [(k, mb, a - evs[0][2], b - evs[0][2]) for k, mb, a, b in evs]
            for r, evs in per_rank.items()}


def _draw_gantt(ax, events: dict, title: str) -> float:
    """Rank r's events as bars on row r (colour by kind, communication hatched); returns the
    step's span in seconds."""
    from hpcnn.log.chrome import category
    end = max(e[3] for evs in events.values() for e in evs)
    seen = set()
    for r, evs in events.items():
        for kind, mb, a, b in evs:
            comm = category(kind) == "communication"
            color = GANTT_COLORS.get(kind, "tab:red" if comm else "tab:cyan")
            label = kind if kind not in seen else None
            seen.add(kind)
            ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (r - 0.4, 0.8), facecolors=color,
                           edgecolor="k", linewidth=0.3, hatch="//" if comm else None,
                           label=label)
            if kind in ("F", "B", "W") and (b - a) > end / 60 and mb >= 0:
                ax.text((a + b) / 2 * 1e3, r, str(mb), ha="center", va="center", fontsize=6)
    ax.set_yticks(sorted(events))
    ax.set_yticklabels([f"rank {r}" for r in sorted(events)])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1e3 * 1.01)
    ax.set_xlabel("ms")
    ax.set_title(f"{title}: {end * 1e3:.3g} ms")
    return end


def gantt_report(measured_path, predicted_path, png_path, step: int = -1) -> dict:
    """The predicted and the measured step drawn side by side as two Gantt charts in one PNG
    (matplotlib, Agg): the predicted log's timeline (``hpcnn simulate --model=... --log``) on
    the left, step ``step`` of the measured run (:func:`step_events`) on the right, each on its
    own time axis. Returns ``{"path", "titles", "ranks", "span_s"}``: what was drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("predicted", step_events(read_run(predicted_path))),
              (f"measured (step {step})", step_events(read_run(measured_path), step))]
    n_ranks = max(len(ev) for _, ev in panels)
    fig, axes = plt.subplots(1, 2, figsize=(13, 2.4 + 0.45 * n_ranks), squeeze=False)
    spans = [_draw_gantt(ax, ev, title) for ax, (title, ev) in zip(axes.flat, panels)]
    fig.suptitle(f"{os.path.basename(str(predicted_path))} vs {os.path.basename(str(measured_path))}")
    legend = {}
    for ax in axes.flat:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=10, fontsize="small")
    save_figure(fig, png_path, rect=(0, 0.1 + 0.1 / n_ranks, 1, 0.93))
    return {"path": os.fspath(png_path), "titles": [t for t, _ in panels],
            "ranks": [sorted(ev) for _, ev in panels], "span_s": spans}
