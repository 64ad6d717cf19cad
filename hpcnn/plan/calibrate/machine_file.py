"""The whole calibration and the machine file it writes.

:func:`measure` runs every measurement of ``hpcnn calibrate --write`` on the ranks at hand, in
order: rank 0's device figures alone (:mod:`.device`), the sustained rates alone and all at once
(:mod:`.shared`), the network level (:mod:`.links`); where the node holds more ranks than cores
also the optimizer all at once (:mod:`.update`), the collectives after compute and, on the
figures so far, the scales of training through the step engine (:mod:`.scale`) and the
pipelines' handoff (:mod:`.contention`). :func:`machine_of` makes the
:class:`~hpcnn.plan.machine.Machine` of what it returned, :func:`machine_text` the machine file
(header comments with the raw figures, then the TOML).

    mpiexec -n 2 python -m mpi4py -m hpcnn calibrate --write machines/local.toml

or, from code, on every rank of ``comm`` (an MPI communicator)::

    from hpcnn.plan.calibrate import machine_text, measure
    text = machine_text(measure(comm, rounds=3), "local", comm.Get_size())
"""
from __future__ import annotations

import platform
import time
from dataclasses import replace

from hpcnn.plan.calibrate.contention import HANDOFF_MICRO, HANDOFF_ROUNDS, after_compute_points
from hpcnn.plan.calibrate.contention import handoff_points
from hpcnn.plan.calibrate.device import cpu_name, device_rates, memory_bytes
from hpcnn.plan.calibrate.links import SIZES, allreduce_times, fit_level, fit_reduce, pingpong
from hpcnn.plan.calibrate.scale import layout_scale
from hpcnn.plan.calibrate.shared import (SUSTAIN_ROUNDS, SUSTAIN_S, cores_here, shared_figures,
                                         sustained_medians)
from hpcnn.plan.calibrate.timing import (COLD_REPEATS, DTYPES, FULL_ROUNDS, agree, counted,
                                         in_proportion, quiet_barrier)
from hpcnn.plan.calibrate.update import UPDATE_OPTIMIZERS, update_costs, update_repeats
from hpcnn.plan.machine import Device, Machine


def measure(comm, rounds: int = FULL_ROUNDS) -> dict:
    """Everything ``calibrate --write`` records, the same dict on every rank: "alone" (rank 0 by
    itself) and "together" (:func:`shared_figures`: what a rank gets while all compute) device
    figures, "sizes" and one-way "seconds", "reduce_sizes" and allreduce "reduce_seconds" (both
    None on one rank), "cold" (whether those were timed cold: not when this node holds more
    ranks than cores, :mod:`.links`), "ranks_here" (ranks sharing this node's
    memory), "cpu"; where the ranks share cores, "update" (:func:`update_costs` all at once),
    "after_compute" (:func:`after_compute_points`), "compute_scale", "collective_scale" and
    "group_scales" (:func:`layout_scale`) and "handoff" (:func:`handoff_points`, on the device
    slowed by "compute_scale"), else None."""
    calls = counted(comm)
    rank, size = calls.rank, calls.size
    ranks_here = int(calls.allreduce_scalars([calls.ranks_on_node()], "max")[0])
    cold = agree(calls, ranks_here <= cores_here())
    repeats = in_proportion(COLD_REPEATS, rounds)            # as many at the default 15 rounds
    window = SUSTAIN_S * min(1.0, rounds / FULL_ROUNDS)
    alone = device_rates(rounds) if rank == 0 else None
    quiet_barrier(calls)                      # the others sleep while rank 0 times alone
    alone = calls.bcast_object(alone, root=0)
    together = shared_figures(alone, *sustained_medians(          # engine: a core per rank
        comm, window, not cold, in_proportion(SUSTAIN_ROUNDS, rounds), cold and size > 1))
    seconds = pingpong(comm, cold=cold, repeats=repeats) if size > 1 else None
    reduce = allreduce_times(comm, cold=cold, repeats=repeats) if size > 1 else None
    meas = {"alone": alone, "together": together, "sizes": list(SIZES),
            "seconds": seconds, "reduce_sizes": list(SIZES[1:]), "reduce_seconds": reduce,
            "cold": cold, "ranks_here": ranks_here,
            "cpu": calls.bcast_object(cpu_name(), root=0),
            "handoff": None, "update": None, "after_compute": None, "compute_scale": None,
            "collective_scale": None, "group_scales": None}
    if size > 1 and not cold:             # ranks share cores: what a blocking exchange waits
        meas["update"] = {opt: update_costs(opt, repeats=update_repeats(rounds), comm=comm)
                          for opt in UPDATE_OPTIMIZERS}
        meas["after_compute"] = after_compute_points(comm)
        meas["compute_scale"], meas["collective_scale"], meas["group_scales"] = layout_scale(
            comm, machine_of(meas, "calibrating", size))
        meas["handoff"] = calls.bcast_object(handoff_points(  # on the device slowed as fitted
            comm, machine_of(meas, "calibrating", size), min(1.0, cores_here() / ranks_here),
            rounds=in_proportion(HANDOFF_ROUNDS, rounds)), root=0)
    return meas


def _kinds(rates: dict, table: str) -> dict:
    """{kind: figure} of the ``table`` ("efficiency", "overhead", ...) entries of device_rates()
    (a figure or a tuple of them), to four significant digits (a piece's size kept whole)."""
    def digits(v):
        if isinstance(v, tuple):
            return tuple(digits(x) for x in v)
        return v if v >= 1024 else float(f"{v:.4g}")
    return {k.split(".", 1)[1]: digits(v) for k, v in rates.items() if k.startswith(table + ".")}


def machine_of(meas: dict, name: str, size: int) -> Machine:
    """The machine of what :func:`measure` returned on ``size`` ranks: one level "node" of
    fan-out ``size`` (none on one rank), its handoff and collectives after compute where
    measured, over the all-at-once device (its optimizer figures timed all at once where
    measured so, else rank 0's alone slowed as :func:`shared_figures` says), slowed by the
    "compute_scale" where measured (:func:`~.scale.layout_scale`).

    The transformer's tokens slowdown where each rank has a core, and where ranks share cores
    once its ladder's bottom rung was timed all at once (``engine_low``,
    :func:`~.shared._shared_tokens`); the linear kind's rows slowdown everywhere
    (:func:`~.passes.rows_costs`)."""
    tog = meas["together"]
    device = Device(name=meas["cpu"], flops={dt: tog[dt] for dt in DTYPES},
                    memory_bandwidth=tog["copy"],
                    memory_bytes=memory_bytes(meas["ranks_here"]),
                    efficiency=_kinds(tog, "efficiency"), overhead=_kinds(tog, "overhead"),
                    elementwise=_kinds(tog, "elementwise"), activation=_kinds(tog, "activation"),
                    forward=_kinds(tog, "forward"),
                    split=_kinds(tog, "split"),
                    tokens={k: v for k, v in _kinds(tog, "tokens").items()
                            if meas.get("cold", True) or k == "linear"
                            or f"engine_low.{k}" in tog},
                    update=_kinds({f"update.{k}": v for k, v in meas["update"].items()}, "update")
                    if meas.get("update") else _kinds(tog, "update")
                    ).slowed(meas.get("compute_scale") or 1.0)
    levels = ()
    if size > 1:
        node = fit_level(meas["sizes"], meas["seconds"], size)
        levels = (replace(node, reduce_bandwidth=fit_reduce(
            meas["reduce_sizes"], meas["reduce_seconds"], size, node.latency_s),
            after_compute={k: tuple((float(f"{c:.4g}"), b, float(f"{t:.4g}")) for c, b, t in v)
                           for k, v in (meas.get("after_compute") or {}).items()},
            collective_scale=meas.get("collective_scale") or 1.0,
            group_scales=tuple(meas.get("group_scales") or ()),
            **handoff_fields(meas.get("handoff"))),)
    source = (f"hpcnn calibrate --write on {size} rank(s), {platform.node()}, "
              f"{time.strftime('%Y-%m-%d %H:%M')}")
    return Machine(name=name, levels=levels, device=device, source=source)


def handoff_fields(handoff) -> dict:
    """The level's ``handoff`` and ``bubble_weight`` from what :func:`handoff_points` returned
    (None: none measured)."""
    if not handoff:
        return {}
    points, weight = handoff
    return {"handoff": tuple(map(tuple, points)), "bubble_weight": weight}


def _device_line(tog: dict, alone: dict) -> str:
    """The machine file's comment on how the all-at-once device figures ``tog`` were had from
    rank 0's ``alone`` (:func:`shared_figures`)."""
    kinds = _kinds(tog, "slowdown")           # the blocks' own factors, where ranks share cores
    engine = _kinds(tog, "engine")            # the step engine's GPT (its ladder's top rung)
    low = _kinds(tog, "engine_low")          # ranks share cores: the tokens ladder's bottom rung
    ladder = "".join(f"the {k} tokens ladder's bottom rung x{v:.2f} (top x{engine[k]:.2f}); "
                     for k, v in low.items() if k in engine)
    blocks = ("each block kind's figures by its reference blocks' (ranks share cores): "
              + ", ".join(f"{k} x{v:.2f}" for k, v in kinds.items()) + "; " + ladder if kinds
              else "".join(f"the {k} element-wise seconds by the step engine's GPT x{v:.2f}, "
                           for k, v in engine.items()) + "the other element-wise seconds by ")
    return ("# Device: what each rank gets while all ranks compute at once: rank 0's figures "
            "alone, slowed by the sustained rates' ratio alone / all at once (slowest rank, medians"
            f" of alternated windows), x{tog['slowdown']:.2f}, {blocks}the copy "
            f"x{alone['copy'] / tog['copy']:.2f} (calibrate.shared.shared_figures).")


def machine_text(meas: dict, name: str, size: int) -> str:
    """The machine file for what :func:`measure` returned on ``size`` ranks: header comments with
    the raw figures, then :meth:`Machine.to_toml` of :func:`machine_of`."""
    tog, alone = meas["together"], meas["alone"]
    head = [f"# Measured by `hpcnn calibrate --write` on {size} rank(s) "
            f"({meas['ranks_here']} sharing this node's memory).", _device_line(tog, alone),
            "# Alone (rank 0 by itself): " + ", ".join(
                f"matmul {dt} {alone[dt] / 1e9:.1f} GFLOP/s" for dt in DTYPES)
            + f", copy {alone['copy'] / 1e9:.1f} GB/s; all at once: " + ", ".join(
                f"{dt} {tog[dt] / 1e9:.1f}" for dt in DTYPES)
            + f", copy {tog['copy'] / 1e9:.1f}.",
            "# Blocks (float32, sizes in hpcnn/plan/calibrate/blocks.py): efficiency "
            f"alone {_kinds(alone, 'efficiency')}, all at once {_kinds(tog, 'efficiency')}; "
            f"overhead alone {_kinds(alone, 'overhead')}, all at once {_kinds(tog, 'overhead')}; "
            f"elementwise alone {_kinds(alone, 'elementwise')}, all at once "
            f"{_kinds(tog, 'elementwise')}; activation (a ReLU's output) alone "
            f"{_kinds(alone, 'activation')}, all at once {_kinds(tog, 'activation')}; forward "
            f"share {_kinds(alone, 'forward')}; backward "
            f"halves (input, weight) {_kinds(alone, 'split')}.",
            "# Optimizer step alone, seconds per float32 parameter at [max_params, s]: "
            + "; ".join(f"{k} {list(v)}" for k, v in _kinds(alone, "update").items()) + "."]
    if meas["seconds"]:
        head.append(("# Cold (each call after a copy of 64 MiB and a barrier)" if meas.get("cold")
                     else "# Back to back (more ranks than cores here)")
                    + " ping-pong, all pairs at once, one-way median of the slowest pair: "
                    + ", ".join(f"{s} B {t * 1e6:.1f} us" for s, t in
                                zip(meas["sizes"], meas["seconds"])) + ".")
        head.append("# MPI allreduce (float32 sum, in place) over all ranks, median of the slowest "
                    "rank: " + ", ".join(f"{s} B {t * 1e6:.1f} us" for s, t in
                                         zip(meas["reduce_sizes"], meas["reduce_seconds"]))
                    + ".")
    else:
        head.append("# One rank: no network level was measured.")
    if meas.get("update"):
        head.append("# Optimizer step all ranks at once (ranks share cores; slowest rank), seconds "
                    "per float32 parameter at [max_params, s]: " + "; ".join(
                        f"{k} {[(n, float(f'{t:.4g}')) for n, t in v]}"
                        for k, v in meas["update"].items()) + " (calibrate.update.update_costs).")
    if meas.get("after_compute"):
        head.append("# Collectives after compute (ranks share cores): see [levels.after_compute] "
                    "(calibrate.contention.after_compute_points); in training through the step "
                    "engine (reference MLPs and GPTs), the device's seconds took "
                    f"{meas.get('compute_scale') or 1.0:.3g}x the figures above (compute_scale: "
                    "the [device] figures below are slowed so), the layout executor's "
                    f"collectives {meas.get('collective_scale') or 1.0:.3g}x the curves"
                    + "".join(f", {k:.3g}x those over groups of {n}"
                              for n, k in meas.get("group_scales") or ())
                    + " (collective_scale, group_scales, calibrate.scale.layout_scale).")
    if meas.get("handoff") is not None:
        points, weight = meas["handoff"]
        head.append(f"# Handoff (ranks share cores): 1F1B pipelines over the {size} ranks, each "
                    f"with {size} and {HANDOFF_MICRO * size} micro-batches, ran as priced with a "
                    "wait per exchange of " + ", ".join(
                        f"{h * 1e6:.1f} us after {c * 1e3:.3g} ms passes" for c, h in points)
                    + f" and their fill and drain at {weight:.2f} of their length "
                    "(calibrate.contention.handoff_points).")
    return "\n".join(head) + "\n\n" + machine_of(meas, name, size).to_toml()
