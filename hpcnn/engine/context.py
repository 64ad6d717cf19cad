"""The run context: everything one rank needs to run its part of every training step.

A :class:`ParallelContext` owns the process grid and its data-, tensor- and pipeline-parallel
:class:`~hpcnn.parallel.collectives.Communicator` s, this rank's stages (built once), the schedule
list it runs each step, the data-parallel engine, the balancer of heterogeneous replicas, the
emulated slowdown and the rematerialization policy. A serial run is the 1 x 1 x 1 context over
one-rank communicators that never touch MPI, so the training loop (:mod:`hpcnn.train`) and the
step (:mod:`.step`) have no serial branch::

    ctx = ParallelContext(cfg, world)          # world: the MPI world communicator, or None (serial)
    task = ctx.build(build_task)               # the model holds this rank's stages only
    ctx.attach(task)                           # stages, engine, balancer, remat; then train
    ...
    ctx.free()
"""
from __future__ import annotations

import contextlib

import numpy

from hpcnn import to_stderr
from hpcnn.config import ConfigError
from hpcnn.engine.stage import Stage, attach_remat, boundary_shapes, build_stages
from hpcnn.nn.chain import Chain
from hpcnn.nn.optim import grad_norm_sq
from hpcnn.parallel.data import hetero
from hpcnn.schedule import stages as partition, pipeline
from hpcnn.parallel.collectives import CommStats, Communicator, gpu
from hpcnn.parallel.data.bucketed import NONBLOCKING, DataParallel, LocalGradients
from hpcnn.parallel.data.sharded import ShardedDataParallel, ShardedGradients, ShardedOptimizer
from hpcnn.parallel.data.zero3 import ShardedParameters


class ParallelContext:
    """One rank's side of a run of ``cfg`` (a resolved TrainConfig) on ``world`` (None: serial).

    Attributes: ``world``, ``dp``, ``tp``, ``pp`` (Communicators; ``dp`` is the data-parallel
    one), ``rank`` (world rank, for the log), ``stats`` (the step's communication counters),
    ``pipelined`` (pp > 1); after :meth:`attach`: ``stages``, ``ranges``, ``owner``, ``local``
    (the chain of this rank's blocks), ``engine``, ``balancer``, ``slowdown``, ``factors``,
    ``calibration``, ``remat``.
    """

    def __init__(self, cfg, world=None):
        from hpcnn.parallel.collectives import topology
        from hpcnn.parallel.collectives.grid import ProcessGrid
        self.cfg, self.stats = cfg, CommStats()
        topology.emulate(cfg.nodes or None)        # (before any communicator asks its node)
        try:                   # this rank's device and --gpu_comm, before anything is allocated
            self.gpu = gpu.start(cfg.device, cfg.gpu_comm, cfg.share_gpus, world)
        except gpu.DeviceRefusal as e:
            raise ConfigError(f"invalid configuration: {e}") from None
        self.grid = ProcessGrid(world, cfg.dp, cfg.tp, cfg.pp) if world is not None else None
        # every world rank's node, and the grid's groups that span nodes (tp should not)
        self.nodes = topology.node_map(world) if world is not None else [0]
        self.spanning = self.grid.spanning(self.nodes) if self.grid is not None else {}
        if self.grid is None:
            self.world, self.dp, self.tp, self.pp = (Communicator.single(n) for n in
                                                     ("world", "dp", "tp", "pp"))
        else:
            self.world = Communicator(world, CommStats(), "world")   # metadata: not counted
            self.dp = Communicator(self.grid.dp_comm, self.stats, "dp")
            self.tp = Communicator(self.grid.tp_comm, self.stats, "tp")
            self.pp = Communicator(self.grid.pp_comm, self.stats, "pp")
            gpu.attach(self.gpu, (self.dp, self.tp))     # device arrays' collectives
        self.rank = self.world.rank
        self.pipelined = cfg.pp > 1
        self.stages = self.ranges = self.owner = self.local = None
        self.engine = self.remat = self.calibration = None
        self.factors = [1.0] * self.dp.size
        self.peak_stage_bytes = 0
        self.tracing, self.traced = bool(cfg.show_schedule), None   # see hpcnn.schedule.expand
        self._lists, self._shapes = {}, {}

    # -- set-up -----------------------------------------------------------------------------------
    def build(self, build_task, data=None):
        """The task (``build_task(cfg, tp, data=..., keep=...)``); with pp > 1 its model holds
        storage for this rank's stages only: a first build without any (shapes, for the stage
        cut), then one keeping the local stages' parameters."""
        if self.cfg.model == "gcn":        # the graph's rows are split over the dp ranks
            return build_task(self.cfg, self.tp, data=data, graph_comm=self.dp)
        if not self.pipelined:
            return build_task(self.cfg, self.tp, data=data)
        shapes = build_task(self.cfg, self.tp, data=data, keep=())
        local = self._cut(shapes.model, shapes.micro_shape())
        return build_task(self.cfg, self.tp, data=shapes.data, keep=local)

    def _cut(self, model, micro_shape) -> set:
        """Stage ranges (``--layout``, else by cost) and owners; the names of this rank's
        stages' parameters."""
        cfg = self.cfg
        self.ranges = (partition.parse_layout(cfg.layout, len(model)) if cfg.layout
                       else partition.by_spec(model, micro_shape, cfg.pp * cfg.virtual))
        self.owner = pipeline.placement(cfg.schedule, len(self.ranges), self.pp.size)
        stages = build_stages(model, self.ranges, self.pp.rank, self.pp.size, self.owner)
        return {q.name for st in stages for q in st.chain.params}

    def attach(self, task) -> None:
        """Build this rank's stages once, the balancer, the data-parallel engine (broadcasting
        rank 0's parameters) and the remat policy (first sequences solved on every rank)."""
        cfg, model = self.cfg, task.model
        self.model, self.dtype = model, model.params[0].data.dtype   # of activations
        if self.pipelined:
            if self.ranges is None:
                self._cut(model, task.micro_shape())
            self.stages = build_stages(model, self.ranges, self.pp.rank, self.pp.size, self.owner)
            self.local = Chain([b for st in self.stages for b in st.chain.blocks], None,
                               name="stages")
        else:                       # one stage: the whole chain (same name, same remat keys)
            self.ranges, self.owner = [(0, len(model))], [0]
            self.stages, self.local = [Stage(0, model, 1)], model
        self.factors = hetero.slowdowns_from_config(cfg.slowdown, self.dp.size)
        self.slowdown = hetero.Slowdown(self.factors[self.dp.rank], cfg.slowdown_mode)
        speeds = hetero.parse_speeds(cfg.speeds, self.dp.size) if cfg.speeds else None
        self.balancer = hetero.Balancer(self.dp, cfg.batch_size, cfg.balance, speeds=speeds,
                                        rebalance_every=cfg.rebalance_every,
                                        min_share=cfg.microbatches if self.pipelined
                                        else cfg.grad_accum)
        if getattr(task, "shares", None) is not None:
            # a GCN: each rank's share is the rows --partition gave it (METIS's may be unequal)
            self.balancer.shares = numpy.array(task.shares, dtype=numpy.int64)
            self.balancer.history[0] = (0, self.balancer.shares.copy(), self.balancer.history[0][2])
        self._attach_engine()
        if cfg.remat != "none":
            from hpcnn.engine.remat import for_training
            self.remat = for_training(cfg, task, self)

    def _attach_engine(self) -> None:
        cfg = self.cfg
        if self.grid is None:
            self.engine = LocalGradients(self.local)
            return
        self._check_single_copy()
        engine = {1: ShardedDataParallel, 2: ShardedGradients, 3: ShardedParameters}.get(
            cfg.zero if self.dp.size > 1 else 0, DataParallel)
        self.engine = engine(self.local, self.dp, bucket_mb=cfg.bucket_mb,
                                   algorithm=cfg.allreduce,   # rd and cma block: no overlap
                                   overlap=cfg.overlap and not self.pipelined
                                   and cfg.allreduce in NONBLOCKING)
        if cfg.allreduce == "auto" and self.dp.size > 1:   # time (or load) only what it sends
            from hpcnn.parallel.collectives import autotune
            self.calibration = autotune.for_run(self.dp, self.engine.auto_sizes(), cfg.dtype)
            if self.rank == 0 and cfg.progress:
                print("".join(f"hpcnn: {x}\n" for x in autotune.describe(self.calibration)),
                      end="", flush=True)
        self.engine.broadcast_parameters()

    def optimizer(self, make):
        """The run's optimizer: ``make(params)`` over this rank's parameters, or with
        ``--zero`` >= 1 over dp > 1 ranks the sharded one (:mod:`hpcnn.parallel.data.sharded`)."""
        if isinstance(self.engine, ShardedDataParallel):
            return ShardedOptimizer(self.engine, make, self.local.params)
        if self.cfg.zero and self.rank == 0:
            to_stderr(f"hpcnn: note: --zero={self.cfg.zero} with dp=1 changes nothing: there is "
                      f"no other data-parallel rank to share the state with")
        return make(self.local.params)

    def whole_parameters(self, gather: bool = True, write_back: bool = False):
        """A context in which this rank's parameters are whole (at ZeRO-3 gathered for its body,
        collective over dp; see :meth:`hpcnn.parallel.data.zero3.ShardedParameters.whole`)."""
        if self.engine is None:
            return contextlib.nullcontext()
        return self.engine.whole(gather=gather, write_back=write_back)

    def _check_single_copy(self) -> None:
        """--allreduce=shm or cma: refuse on every rank, before training, replicas that cannot
        use it (spread over nodes; cma also needs the kernel's permission to read the peers'
        memory). Both probes are collective and give every rank the same answer."""
        algo = self.cfg.allreduce
        if algo not in ("shm", "cma") or self.dp.size == 1:
            return
        from hpcnn.parallel.collectives import cma, shm
        if shm.node_of(self.dp) is None:
            raise ConfigError(f"allreduce={algo!r} needs every data-parallel rank on one node "
                              f"(and HPCNN_SHM not 0); use --allreduce=auto")
        if algo == "cma" and not cma.available(self.dp):
            raise ConfigError("allreduce='cma': the kernel does not let these ranks read each "
                              "other's memory (process_vm_readv; see hpcnn info); use "
                              "--allreduce=shm or auto")

    # -- the step's schedule ----------------------------------------------------------------------
    def n_micro(self, rows: int) -> int:
        """Micro-batches of a step of ``rows`` local rows: the pipeline's, or ``grad_accum``
        (at most one per row)."""
        return self.cfg.microbatches if self.pipelined else min(self.cfg.grad_accum, rows)

    def schedule(self, n_micro: int) -> list:
        """This rank's instruction list for ``n_micro`` micro-batches (validated once, kept): the
        pipeline schedule's, or the one-stage ``F(0) B(0) F(1) B(1) ...``."""
        if n_micro not in self._lists:
            name = self.cfg.schedule if self.pipelined else "1f1b"
            n_stages = len(self.ranges)
            lists = pipeline.SCHEDULES[name](n_stages, n_micro, self.pp.size)
            pipeline.validate(lists, n_stages, n_micro, self.pp.size, self.owner)
            self._lists[n_micro] = lists[self.pp.rank]
        return self._lists[n_micro]

    def shapes(self, micro_shapes) -> list:
        """Each stage's input shape per micro-batch (:func:`.stage.boundary_shapes`), worked
        out once per set of micro-batch shapes (from the blocks' specs)."""
        key = tuple(tuple(s) for s in micro_shapes)
        if key not in self._shapes:
            self._shapes[key] = boundary_shapes(self.model, self.ranges, key)
        return self._shapes[key]

    def attach_remat(self, policy) -> None:
        """Each stage runs ``policy``'s sequences, its budget over its micro-batches in flight."""
        self.remat = policy
        attach_remat(self.stages, self.schedule(self.n_micro(self.cfg.batch_size)), policy,
                     self.cfg.schedule if self.pipelined else "1f1b")

    # -- after the backward -----------------------------------------------------------------------
    def replica_seconds(self, compute: float) -> float:
        """The compute time of this rank's data-parallel replica: its slowest tensor- or
        pipeline-parallel member's (the same float on all of them, so that the balancers of the
        replica's ranks, one per (tp, pp) position, measure alike and choose the same shares)."""
        if self.balancer.measured and self.tp.size * self.pp.size > 1:
            compute = float(self.tp.allreduce_scalars([compute], "max")[0])
            compute = float(self.pp.allreduce_scalars([compute], "max")[0])
        return compute

    def sync_replicated(self) -> None:
        """Sequence parallelism leaves partial gradients on replicated parameters: sum over tp."""
        if self.tp.size > 1 and self.cfg.sequence_parallel:
            from hpcnn.parallel.tensor.linear import sync_replicated_grads
            sync_replicated_grads(self.local.params, self.tp)

    def loss_everywhere(self, loss_sum: float) -> float:
        """The loss sum, known on the last stage's rank, on every pipeline rank."""
        if not self.pipelined:
            return loss_sum
        return float(self.pp.bcast(numpy.array([loss_sum]), root=self.owner[-1])[0])

    def grad_norm_sq(self, params) -> float:
        """Squared global gradient norm: tp shards summed over tp, replicated tensors once; at
        ZeRO-2 (``params``: this rank's parts) the parts summed over dp first."""
        if self.tp.size == 1:
            local = grad_norm_sq(params)
        else:
            sharded = [p for p in params if getattr(p, "tp_axis", None) is not None]
            replicated = [p for p in params if getattr(p, "tp_axis", None) is None]
            local = grad_norm_sq(sharded) + (grad_norm_sq(replicated) if self.tp.rank == 0
                                             else 0.0)
        if self.engine.shards_gradients:
            local = float(self.dp.allreduce_scalars([local])[0])
        if self.tp.size > 1:
            local = float(self.tp.allreduce_scalars([local])[0])
        return float(self.pp.allreduce_scalars([local])[0])

    def free(self) -> None:
        """Release the engine's shared buffers, the remat channel and the grid's communicators."""
        if self.engine is not None:
            self.engine.release()
            self.engine = None
        if self.remat is not None:
            self.remat.close()
        if self.grid is not None:
            gpu.detach(self.gpu, (self.dp, self.tp))
            self.grid.free()
