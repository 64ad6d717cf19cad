"""``hpcnn train --model=gpt --plan=auto``: the hybrid layout of the run, chosen by the planner.

:func:`choose_gpt_layout` prices every dp x tp x pp x schedule x micro-batches layout of the GPT
the run builds (:mod:`.hybrid`: its width, heads, layers, ``block_size``, global ``batch_size``,
``--dtype``, and the vocabulary as :func:`hpcnn.task.padded_vocab` pads it for each candidate's
tp) over the run's world size on the machine file (``--machine``, default
:func:`.machine.this_machine`), and returns the configuration with the least predicted step that
fits the device memory. It is a pure function of the configuration, the vocabulary, the machine
file and the world size: every rank computes it, identically, before the process grid exists.

It offers only what ``hpcnn train`` runs as priced:

- **remat none or full** (the planner's ``full`` is what ``--remat=full`` runs,
  :func:`hpcnn.plan.hybrid.recomputed_forward`); ``--remat=none`` leaves the choice free,
  ``--remat=full`` keeps only those layouts, ``sqrt`` and ``optimal`` are refused
  (:mod:`hpcnn.config`);
- **one micro-batch without a pipeline** (pp = 1 runs the whole local batch at once);
- **schedules 1f1b, gpipe, zb_h1**, one stage per rank, each candidate passing the run's own
  option checks (:func:`hpcnn.config.combination_errors`);
- **stage cuts**: each pipelined choice uniform (cut by cost, :func:`hpcnn.schedule.stages.
  by_spec`) and with the planner's own cut (:func:`.hybrid.stage_cut`), the latter run as
  ``--layout`` (transformer blocks per stage, plus the embedding on the first stage and the
  final LayerNorm and LM head on the last, as :func:`hpcnn.nn.models.gpt` orders the chain);
- **the machine must hold the ranks**: a machine file with fewer devices than the world size is
  refused; with more, the ranks are its first ``world_size`` devices.

Options the user set constrain the search instead of being overwritten: ``--dp``, ``--tp``,
``--pp``, ``--microbatches`` other than 1 and ``--schedule`` other than 1f1b keep only the layouts
that have them (their defaults mean "free"); a ``--layout`` keeps only the pipelined layouts of as
many stages, each priced with that cut.
"""
from __future__ import annotations

import dataclasses

FREE_DEFAULTS = {"dp": 1, "tp": 1, "pp": 1, "microbatches": 1, "schedule": "1f1b"}


def load_machine(cfg):
    """The machine file ``--machine`` names, else this machine's; ConfigError naming it."""
    from hpcnn.config import ConfigError
    from hpcnn.plan import machine
    try:
        return machine.load(cfg.machine) if cfg.machine else machine.this_machine()
    except ValueError as e:
        raise ConfigError(f"invalid configuration: plan='auto' machine={cfg.machine!r}: "
                          f"{e}") from None


def _given(cfg) -> dict:
    """The layout options the user set (those not at their default, which means free)."""
    return {k: getattr(cfg, k) for k, v in FREE_DEFAULTS.items() if getattr(cfg, k) != v}


def _matches(lay, given: dict) -> bool:
    for k, v in given.items():
        if k == "schedule":
            if lay.pp > 1 and lay.schedule != v:
                return False
        elif getattr(lay, k) != v:
            return False
    return True


def chain_layout(stages) -> str:
    """``--layout`` of the GPT's whole chain for transformer blocks per stage: the first stage
    holds the embedding too, the last the final LayerNorm and the LM head."""
    sizes = [int(n) for n in stages]
    sizes[0] += 1
    sizes[-1] += 2
    return "|".join(map(str, sizes))


def transformer_stages(layout: str) -> tuple:
    """The transformer blocks per stage of a GPT's ``--layout`` (:func:`chain_layout` undone)."""
    sizes = [int(n) for n in layout.split("|")]
    sizes[0] -= 1
    sizes[-1] -= 2
    return tuple(sizes)


def candidates(cfg, world_size: int, vocab: int, machine):
    """(layout, the run's config with it, the Transformer priced for it) for every layout of the
    GPT on ``world_size`` devices of ``machine`` that ``hpcnn train`` runs as the planner prices
    it and that matches the options the user set (module docstring)."""
    from hpcnn.config import combination_errors, option_errors
    from hpcnn.plan import hybrid
    from hpcnn.config import padded_vocab
    shape = dict(n_layers=cfg.n_layers, dim=cfg.dim, n_heads=cfg.n_heads, seq=cfg.block_size,
                 batch=cfg.batch_size, dtype=cfg.dtype)
    given = _given(cfg)
    cut = transformer_stages(cfg.layout) if cfg.layout else None
    remat = ("full",) if cfg.remat == "full" else ("none", "full")
    for lay in hybrid.layouts(hybrid.Transformer(vocab=vocab, **shape), world_size,
                              remat=remat, machine=machine, zero=(cfg.zero,),
                              schedules=hybrid.ONE_STAGE_PER_RANK,   # (one stage a rank,
                              allow={"sequence_parallel": {False}}):  # priced without SP)
        if (lay.pp == 1 and lay.microbatches != 1) or not _matches(lay, given):
            continue
        if cut is not None and not (lay.stages and len(cut) == lay.pp and min(cut) >= 1
                                    and sum(cut) == cfg.n_layers):
            continue
        run = dataclasses.replace(cfg, dp=lay.dp, tp=lay.tp, pp=lay.pp, remat=lay.remat)
        if lay.pp > 1:
            run = dataclasses.replace(run, schedule=lay.schedule, microbatches=lay.microbatches)
        model = hybrid.Transformer(vocab=padded_vocab(vocab, run), **shape)
        if lay.stages:      # cut for the vocabulary the run pads, or as the user gave it
            lay = dataclasses.replace(lay, stages=cut or hybrid.stage_cut(model, lay, machine))
            run = dataclasses.replace(run, layout=chain_layout(lay.stages))
        if option_errors(run) or combination_errors(run):
            continue
        yield lay, run, model


def choose_gpt_layout(cfg, world_size: int, vocab: int, machine=None):
    """(the config with the chosen dp, tp, pp, schedule, micro-batches and, for a planned stage
    cut, ``--layout``, the record for the run log's ``/plan/hybrid_layout``: ``stage_layout`` is
    that ``--layout``, "" for a uniform one cut by cost); ConfigError with one line when the machine file cannot be
    read, holds fewer devices than ``world_size``, or no layout fits (module docstring)."""
    from hpcnn.config import ConfigError
    from hpcnn.plan import hybrid
    mach = machine if machine is not None else load_machine(cfg)
    where = f"plan='auto' on {world_size} rank(s)"
    if world_size > mach.p:
        raise ConfigError(f"invalid configuration: {where}: the machine file {mach.name!r} holds "
                          f"{mach.p} device(s); pass --machine=FILE describing at least "
                          f"{world_size} (see machines/)")
    priced = [(hybrid.price(model, lay, mach), run)
              for lay, run, model in candidates(cfg, world_size, vocab, mach)]
    shape = (f"the gpt (n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, "
             f"batch_size={cfg.batch_size})")
    if not priced:
        given = dict(_given(cfg), **({"layout": repr(cfg.layout)} if cfg.layout else {}))
        given = ", ".join(f"{k}={v}" for k, v in given.items()) or "none"
        raise ConfigError(f"invalid configuration: {where}: no layout of {shape} that hpcnn "
                          f"train runs (tp dividing n_heads, pp up to n_layers, dp x "
                          f"microbatches dividing batch_size, remat none or full, a layout's "
                          f"stages holding the embedding, >= 1 transformer block each and the "
                          f"final LayerNorm and LM head) matches the options given ({given})")
    feasible = [q for q in priced if q[0].feasible]
    if not feasible:
        least = min(q.memory_bytes for q, _ in priced)
        raise ConfigError(f"invalid configuration: {where}: none of the {len(priced)} layouts "
                          f"of {shape} fits the {mach.device.memory_bytes / 2**20:.4g} MiB per "
                          f"device of {mach.name!r} (the least needs {least / 2**20:.4g} MiB "
                          f"per rank)")
    best, run = min(feasible, key=lambda q: q[0].step_s)      # the first of equals: stable
    lay = best.layout
    record = {"layout": str(lay), "dp": lay.dp, "tp": lay.tp, "pp": lay.pp,
              "schedule": lay.schedule, "microbatches": lay.microbatches, "remat": lay.remat,
              "stage_layout": run.layout if lay.stages else "",
              "chosen_by": f"least predicted step on {mach.name}",
              "predicted_step_s": float(best.step_s),
              "predicted_memory_bytes_per_rank": float(best.memory_bytes),
              "layouts_considered": len(priced), "layouts_feasible": len(feasible),
              "machine": cfg.machine or mach.name}
    return run, record


__all__ = ["candidates", "chain_layout", "choose_gpt_layout", "load_machine",
           "transformer_stages"]
