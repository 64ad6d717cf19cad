"""What a run trains on: the data, the model built from the config, and how to draw and score batches.

:func:`build_task` loads the data set a resolved :class:`~hpcnn.config.TrainConfig` names and builds
its model (sharded over a tensor-parallel communicator when given); :class:`Task` draws a step's
global batch (a pure function of seed and step) and scores the held-out data (:class:`GraphTask`:
the GCN's full-batch steps on the graph's rows). The training loop
(:mod:`hpcnn.train`) and the start-up checks (:mod:`hpcnn.preflight`) both build through here::

    task = build_task(parse_overrides(["--model=mlp"]).resolved())
    x, y = task.global_batch(0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy

from hpcnn import backend
from hpcnn import datasets
from hpcnn.config import TrainConfig, padded_vocab
from hpcnn.nn import models, precision
from hpcnn.nn.transformer import check_tokens

TEXT_DEFAULT_STEPS = 1000
VAL_SEED = 2**31 - 1          # validation windows are the same for every run


@dataclass
class Task:
    """What a run trains on: the data, the model, and how to draw and score batches."""

    cfg: TrainConfig
    data: object
    model: object
    steps: int
    layout: dict | None = None        # --plan: the cut of each Linear, who chose it, its price
    hybrid: dict | None = None        # GPT --plan=auto: the chosen layout, who chose it, its price
    divergence: object = None         # the run's watch on its loss (hpcnn.engine.record.Divergence)
    scaler: object = None             # fp16: the run's loss scaler (hpcnn.nn.precision.LossScaler)

    @property
    def is_text(self) -> bool:
        return isinstance(self.data, datasets.TextData)

    def global_batch(self, step: int):
        """Host arrays (x, y) of the whole global batch of ``step`` (rows = samples/sequences)."""
        c = self.cfg
        if self.is_text:
            return datasets.text_batch(self.data.train, c.batch_size, c.block_size, step, c.seed)
        idx = datasets.batch_indices(len(self.data.y_train), c.batch_size, step, c.seed)
        if c.shard == "skewed":       # class-skewed shards: neighbouring ranks see different classes
            idx = idx[numpy.argsort(self.data.y_train[idx], kind="stable")]
        return self.data.x_train[idx], self.data.y_train[idx]

    def micro_shape(self) -> tuple:
        """Input shape of one pipeline micro-batch (for the stage partition by cost)."""
        c = self.cfg
        n = max(1, c.batch_size // (c.dp * c.microbatches))
        return (n, c.block_size) if self.is_text else (n,) + tuple(self.data.x_train.shape[1:])

    def _logits(self, x, ctx=None, batch_size=None):
        """Eval-mode outputs of the whole chain (through the pipeline when pp > 1, where only
        the last stage's rank gets them: None elsewhere)."""
        if ctx is None or not ctx.pipelined:
            return self.model.predict(x, batch_size=batch_size)
        from hpcnn.engine.pipelined import forward_only
        self.model.eval()
        try:
            return forward_only(self.model, ctx.ranges, ctx.pp, x, owner=ctx.owner)
        finally:
            self.model.train()

    def to_device(self, x, y):
        """The host batch (x, y) on the device; a text batch's ids checked first, on the host
        (the blocks check them on host arrays only: :func:`~hpcnn.nn.transformer.check_tokens`)."""
        if self.is_text and backend.xp is not numpy:
            for ids in (x, y):
                check_tokens("batch", ids, ids.shape[-1], self.data.vocab)
        dtype = None if self.is_text else precision.storage_dtype(self.cfg)
        return backend.asarray(x, dtype=dtype), backend.asarray(y)

    def eval_sums(self, ctx=None, stop=None) -> numpy.ndarray | None:
        """[loss sum, correct, count] over this data-parallel rank's share of the held-out data
        (``ctx`` the run's context, None: all of it; with pp > 1 computed on the last stage,
        broadcast over the pipeline). ``stop``: a collective callable asked after each round
        of text batches (one per data-parallel rank; every rank asks as often); when it says
        so the evaluation is given up and None returned. At ZeRO-3 the parameters are
        gathered whole for it (the ranks evaluate different numbers of batches)."""
        if ctx is None:
            return self._eval_sums(None, stop)
        with ctx.whole_parameters():
            return self._eval_sums(ctx, stop)

    def _eval_sums(self, ctx, stop) -> numpy.ndarray | None:
        m, c = self.model, self.cfg
        rank, size = (ctx.dp.rank, ctx.dp.size) if ctx is not None else (0, 1)
        tot = numpy.zeros(3)
        if self.is_text:
            for first in range(0, c.eval_batches, size):
                i = first + rank
                if i < c.eval_batches:
                    x, y = datasets.text_batch(self.data.val, c.batch_size, c.block_size, i,
                                               VAL_SEED)
                    logits = self._logits(backend.asarray(x), ctx)
                    if logits is not None:
                        loss = m.loss.forward(logits, backend.asarray(y))[0]
                        tot += [float(backend.to_host(loss)) * y.size, 0.0, y.size]
                if stop is not None and stop():
                    return None
        else:
            part = numpy.array_split(numpy.arange(len(self.data.y_test)), size)[rank]
            if len(part):
                x, y = self.to_device(self.data.x_test[part], self.data.y_test[part])
                logits = self._logits(x, ctx, batch_size=512)
                if logits is not None:
                    correct = float(backend.to_host((logits.argmax(axis=-1) == y).sum()))
                    loss = float(backend.to_host(m.loss.forward(logits, y)[0]))
                    tot += [loss * len(part), correct, len(part)]
        if ctx is not None and ctx.pipelined:
            ctx.pp.bcast(tot, root=ctx.owner[-1])
        return tot


@dataclass
class GraphTask(Task):
    """The :class:`Task` of a GCN (data: :mod:`hpcnn.graph.nodes`): every step's batch is the
    whole graph, its rows ordered by owner rank (``order``: rank 0's nodes, then rank 1's, ...,
    each increasing), so that the step's contiguous data-parallel shares (``shares``: the rows
    per rank) hand rank r exactly the nodes ``--partition`` gave it; the evaluation scores the
    test nodes of this rank's rows. ``rows``: the global nodes this rank holds.
    A run on a coarsened graph (``data.full`` set) evaluates on the full graph: ``eval_op``
    holds this rank's rows of the full Â (contiguous rows, whatever ``--partition``), swapped
    into the GraphConv blocks for the evaluation (the weights do not depend on the node
    count)."""
    rows: numpy.ndarray = None
    eval_op: object = None
    order: numpy.ndarray = None
    shares: numpy.ndarray = None

    def global_batch(self, step: int):
        return self.data.features[self.order], self.data.targets()[self.order]

    def eval_sums(self, ctx=None, stop=None) -> numpy.ndarray:
        """[test loss sum, correct, count] over the test nodes among this rank's rows (every
        rank must call it: the forward exchanges halos). ``stop`` is not asked: one forward."""
        from hpcnn.nn.loss import SoftmaxCrossEntropy
        d, rows, convs = self.data, self.rows, [b for b in self.model.blocks if hasattr(b, "op")]
        train_op = convs[0].op
        if d.full is not None:
            d, rows = d.full, self.eval_op.halo.rows
            for b in convs:
                b.op = self.eval_op
        try:
            is_test = numpy.isin(rows, d.test)
            x, y = self.to_device(d.features[rows], numpy.where(is_test, d.labels[rows], -1))
            logits = self.model.predict(x)                                 # (n_local, classes)
        finally:
            for b in convs:
                b.op = train_op
        nll = SoftmaxCrossEntropy(ignore_index=-1, reduction="sum").forward(logits, y)[0]
        correct = float(backend.to_host((logits.argmax(axis=1) == y).sum()))   # y = -1: never
        return numpy.array([nll, correct, float(is_test.sum())])


def with_spectral_features(data, k: int, graph_comm=None):
    """``data`` with U_k of the full graph's Â appended to its features (:mod:`hpcnn.graph.
    spectral`; on a coarse graph, the group means of the full graph's rows): computed by the
    distributed Lanczos over the ranks of ``graph_comm`` (each rank its contiguous rows, then
    gathered) or on one process, sign-normalised, so the same either way to the solver's
    tolerance. The unit eigenvectors are scaled by sqrt(n), to a root mean square of 1 per
    column, the scale of standardised features (unscaled, their entries ~ 1/sqrt(n) would be
    drowned by features of unit scale). -> (the new data, the record for /plan)."""
    import time
    from dataclasses import replace
    from hpcnn.graph.rows import RowPartition
    from hpcnn.graph.spectral import spectral_embedding
    t0 = time.perf_counter()
    full = data.full if data.full is not None else data
    size = 1 if graph_comm is None else graph_comm.size
    raw = graph_comm.comm if size > 1 else None
    part = RowPartition.contiguous(full.n_nodes, size)
    _, u, rows, res = spectral_embedding(full.adjacency, k, raw, part, tol=1e-12)
    vectors = numpy.empty((full.n_nodes, k))
    for r, v in ([(rows, u)] if size == 1 else graph_comm.allgather_objects((rows, u))):
        vectors[r] = v
    vectors *= numpy.sqrt(full.n_nodes)
    full = replace(full, features=numpy.hstack([full.features, vectors]))
    record = {"spectral_features": k, "spectral_ranks": size, "spectral_matvecs": res.matvecs,
              "spectral_s": time.perf_counter() - t0}
    if data.full is None:
        return full, record
    return replace(data, features=data.coarsening.mean_features(full.features), full=full), record


def graph_partition(cfg, a_hat, graph_comm=None):
    """(the :class:`~hpcnn.graph.rows.RowPartition` ``cfg.partition`` names over the ranks of
    ``graph_comm``, the seconds it took). Rank 0 computes it and broadcasts the owner vector: a
    spectral bisection's floating-point ties could otherwise fall differently on different
    ranks, and the others would wait for it anyway. The partitioners see the graph's adjacency
    pattern (Â without its diagonal: A itself for an unweighted graph); ``random`` draws with
    ``cfg.seed``."""
    import time
    from hpcnn.graph.rows import RowPartition
    from hpcnn.graph.partitioners import partition
    size = 1 if graph_comm is None else graph_comm.size
    n, seconds = a_hat.shape[0], 0.0
    if size == 1 or cfg.partition == "contiguous":
        return RowPartition.contiguous(n, size), seconds
    owner, error = numpy.empty(n, dtype=numpy.int64), None
    if graph_comm.rank == 0:
        t0 = time.perf_counter()
        try:
            adjacency = a_hat.tolil()
            adjacency.setdiag(0)
            adjacency = adjacency.tocsr()
            adjacency.eliminate_zeros()
            owner[:] = partition(adjacency, size, cfg.partition, seed=cfg.seed).owner
        except (ValueError, ImportError, ArithmeticError) as e:      # every rank raises it
            error = f"partition={cfg.partition!r} of {n} nodes over {size} ranks failed: {e}"
        seconds = time.perf_counter() - t0
        if cfg.progress and error is None:
            print(f"hpcnn: {cfg.partition} partition of {n} nodes over {size} ranks in "
                  f"{seconds:.2f} s", flush=True)
    seconds, error = graph_comm.bcast_object((seconds, error), root=0)
    if error is not None:
        raise ValueError(error)
    graph_comm.bcast(owner, root=0)
    return RowPartition.from_parts(owner, size), float(seconds)


def build_graph_task(cfg, data, graph_comm=None, keep=None) -> GraphTask:
    """The GCN of ``cfg`` (``--hidden`` widths) on ``data``, its rows split over ``graph_comm``
    (an hpcnn Communicator; None or one rank: the whole graph) by ``--partition``
    (:func:`graph_partition`; of the coarse graph when ``--coarsen``). The task's ``layout``
    (logged under ``/plan`` ``operator_layout``) records the partition: its kind and seconds,
    rows per rank, the edge cut (stored entries of Â joining two ranks: twice the cut edges),
    halo rows per rank and halo bytes per layer (each direction, all ranks together); and under
    ``preprocessing`` what was done to the data (``--spectral_features``: k, ranks, matvecs,
    seconds; ``--coarsen``: the method, the node counts and ratio, the coarse training nodes,
    seconds)."""
    from hpcnn.graph.rows import RowPartition
    from hpcnn.nn.gcn import GraphOperator, gcn
    dtype = backend.dtype_of(cfg.dtype)
    size = 1 if graph_comm is None else graph_comm.size
    preprocessing = dict(data.record)
    if cfg.spectral_features:
        data, record = with_spectral_features(data, cfg.spectral_features, graph_comm)
        preprocessing.update(record)
    eval_op = None if data.full is None else GraphOperator.from_global(
        data.full.a_hat, RowPartition.contiguous(data.full.n_nodes, size), graph_comm, dtype)
    part, seconds = graph_partition(cfg, data.a_hat, graph_comm)
    op = GraphOperator.from_global(data.a_hat, part, graph_comm, dtype)
    model = gcn(op, data.features.shape[1], cfg.hidden, data.n_classes, n_train=data.train.size,
                n_nodes=data.n_nodes, seed=cfg.seed, dtype=dtype, keep=keep)
    ghosts = ([op.n_ghost] if size == 1 else
              [int(g) for g in graph_comm.allgather_objects(op.n_ghost)])
    widths = [b.n_out for b in model.blocks if hasattr(b, "op")]
    layout = {"graph_partition": cfg.partition if size > 1 else "contiguous", "ranks": size,
              "partition_seconds": seconds,
              "rows_per_rank": part.counts().tolist(), "edge_cut": part.edge_cut(data.a_hat),
              "halo_rows_per_rank": ghosts,
              "halo_bytes_per_layer": [sum(ghosts) * w * dtype.itemsize if size > 1 else 0
                                       for w in widths], "preprocessing": preprocessing}
    steps = cfg.steps or max(1, math.ceil(cfg.epochs))
    return GraphTask(cfg, data, model, steps, layout=layout, rows=op.halo.rows, eval_op=eval_op,
                     order=numpy.argsort(part.owner, kind="stable"), shares=part.counts())


def metrics_from_sums(sums, is_text: bool) -> dict:
    loss = float(sums[0] / max(sums[2], 1))
    return {"val_loss": loss} if is_text else {"test_loss": loss, "test_acc": float(sums[1] / sums[2])}


def _laid_out_mlp(cfg, data, comm, dtype, keep):
    """--plan: the MLP with each Linear laid out as the plan file says, or as the planner chooses
    for this batch and these widths (``auto``); returns the model and ``{"cuts", "chosen_by",
    "predicted_step_s"}`` for the log's /plan."""
    from hpcnn.parallel.collectives import Communicator
    from hpcnn.parallel.layout import layout_mlp
    from hpcnn.schedule.placement import read_plan
    comm = comm if comm is not None else Communicator.single("tp")
    dims = [data.x_train.shape[1], *cfg.hidden, data.n_classes]
    info = {"chosen_by": f"plan file {cfg.plan}", "predicted_step_s": float("nan")}
    if cfg.plan == "auto":
        cuts, info = _auto_cuts(cfg, dims, comm.size)
    else:
        cuts = read_plan(cfg.plan, devices=comm.size)
    model = layout_mlp(dims[0], cfg.hidden, dims[-1], cuts, comm, seed=cfg.seed, dtype=dtype,
                       keep=keep)
    return model, dict(info, cuts=[[c.batch, c.reduce, c.out] for c in cuts])


def _auto_cuts(cfg, dims, p: int):
    """The least BSP price on this machine's file (:func:`hpcnn.plan.machine.this_machine`) over
    every per-Linear cut when the file holds p devices and the combinations are few; else the
    double recursive algorithm's greedy choice (SAPP's volumes, no machine needed)."""
    from hpcnn.plan import cost, machine, search
    graph = cost.mlp_graph(dims, cfg.batch_size)
    try:
        here = machine.this_machine().with_devices(p)
    except ValueError:
        here = None
    best = search.least_price(graph, p, here, cfg.dtype) if here is not None else None
    if best is not None:
        return best[0], {"chosen_by": f"least BSP price on {here.name}",
                         "predicted_step_s": float(best[1])}
    return search.dra(graph, p)[0], {"chosen_by": "double recursive algorithm (SAPP)",
                                     "predicted_step_s": float("nan")}


def build_task(cfg: TrainConfig, tp_comm=None, data=None, keep=None, graph_comm=None) -> Task:
    """Load the data (unless given) and build the model named by a resolved config (sharded
    over ``tp_comm``; a GCN's graph rows split over ``graph_comm``). ``keep``: the names of the
    parameters given storage (None: all; the others are placeholders: a pipeline rank keeps its
    own stages', ``()`` builds shapes only). Parameters and activations are stored in
    ``--precision``'s 16 bits when it is bf16 or fp16 (:mod:`hpcnn.nn.precision`)."""
    dtype = precision.storage_dtype(cfg)
    tp = tp_comm is not None and tp_comm.size > 1
    data = data if data is not None else datasets.for_config(cfg)
    if cfg.model == "gcn":
        return build_graph_task(cfg, data, graph_comm, keep)
    if cfg.dataset == "digits":
        if cfg.model == "mlp" and cfg.plan:
            model, laid_out = _laid_out_mlp(cfg, data, tp_comm, dtype, keep)
            spe = datasets.steps_per_epoch(len(data.y_train), cfg.batch_size)
            return Task(cfg, data, model, cfg.steps or max(1, math.ceil(cfg.epochs * spe)),
                        layout=laid_out)
        if cfg.model == "mlp":
            model = models.mlp(data.x_train.shape[1], cfg.hidden, data.n_classes, seed=cfg.seed,
                               dtype=dtype, keep=keep)
        elif tp:
            from hpcnn.parallel.tensor.factories import parallel_cnn
            model = parallel_cnn(tp_comm, 1, 8, cfg.channels, n_out=data.n_classes, seed=cfg.seed,
                                 dtype=dtype, keep=keep)
        else:
            model = models.cnn(1, 8, cfg.channels, n_out=data.n_classes, seed=cfg.seed,
                               dtype=dtype, keep=keep)
        spe = datasets.steps_per_epoch(len(data.y_train), cfg.batch_size)
        return Task(cfg, data, model, cfg.steps or max(1, math.ceil(cfg.epochs * spe)))
    vocab = padded_vocab(data.vocab, cfg)
    if tp:
        from hpcnn.parallel.tensor.factories import parallel_gpt
        model = parallel_gpt(tp_comm, vocab, cfg.block_size, cfg.n_layers, cfg.dim, cfg.n_heads,
                             sequence_parallel=cfg.sequence_parallel, dropout=cfg.dropout,
                             seed=cfg.seed, dtype=dtype, keep=keep)
    else:
        model = models.gpt(vocab, cfg.block_size, cfg.n_layers, cfg.dim, cfg.n_heads,
                           dropout=cfg.dropout, seed=cfg.seed, dtype=dtype, keep=keep)
        if cfg.half_layers:
            from hpcnn.nn.residual import split_layers
            model = split_layers(model)
    return Task(cfg, data, model, cfg.steps or TEXT_DEFAULT_STEPS)
