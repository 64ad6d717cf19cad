"""The training loop's rematerialization policy: ``--remat {none,sqrt,full,optimal} --memory_budget``.

One :class:`RematPolicy` per rank picks, per (chain, input shape), the sequence its chain runs and
keeps its :class:`~.executor.Executor`:

- ``sqrt``: uniform checkpointing in ⌈√blocks⌉ segments (:func:`.sequence.segments`), no budget;
- ``full``: a segment per block (the same function): every block's input kept, every forward but
  the last block's (which runs with the loss) run again in the backward, no budget; what the
  planner's ``remat="full"`` prices (:mod:`hpcnn.plan.hybrid`);
- ``optimal``: rotor's sequence (:class:`.rotor.Solver`, spec-based profile, roofline times with
  rates calibrated once at start-up) within the budget; with ``offload_gbps`` > 0, the combined
  remat + offloading heuristic (:mod:`.combine`) through a file channel (NumPy) or pinned host
  memory (CuPy).

The budget covers the activations, caches and gradients of one forward+backward (the account of
:mod:`.executor`), per rank. A pipeline stage with k micro-batches in flight solves each for
budget / k, so that k paused micro-batches and one running stay within the budget. Every choice
is recorded (:attr:`RematPolicy.records`) for the run log's ``/plan``.
"""
from __future__ import annotations

import time

import numpy

from hpcnn import backend
from hpcnn.config import ConfigError
from hpcnn.schedule.ops import fmt
from hpcnn.memory import combine, profile, rotor
from hpcnn.schedule import sequences
from hpcnn.memory.executor import Executor
from hpcnn.memory.simulate import simulate

MODES = ("none", "sqrt", "full", "optimal")


class RematPolicy:
    """``mode`` (none | sqrt | full | optimal), the per-rank ``budget_bytes``, rotor's ``slots``, the
    offload link's ``offload_gbps`` (0: no offloading) and the roofline ``rates`` (default:
    :func:`.profile.calibrate` at the first solve). False when ``mode`` is none."""

    def __init__(self, mode: str, budget_bytes: float = 0.0, *, slots: int = 500,
                 offload_gbps: float = 0.0, rates: profile.Rates | None = None):
        if mode not in MODES:
            raise ValueError(f"remat={mode!r}: expected one of {MODES}")
        if mode == "optimal" and not budget_bytes > 0:
            raise ValueError(f"remat='optimal' needs a memory budget > 0, got {budget_bytes}")
        if offload_gbps < 0 or (offload_gbps > 0 and mode != "optimal"):
            raise ValueError(f"offload_gbps={offload_gbps}: must be >= 0, and > 0 only with "
                             f"remat='optimal' (got remat={mode!r})")
        self.mode, self.budget, self.slots = mode, float(budget_bytes), int(slots)
        self.bandwidth = offload_gbps * 1e9
        self.rates = rates
        self.records: list[dict] = []
        self.measured_peak = 0
        self._cache: dict = {}
        self._channel = None

    def __bool__(self) -> bool:
        return self.mode != "none"

    def executor(self, chain, x_shape, *, need_dx: bool = True, inflight: int = 1) -> Executor:
        """The executor for ``chain`` on inputs of ``x_shape``, solved once and cached by the
        chain's name (a pipeline rebuilds its stage sub-chains each step; they share blocks)."""
        key = (chain.name, len(chain), tuple(x_shape), need_dx, int(inflight))
        if key not in self._cache:
            self._cache[key] = self._build(chain, tuple(x_shape), need_dx, int(inflight))
        return self._cache[key]

    def _build(self, chain, x_shape, need_dx, inflight):
        if self.mode == "optimal" and self.rates is None:
            dtype = chain.params[0].data.dtype if chain.params else "float32"
            self.rates = profile.calibrate(dtype)
        prof = profile.of_chain(chain, x_shape, need_dx=need_dx, rates=self.rates)
        t0 = time.perf_counter()
        budget, channel = None, None
        if self.mode in ("sqrt", "full"):
            seq = sequences.segments(len(prof), len(prof) if self.mode == "full" else None,
                                    has_loss=chain.loss is not None)
        else:
            budget = self.budget / inflight
            solver = rotor.Solver(prof, self.slots)
            try:
                if self.bandwidth > 0:
                    sol = combine.solve(prof, budget, self.bandwidth, solver=solver)
                else:
                    sol = solver.solve(budget)
            except rotor.InfeasibleBudget as e:
                raise rotor.InfeasibleBudget(
                    f"{chain.name} on input {x_shape} ({inflight} micro-batch(es) in flight): {e}",
                    e.budget, e.minimum) from None
            seq = sol.sequence
            if any(op.kind == "OFF" for op in seq):
                channel = self._open_channel()
        sim = simulate(seq, prof, bandwidth=self.bandwidth or None, budget=budget)
        self.records.append({
            "chain": chain.name, "x_shape": list(x_shape), "policy": self.mode,
            "offload_gbps": self.bandwidth / 1e9, "inflight": inflight,
            "budget_bytes": budget or 0.0, "predicted_peak_bytes": float(sim.peak),
            "store_all_bytes": float(prof.store_all_bytes()),
            "predicted_time_s": float(sim.time), "store_all_time_s": prof.store_all_time,
            "recomputed_forwards": sequences.recomputations(seq),
            "solve_s": time.perf_counter() - t0,
            "sequence": fmt(seq)})
        return Executor(chain, seq, channel=channel, need_dx=need_dx, prof=prof, budget=budget)

    def _open_channel(self):
        if self._channel is None:
            from hpcnn.memory.offload import OffloadChannel
            self._channel = OffloadChannel("auto")
        return self._channel

    @property
    def recompute_seconds(self) -> float:
        """Wall time this rank spent running forwards again (every executor, every pass): the
        measured cost of rematerialization, which a store-all run would not pay."""
        return float(sum(ex.recompute_seconds for ex in self._cache.values()))

    def note_peak(self, peak: int) -> None:
        self.measured_peak = max(self.measured_peak, int(peak))

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def for_training(cfg, task, ctx) -> RematPolicy:
    """The training loop's policy (``cfg`` a resolved TrainConfig, ``ctx`` the run's
    :class:`hpcnn.engine.context.ParallelContext`, its stages built), attached to the stages,
    with the first step's sequences solved on every rank. An infeasible budget on any rank is
    raised on all of them, with every rank's message, before training communicates."""
    policy = RematPolicy(cfg.remat, cfg.memory_budget * 2**20, offload_gbps=cfg.offload_gbps)
    if cfg.remat == "optimal" and ctx.world.size > 1:
        # one set of rates for every rank: tensor-parallel peers must run the same sequence
        # (a recomputed forward repeats its collectives), so they must solve the same problem
        rates = profile.calibrate(backend.dtype_of(cfg.dtype)) if ctx.rank == 0 else None
        policy.rates = ctx.world.bcast_object(rates, root=0)
    err, rows = "", 0
    balancer = ctx.balancer
    moving = balancer.measured and ctx.dp.size > 1
    try:
        from hpcnn.parallel.data.bucketed import shard
        ctx.attach_remat(policy)
        # measured shares move: plan for the most a replica can get
        rows = (cfg.batch_size - (ctx.dp.size - 1) * balancer.min_share if moving else
                len(shard(numpy.arange(cfg.batch_size), balancer.shares, ctx.dp.rank)))
        _solve_first(policy, task, ctx, rows)
    except ValueError as e:
        err = str(e) + (f" (with --balance=proportional and measured speeds a replica may get "
                        f"up to {rows} of the {cfg.batch_size} rows)" if moving else "")
    bad = [f"rank {r}: {m}" for r, m in enumerate(ctx.world.allgather_objects(err)) if m]
    if bad:
        policy.close()
        raise ConfigError("--remat/--memory_budget: " + "; ".join(bad))
    return policy


def _solve_first(policy, task, ctx, rows: int) -> None:
    """Solve the sequences of this rank's stages for a step of ``rows`` local rows (what the
    first step's F's would solve), so that an infeasible budget shows before training."""
    from hpcnn.engine.stage import boundary_shapes
    x, _ = task.global_batch(0)
    sizes = [len(a) for a in numpy.array_split(numpy.arange(rows), ctx.n_micro(rows))]
    shapes = boundary_shapes(task.model, ctx.ranges, [(m,) + tuple(x.shape[1:]) for m in sizes])
    for st in ctx.stages:
        for mb in range(len(sizes)):
            policy.executor(st.chain, shapes[mb][st.index], need_dx=not st.first,
                            inflight=st.inflight)
