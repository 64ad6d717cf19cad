"""The machine a plan is made for: a hierarchical, symmetric BSP machine (HSM2DL).

H. Wang's thesis (Orléans 2022, ../shared/REFERENCES.md section 3) models the machine as a tree of
levels: level l has p_l identical children, a per-word cost g_l and a latency L_l, and
p = prod p_l devices sit at the leaves. A BSP superstep costs max work + h g_l + L_l.

A :class:`Machine` holds its levels (:class:`Level`), innermost first (``levels[0]``; device d's
coordinates are its mixed-radix digits, innermost fastest, so consecutive ranks share the
innermost level), and one :class:`Device`. Files are TOML: :func:`load`, :func:`loads`,
:meth:`Machine.to_toml`; :func:`this_machine` is the file the planner reads by default;
``hpcnn calibrate --write`` measures one; ``machines/*.toml`` are examples with the sources of
their numbers. What the thesis leaves open, and what is chosen here (the measurements behind
these choices: docs/results/planner-model.md):

- **g is piecewise in the message size**: ``((max_bytes, bytes_per_s), ...)``,
  g_l(n) = 1 / bytes_per_s of the first piece with n <= max_bytes; the last ends at infinity.
- **Symmetric levels**, named after the group they form ("node", "cluster"); every pair of
  devices whose lowest common level is l talks at its cost. bytes_per_s is what one device gets
  while every device of the group sends at once (a BSP h-relation), as calibration measures it.
- **The device** has a compute rate per dtype (what each rank gets while all compute at once),
  a memory bandwidth and a capacity, and per block kind: ``efficiency`` (share of the matmul
  rate), ``elementwise`` (seconds per byte of ``spec().bytes_cache``), ``activation`` (per byte
  of a ReLU output after a Linear), ``overhead`` (fixed seconds a call; kind ``"stage"``: a
  pipeline stage pass around its blocks), ``forward`` (share of those seconds in the forward,
  1/3 if missing), ``split`` (a zero-bubble backward's input and weight halves), ``tokens``
  (slowdown of small calls, in log(tokens)) and ``update`` (measured seconds per parameter of an
  optimizer step, :meth:`Device.update_seconds`; without it, priced from the bandwidth by
  :func:`hpcnn.plan.hybrid.update_seconds`); per dtype, ``gemm``: published GEMM rates by shape,
  from which a block's GEMMs are priced on a roofline (:mod:`hpcnn.plan.gemm`).
- **Where ranks share cores** a level holds ``handoff`` (H_l(c): a blocking exchange's wait for
  its peer to get a core after c seconds of compute, paid per message, allreduce and pipeline
  stage pass), ``bubble_weight`` (share of its length a pipeline's fill and drain take) and
  ``after_compute`` (what an allreduce or all-to-all took after c seconds of compute, which
  :mod:`hpcnn.plan.cost` and :mod:`hpcnn.plan.hybrid` price collectives from).
"""
from __future__ import annotations

import contextlib
import functools
import math
import operator
import os
import tomllib
from dataclasses import dataclass, field, fields, replace

from hpcnn.plan import gemm, tables


def cached_hash(obj) -> int:
    """A frozen dataclass's hash (its fields' that take part in it, as the dataclass's own
    ``__hash__`` takes them), computed once and kept on the instance: a plan looks its machine,
    levels, model and layouts up in its caches many thousand times (:mod:`hpcnn.plan.hybrid`).
    Not pickled (:func:`unhashed_state`): a string's hash differs from one process to the
    next."""
    h = obj.__dict__.get("_hash")
    if h is None:
        h = hash(_hashed_fields(type(obj))(obj))
        object.__setattr__(obj, "_hash", h)
    return h


@functools.lru_cache(maxsize=None)
def _hashed_fields(cls):
    """A getter of the tuple of ``cls``'s fields that take part in its hash."""
    names = [f.name for f in fields(cls) if (f.compare if f.hash is None else f.hash)]
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else lambda obj: (get(obj),)


def unhashed_state(obj) -> dict:
    """A frozen dataclass's pickled state: its fields and cached values, not its hash."""
    return {k: v for k, v in obj.__dict__.items() if k != "_hash"}

MACHINES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "machines")
ENV = "HPCNN_MACHINE"        # a machine file this_machine() reads before machines/local.toml


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: ``fanout`` identical children talking at latency ``latency_s``
    (seconds per message, also the cost of a barrier at this level) and a per-byte cost that
    depends on the message size through ``bandwidth`` pieces ((max_bytes, bytes_per_s), ...).

    ``reduce_bandwidth`` (optional, the same form) is the rate of one step of a ring allreduce
    at this level: a part sent, one received and summed into the buffer. Calibration fits it
    from the MPI allreduce it times, which runs slower than the ring of ping-pong messages (the
    sums, the library's copies; docs/results/planner-model.md); without it a step is one message.
    ``handoff`` (optional; empty where every device has a core of its own) is what one blocking
    exchange (a message, a collective) waits for its peer to be given a core when the level's
    devices outnumber its cores, as points ((after_s, seconds), ...): the wait after
    ``after_s`` seconds of compute since the rank's previous exchange, linear between the
    points and flat outside them (:meth:`handoff_after`). Paid once per message and per
    allreduce (:meth:`message_seconds`, :meth:`allreduce_seconds`, ``after`` the compute before
    them), and per pipeline stage pass (:mod:`hpcnn.plan.hybrid`). ``bubble_weight`` (optional,
    in (0, 1], 1 by default) is the share of its length a pipeline's fill and drain take there:
    while some ranks wait for the first or last micro-batches, the others compute faster than
    the all-at-once rates. Calibration writes both where ranks share cores: the weight cores /
    ranks, the handoff measured (:func:`hpcnn.plan.calibrate.contention.handoff_points`).
    A file's older scalar ``handoff_s`` reads as one flat point.

    ``after_compute`` (optional; calibration measures it where the level's ranks share cores) is
    what one collective took, as the layout executor calls it, after a pass of compute on every
    rank: {"KIND.N": ((c, bytes, seconds), ...)} for KIND "allreduce" (in place, over groups of
    N ranks, all groups at once) or "alltoall" (each of N ranks ends with ``bytes``, an
    equal part from each), the extra seconds of a loop of compute c and the call over the same
    loop without the call (:func:`hpcnn.plan.calibrate.contention.after_compute_points`).
    Where it has a KIND, :meth:`collective_seconds` prices that collective from it (handoff
    included) instead of from L, g and H, times ``collective_scale`` (1 by default): what the
    layout executor's collectives took in training against these curves, fitted by calibration
    on reference MLPs through the step engine
    (:func:`hpcnn.plan.calibrate.scale.layout_scale`). ``group_scales`` ((n, k), ...)
    gives the curves of group size n their own scale k in place of ``collective_scale``:
    calibration fits one for the groups of 2 where the ranks pair up
    (docs/results/planner-model.md).

    ``stream_bandwidth`` (optional, pieces): one device's rate here while the rest of its
    node is quiet (``bandwidth``: each device's with all sending); :meth:`shared_rate`."""
    name: str
    fanout: int
    latency_s: float
    bandwidth: tuple
    reduce_bandwidth: tuple = ()
    handoff: tuple = ()
    bubble_weight: float = 1.0
    after_compute: dict = field(default_factory=dict, hash=False)
    collective_scale: float = 1.0
    group_scales: tuple = ()
    stream_bandwidth: tuple = ()

    __hash__ = cached_hash      # after_compute (hash=False) aside
    __getstate__ = unhashed_state

    def __post_init__(self):
        where = f"level {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"level name = {self.name!r}: expected a non-empty string")
        if isinstance(self.fanout, bool) or not isinstance(self.fanout, int) or self.fanout < 1:
            raise ValueError(f"{where}: fanout = {self.fanout!r}: expected an integer >= 1")
        object.__setattr__(self, "latency_s", tables.positive(self.latency_s, f"{where}: latency_s",
                                                        allow_zero=True))
        object.__setattr__(self, "bandwidth", tables.read_pieces(self.bandwidth, f"{where}: bandwidth"))
        object.__setattr__(self, "handoff", tables.read_points(self.handoff, f"{where}: handoff"))
        w = tables.positive(self.bubble_weight, f"{where}: bubble_weight")
        if w > 1:
            raise ValueError(f"{where}: bubble_weight = {self.bubble_weight!r}: expected a number "
                             "in (0, 1]")
        object.__setattr__(self, "bubble_weight", w)
        if self.reduce_bandwidth:
            object.__setattr__(self, "reduce_bandwidth", tables.read_pieces(
                self.reduce_bandwidth, f"{where}: reduce_bandwidth"))
        if self.stream_bandwidth:
            object.__setattr__(self, "stream_bandwidth", tables.read_pieces(
                self.stream_bandwidth, f"{where}: stream_bandwidth"))
        object.__setattr__(self, "after_compute", tables.read_curves(self.after_compute,
                                                          f"{where}: after_compute"))
        object.__setattr__(self, "collective_scale", tables.finite_positive(
            self.collective_scale, f"{where}: collective_scale"))
        object.__setattr__(self, "group_scales", tables.read_group_scales(
            self.group_scales, f"{where}: group_scales", self.after_compute))

    def seconds_per_byte(self, nbytes: int) -> float:
        """g_l(n): 1 / bytes_per_s of the first piece with n <= max_bytes."""
        if nbytes < 0:
            raise ValueError(f"level {self.name!r}: nbytes = {nbytes}: expected >= 0")
        for max_bytes, rate in self.bandwidth:
            if nbytes <= max_bytes:
                return 1.0 / rate
        raise AssertionError("the last piece ends at infinity")     # checked in tables.read_pieces

    def handoff_after(self, after: float = 0.0) -> float:
        """H_l(c): the handoff after c = ``after`` seconds of compute (the ``handoff`` points,
        linear between them, flat outside; 0 without points)."""
        return tables.between(self.handoff, after) if self.handoff else 0.0

    def message_seconds(self, nbytes: int, after: float = 0.0) -> float:
        """H_l(c) + L_l + n g_l(n): one message of ``nbytes`` between two children of this level
        after c = ``after`` seconds of compute (H_l the handoff, :meth:`handoff_after`)."""
        return self.handoff_after(after) + self.wire_seconds(nbytes)

    def wire_seconds(self, nbytes: float) -> float:
        """L_l + n g_l(n): a message's latency and bytes, without the handoff."""
        return self.latency_s + nbytes * self.seconds_per_byte(nbytes)

    def reduce_step_seconds(self, nbytes: float) -> float:
        """One step of a ring allreduce exchanging parts of ``nbytes``: L_l + n / its
        ``reduce_bandwidth`` piece's rate, or one message where the level has none."""
        if not self.reduce_bandwidth:
            return self.wire_seconds(nbytes)
        if nbytes < 0:
            raise ValueError(f"level {self.name!r}: nbytes = {nbytes}: expected >= 0")
        rate = next(r for top, r in self.reduce_bandwidth if nbytes <= top)
        return self.latency_s + nbytes / rate

    def allreduce_seconds(self, nbytes: float, n: int, after: float = 0.0,
                          crossing: float | None = None) -> float:
        """A ring allreduce of ``nbytes`` over ``n`` children: 2(n-1) steps of n-th parts, and
        one handoff after ``after`` seconds of compute (:meth:`handoff_after`). ``crossing``:
        the fraction of a child's devices whose messages cross this level at once; where the
        level has a ``stream_bandwidth``, a step's message moves at :meth:`shared_rate`
        (and no faster than a reduce step)."""
        if n == 1 or nbytes == 0:
            return 0.0
        part = nbytes / n
        step = self.reduce_step_seconds(part)
        if crossing is not None and self.stream_bandwidth:
            wire = self.latency_s + part / self.shared_rate(part, crossing)
            step = max(wire, step) if self.reduce_bandwidth else wire
        return self.handoff_after(after) + 2 * (n - 1) * step

    def shared_rate(self, nbytes: float, crossing: float) -> float:
        """Bytes per second of one message of ``nbytes`` at this level while a fraction
        ``crossing`` (in (0, 1]) of its child's devices send across: the child's link,
        ``bandwidth`` per device when all send, shared among the senders, and at most one
        stream's rate (``stream_bandwidth``; ``bandwidth`` where the level has none)."""
        if not 0 < crossing <= 1:
            raise ValueError(f"level {self.name!r}: crossing = {crossing!r}: expected a "
                             "fraction in (0, 1]")
        rate = 1.0 / self.seconds_per_byte(nbytes)
        if not self.stream_bandwidth:
            return rate
        stream = next(r for top, r in self.stream_bandwidth if nbytes <= top)
        return min(stream, rate / crossing)

    def collective_seconds(self, kind: str, n: int, nbytes: float,
                           after: float = 0.0) -> float | None:
        """Seconds of one ``kind`` collective ("allreduce", "alltoall") of ``nbytes`` over ``n``
        ranks after ``after`` seconds of compute, from ``after_compute`` (None where it has no
        such kind): the curve of the measured group size nearest n (in log n, the larger on a
        tie); per measured compute c, linear in bytes between the sizes, the first size's
        seconds below it and the last two sizes' slope past the last; linear in c between the
        measured c, flat outside them; times the scale of that group size (:meth:`scale_of`)."""
        near = self.curve_group(kind, n)
        if near is None:
            return None
        curves = {}
        for c, b, t in self.after_compute[f"{kind}.{near}"]:
            curves.setdefault(c, []).append((b, t))
        at = [(c, tables.along(curves[c], nbytes)) for c in sorted(curves)]
        return self.scale_of(near) * tables.between(at, after)

    def curve_group(self, kind: str, n: int) -> int | None:
        """The group size of the ``after_compute`` curve that prices a ``kind`` collective over
        ``n`` ranks: the measured size nearest n in log n, the larger on a tie (None: no
        curve of that kind)."""
        sizes = [int(k.split(".")[1]) for k in self.after_compute if k.split(".")[0] == kind]
        return min(sizes, key=lambda m: (abs(math.log(m / max(n, 1))), -m)) if sizes else None

    def scale_of(self, group: int) -> float:
        """The scale of the curves of ``group`` ranks: its ``group_scales`` entry, else
        ``collective_scale``."""
        return dict(self.group_scales).get(group, self.collective_scale)


@dataclass(frozen=True)
class Device:
    """One device (a core, a GPU): compute rate per dtype name (FLOP/s), memory bandwidth
    (bytes/s), memory capacity (bytes), the fraction of the rate each block kind attains
    (``efficiency``, kind -> (0, 1]; missing kinds 1), its seconds per cache byte
    (``elementwise``, kind -> seconds >= 0; missing kinds 0; the pseudo-kind "held": seconds
    per byte of the activations a pipeline stage holds beyond one micro-batch's,
    :func:`hpcnn.plan.hybrid.held_seconds`; the pseudo-kind "moved": seconds per byte the GPT
    blocks' memory-bound operations move, :mod:`hpcnn.plan.traffic`, in place of the
    transformer's figure per cache byte), its fixed seconds per forward +
    backward (``overhead``, kind -> seconds >= 0; missing kinds 0), the forward's share of
    those two (``forward``, kind -> (0, 1); missing kinds 1/3), its backward's zero-bubble
    halves (``split``, kind -> (input, weight) fractions of the whole backward; missing kinds
    (0.5, 0.5)) and the measured seconds per parameter of an optimizer step (``update``,
    optimizer name -> pieces ((max_params, seconds_per_param), ..., (inf, seconds_per_param))
    for float32 parameters; an optimizer not listed is priced from the memory bandwidth) and
    the seconds per byte of the output of the non-linearity that ends a block (``activation``,
    kind -> seconds >= 0; missing kinds their ``elementwise`` figure) and the slowdown of a
    kind's FLOP and element-wise seconds by tokens per call (``tokens``, kind -> pieces
    ((tokens, slowdown), ..., (inf, slowdown)); missing kinds 1) and, per dtype, published GEMM
    rates (``gemm``, dtype -> ((m, n, k, flop_per_s), ...): :meth:`gemm_seconds`), the GEMMs
    run in ``waves`` of output tiles where given ((processors, tile_m, tile_n); () none:
    :func:`hpcnn.plan.gemm.fill`)."""
    name: str
    flops: dict = field(hash=False)
    memory_bandwidth: float
    memory_bytes: float
    efficiency: dict = field(default_factory=dict, hash=False)
    overhead: dict = field(default_factory=dict, hash=False)
    elementwise: dict = field(default_factory=dict, hash=False)
    forward: dict = field(default_factory=dict, hash=False)
    split: dict = field(default_factory=dict, hash=False)
    update: dict = field(default_factory=dict, hash=False)
    activation: dict = field(default_factory=dict, hash=False)
    tokens: dict = field(default_factory=dict, hash=False)
    gemm: dict = field(default_factory=dict, hash=False)
    waves: tuple = ()

    def __post_init__(self):
        if not isinstance(self.flops, dict) or not self.flops:
            raise ValueError(f"device {self.name!r}: flops = {self.flops!r}: expected a table "
                             "dtype name -> FLOP/s")
        object.__setattr__(self, "flops", {str(k): tables.positive(v, f"device flops.{k}")
                                           for k, v in self.flops.items()})
        object.__setattr__(self, "memory_bandwidth",
                           tables.positive(self.memory_bandwidth, "device memory_bandwidth"))
        object.__setattr__(self, "memory_bytes",
                           tables.positive(self.memory_bytes, "device memory_bytes"))
        if not isinstance(self.efficiency, dict):
            raise ValueError(f"device {self.name!r}: efficiency = {self.efficiency!r}: expected "
                             "a table block kind -> fraction of the rate")
        eff = {str(k): tables.positive(v, f"device efficiency.{k}") for k, v in self.efficiency.items()}
        if any(v > 1 for v in eff.values()):
            raise ValueError(f"device {self.name!r}: efficiency = {eff}: a fraction of the "
                             "rate is at most 1")
        object.__setattr__(self, "efficiency", eff)
        for table in ("overhead", "elementwise", "activation"):
            value = getattr(self, table)
            if not isinstance(value, dict):
                raise ValueError(f"device {self.name!r}: {table} = {value!r}: expected a "
                                 "table block kind -> seconds")
            object.__setattr__(self, table, {
                str(k): tables.positive(v, f"device {table}.{k}", allow_zero=True)
                for k, v in value.items()})
        if not isinstance(self.forward, dict):
            raise ValueError(f"device {self.name!r}: forward = {self.forward!r}: expected a "
                             "table block kind -> share of the forward pass")
        fwd = {str(k): tables.positive(v, f"device forward.{k}") for k, v in self.forward.items()}
        if any(v >= 1 for v in fwd.values()):
            raise ValueError(f"device {self.name!r}: forward = {fwd}: a share of a forward + "
                             "backward is below 1")
        object.__setattr__(self, "forward", fwd)
        if not isinstance(self.split, dict):
            raise ValueError(f"device {self.name!r}: split = {self.split!r}: expected a table "
                             "block kind -> [input, weight] fractions of the backward")
        halves = {}
        for k, v in self.split.items():
            if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or len(v) != 2:
                raise ValueError(f"device {self.name!r}: split.{k} = {v!r}: expected [input, "
                                 "weight], fractions of the whole backward")
            halves[str(k)] = tuple(tables.positive(x, f"device split.{k}") for x in v)
        object.__setattr__(self, "split", halves)
        for table, key, names in (("update", "optimizer", ("max_params", "seconds_per_param")),
                                  ("tokens", "block kind", ("tokens", "slowdown"))):
            value = getattr(self, table)
            if not isinstance(value, dict):
                raise ValueError(f"device {self.name!r}: {table} = {value!r}: expected a table "
                                 f"{key} -> [[{', '.join(names)}], ..., [inf, {names[1]}]]")
            object.__setattr__(self, table, {
                str(k): tables.read_pieces(v, f"device {table}.{k}", names) for k, v in value.items()})
        object.__setattr__(self, "gemm", gemm.read_table(self.gemm, self.flops,
                                                         f"device {self.name!r}"))
        self._check_waves()

    def _check_waves(self):
        """``waves`` as read_waves gives it (from a table or a (processors, tile_m, tile_n)
        tuple), and no GEMM point's rate beyond its dtype's peak once its own shape's unfilled
        waves are taken out (a point's full-wave rate)."""
        where, waves = f"device {self.name!r}", self.waves
        if isinstance(waves, (list, tuple)):
            if waves and len(waves) != 3:
                raise ValueError(f"{where}: waves = {waves!r}: expected (processors, tile_m, "
                                 "tile_n), integers >= 1")
            waves = {"processors": waves[0], "tile": list(waves[1:])} if waves else {}
        waves = gemm.read_waves(waves, where)
        object.__setattr__(self, "waves", waves)
        for dtype, points in self.gemm.items():
            for m, n, _, rate in points:
                share = gemm.fill(m, n, 1, waves)
                if rate / share > self.flops[dtype] * (1 + 1e-12):
                    raise ValueError(
                        f"{where}: gemm.{dtype} point [{m}, {n}, ...] at {rate!r} FLOP/s fills "
                        f"{share:.3f} of its waves: {rate / share!r} FLOP/s a full wave, above "
                        f"the {dtype} peak {self.flops[dtype]!r}")

    def rate(self, dtype: str = "float32", kind: str | None = None) -> float:
        """FLOP/s a block of ``kind`` attains in ``dtype``: the dtype's rate times the kind's
        efficiency (1 for a kind not listed, or None)."""
        rate = self.flops.get(str(dtype))
        if rate is None:
            raise ValueError(f"device {self.name!r} has no rate for dtype {dtype!r} "
                             f"(has {', '.join(self.flops)})")
        return rate * self.efficiency.get(kind, 1.0)

    def slowdown(self, kind: str | None, tokens: float | None) -> float:
        """The factor on the FLOP and element-wise seconds of a ``kind`` block called on
        ``tokens`` tokens (rows) at a time: its ``tokens`` pieces there, 1 if None or the kind
        has none."""
        pieces = self.tokens.get(kind)
        return 1.0 if tokens is None or pieces is None else tables.log_interp(
            pieces, tokens, f"device {self.name!r}: tokens")

    def compute_seconds(self, flops: float, dtype: str = "float32", kind: str | None = None,
                        calls: float = 0, cache_bytes: float = 0,
                        activation_bytes: float = 0, tokens: float | None = None) -> float:
        """Seconds for ``flops`` floating-point operations of ``kind`` blocks in ``dtype``, plus
        ``calls`` times the kind's fixed cost of one block's forward + backward, plus its
        element-wise seconds for ``cache_bytes`` of cache and ``activation_bytes`` of a
        non-linearity's output (at the kind's ``activation`` figure, else its element-wise one),
        the FLOP and element-wise seconds slowed for calls on ``tokens`` rows (:meth:`slowdown`)."""
        per_act = self.activation.get(kind, self.elementwise.get(kind, 0.0))
        varying = (flops / self.rate(dtype, kind) + cache_bytes * self.elementwise.get(kind, 0.0)
                   + activation_bytes * per_act)
        return varying * self.slowdown(kind, tokens) + calls * self.overhead.get(kind, 0.0)

    def pass_seconds(self, flops: float, dtype: str, kind: str, calls: float,
                     cache_bytes: float, forward: bool, tokens: float | None = None) -> float:
        """Seconds of the forward (``forward``) or backward pass of ``calls`` blocks of ``kind``
        doing ``flops`` FLOPs in that pass, whose forward + backward caches ``cache_bytes``: the
        FLOPs at the kind's rate plus the pass's share (``forward``, default 1/3) of the fixed
        and element-wise seconds, the FLOP and element-wise seconds slowed for calls on
        ``tokens`` rows (:meth:`slowdown`)."""
        share = self.forward.get(kind, 1 / 3)
        rest = (calls * self.overhead.get(kind, 0.0)
                + self.elementwise_seconds(kind, cache_bytes, tokens))
        return (flops / self.rate(dtype, kind) * self.slowdown(kind, tokens)
                + (share if forward else 1 - share) * rest)

    def elementwise_seconds(self, kind: str, nbytes: float, tokens: float | None) -> float:
        """Seconds of ``kind``'s element-wise figure on ``nbytes`` of cache, slowed for calls
        on ``tokens`` rows (:meth:`slowdown`)."""
        return nbytes * self.elementwise.get(kind, 0.0) * self.slowdown(kind, tokens)

    def gemm_seconds(self, m: int, n: int, k: int, dtype: str, batch: int = 1) -> float:
        """Seconds of ``batch`` (m x k) @ (k x n) GEMMs in ``dtype`` on the roofline of its
        ``gemm`` points and the memory bandwidth (:func:`hpcnn.plan.gemm.roofline`)."""
        points = self.gemm.get(str(dtype))
        if points is None:
            raise ValueError(f"device {self.name!r} has no gemm figures for dtype {dtype!r} "
                             f"(has {', '.join(self.gemm) or 'none'})")
        return gemm.roofline(points, m, n, k, gemm.WORD[dtype], self.memory_bandwidth, batch,
                             self.waves)

    def backward_halves(self, kind: str) -> tuple:
        """(input, weight): the zero-bubble halves of ``kind``'s backward as fractions of it."""
        return self.split.get(kind, (0.5, 0.5))

    def update_seconds(self, n_params: float, optimizer: str) -> float | None:
        """Seconds of one ``optimizer`` step over ``n_params`` float32 parameters from the
        measured ``update`` pieces, None if the optimizer has none. Each finite piece
        (max_params, s) is a measured point; the seconds per parameter s(n) are interpolated
        linearly in log(n) between neighbouring points, below the first point they are its s,
        above the last finite point they are the last (infinite) piece's s (calibration gives
        that piece the largest count's figure). The step takes n_params x s(n_params)."""
        pieces = self.update.get(optimizer)
        if pieces is None:
            return None
        per_param = tables.log_interp(pieces, n_params, f"device {self.name!r}: n_params")
        return n_params * per_param

    def stream_seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through memory (read + written bytes, as STREAM counts)."""
        return nbytes / self.memory_bandwidth

    def slowed(self, factor: float) -> Device:
        """This device with every one of its seconds ``factor`` times longer: rates and the
        memory bandwidth divided by it, fixed, element-wise, ReLU-output and optimizer seconds
        multiplied; fractions (efficiency, forward shares, backward halves) and the tokens
        slowdown, ratios of seconds, unchanged. Where ranks share cores the calibration prices
        the device so (:func:`hpcnn.plan.calibrate.scale.layout_scale`)."""
        factor = tables.finite_positive(factor, "device slowdown factor")
        return replace(self, flops={k: v / factor for k, v in self.flops.items()},
                       memory_bandwidth=self.memory_bandwidth / factor,
                       gemm={k: tuple((*p[:3], p[3] / factor) for p in v)
                             for k, v in self.gemm.items()},
                       **{t: {k: v * factor for k, v in getattr(self, t).items()}
                          for t in ("overhead", "elementwise", "activation")},
                       update={k: tuple((n, s * factor) for n, s in v)
                               for k, v in self.update.items()})


@dataclass(frozen=True)
class Machine:
    """Devices at the leaves of ``levels`` (innermost first): p = product of the fan-outs.
    ``dp_overlap``: the data-parallel gradient reduction runs beside the backward (collectives
    on their own stream, as on GPUs): :func:`hpcnn.plan.hybrid.dp_seconds`."""
    name: str
    levels: tuple
    device: Device
    source: str = ""
    dp_overlap: bool = False

    def __post_init__(self):
        object.__setattr__(self, "levels", tuple(self.levels))
        if not all(isinstance(lv, Level) for lv in self.levels):
            raise ValueError(f"machine {self.name!r}: levels must be Level objects")
        names = [lv.name for lv in self.levels]
        if len(set(names)) != len(names):
            raise ValueError(f"machine {self.name!r}: level names repeat: {names}")

    __hash__ = cached_hash
    __getstate__ = unhashed_state

    @functools.cached_property
    def compute_dependent(self) -> bool:
        """Whether a collective's price depends on the compute before it (some level has
        ``handoff`` points or ``after_compute`` curves: ranks share cores)."""
        return any(lv.handoff or lv.after_compute for lv in self.levels)

    @functools.cached_property
    def p(self) -> int:
        return math.prod(lv.fanout for lv in self.levels)

    def _spans(self) -> list:
        """Devices under each level, innermost first (level l holds prod_{i<=l} p_i devices)."""
        return list(self._span_tuple)

    @functools.cached_property
    def _span_tuple(self) -> tuple:
        spans, n = [], 1
        for lv in self.levels:
            n *= lv.fanout
            spans.append(n)
        return tuple(spans)

    def bisection_level(self, k: int) -> Level:
        """The level whose fan-out the k-th bisection of the p devices splits: k = 0 is the first
        (outermost) cut, k = log2(p) - 1 the last (innermost). A level of fan-out 2^a takes a
        consecutive bisections; levels of fan-out 1 take none. Needs p a power of two."""
        p = self.p
        if p & (p - 1):
            raise ValueError(f"machine {self.name!r}: p = {p} is not a power of two: it cannot "
                             "be bisected (fan-outs " + "x".join(
                                 str(lv.fanout) for lv in self.levels) + ")")
        cuts = [lv for lv in reversed(self.levels) for _ in range(lv.fanout.bit_length() - 1)]
        if not 0 <= k < len(cuts):
            raise ValueError(f"machine {self.name!r}: bisection k = {k} out of range "
                             f"0..{len(cuts) - 1} (p = {p})")
        return cuts[k]

    def level_for_group(self, size: int) -> Level:
        """The innermost level holding a group of ``size`` consecutive devices that starts at a
        multiple of ``size``: the first level whose span is a multiple of ``size`` (the whole
        machine's outermost level if none is). A group of one is in the innermost level."""
        if not self.levels:
            raise ValueError(f"machine {self.name!r} has no levels: one device, no groups")
        if not 1 <= size <= self.p:
            raise ValueError(f"machine {self.name!r}: group size {size} out of range 1..{self.p}")
        for lv, span in zip(self.levels, self._span_tuple):
            if span % size == 0:
                return lv
        return self.levels[-1]

    def with_devices(self, p: int) -> "Machine":
        """The same machine cut to ``p`` devices: inner levels kept whole, the outermost level in
        use reduced to what remains, the levels outside it reduced to fan-out 1. ValueError if p
        is not a whole number of inner groups or exceeds the machine."""
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= self.p:
            raise ValueError(f"machine {self.name!r}: devices = {p!r}: expected 1..{self.p}")
        levels, below = [], 1
        for lv in self.levels:
            if p <= below * lv.fanout:
                if p % below:
                    raise ValueError(
                        f"machine {self.name!r}: {p} devices do not fit: the children of level "
                        f"{lv.name!r} hold {below} devices each ({p} is not a multiple of "
                        f"{below})")
                levels.append(replace(lv, fanout=p // below))
                below = p
            else:
                levels.append(lv)
                below *= lv.fanout
        return replace(self, levels=tuple(levels))

    def to_toml(self) -> str:
        """The machine as a TOML file that :func:`load` reads back equal."""
        lines = [f"name = {tables.toml_str(self.name)}", f"source = {tables.toml_str(self.source)}",
                 *(["dp_overlap = true"] if self.dp_overlap else []), "",
                 "[device]", f"name = {tables.toml_str(self.device.name)}",
                 f"memory_bandwidth = {tables.toml_num(self.device.memory_bandwidth)}   # bytes/s",
                 f"memory_bytes = {tables.toml_num(self.device.memory_bytes)}", "",
                 "[device.flops]                  # FLOP/s per dtype"]
        lines += [f"{tables.toml_str(k)} = {tables.toml_num(v)}" for k, v in self.device.flops.items()]
        for table, what in (("efficiency", "fraction of the rate per block kind"),
                            ("overhead", "seconds per forward + backward of one block"),
                            ("elementwise", "seconds per byte of a block's cache (held: of "
                                            "activations held beyond one micro-batch's)"),
                            ("activation", "seconds per byte of a ReLU's output"),
                            ("forward", "share of overhead + elementwise in the forward"),
                            ("split", "zero-bubble backward halves [input, weight]")):
            if getattr(self.device, table):
                lines += ["", f"[device.{table}]".ljust(32) + f"# {what}"]
                lines += [f"{tables.toml_str(k)} = " + (
                    f"[{', '.join(tables.toml_num(x) for x in v)}]" if isinstance(v, tuple)
                    else tables.toml_num(v)) for k, v in getattr(self.device, table).items()]
        lines += _device_tables(self.device)
        if not self.levels:
            lines.insert(2, "levels = []                     # one device, no network")
        for lv in self.levels:
            lines += ["", "[[levels]]                      # innermost first",
                      f"name = {tables.toml_str(lv.name)}", f"fanout = {lv.fanout}",
                      f"latency_s = {tables.toml_num(lv.latency_s)}",
                      f"bandwidth = {tables.toml_pieces(lv.bandwidth)}   # [max_bytes, bytes_per_s]"]
            if lv.reduce_bandwidth:
                lines.append(f"reduce_bandwidth = {tables.toml_pieces(lv.reduce_bandwidth)}"
                             "   # a ring allreduce's step")
            if lv.handoff:
                lines.append(f"handoff = {tables.toml_pieces(lv.handoff)}"
                             "   # [after_s, seconds]: a blocking exchange's wait for its peer's "
                             "core after that much compute")
            if lv.bubble_weight != 1:
                lines.append(f"bubble_weight = {tables.toml_num(lv.bubble_weight)}"
                             "   # a pipeline's fill and drain, share of their length")
            if lv.collective_scale != 1:
                lines.append(f"collective_scale = {tables.toml_num(lv.collective_scale)}"
                             "   # the executor's collectives in training / after_compute")
            if lv.group_scales:
                lines.append("group_scales = [" + ", ".join(
                    f"[{n}, {tables.toml_num(k)}]" for n, k in lv.group_scales)
                    + "]   # [n, k]: the scale of the curves of n ranks, where not the one above")
            if lv.after_compute:
                lines += ["", "[levels.after_compute]".ljust(32) + "# a collective's seconds "
                          "after c seconds of compute: [c, bytes, seconds]"]
                lines += [f"{tables.toml_str(k)} = [" + ", ".join(
                    f"[{tables.toml_num(c)}, {tables.toml_num(b)}, {tables.toml_num(t)}]" for c, b, t in rows)
                    + "]" for k, rows in lv.after_compute.items()]
        return "\n".join(lines) + "\n"


def _device_tables(device: Device) -> list:
    """The TOML lines of a device's ``update``, ``tokens``, ``gemm`` and ``waves`` tables
    (none where empty)."""
    lines = []
    for table, what in (("update", "optimizer step: [max_params, seconds_per_param] "
                                   "(float32)"),
                        ("tokens", "slowdown by tokens per call: [tokens, slowdown]")):
        if getattr(device, table):
            lines += ["", f"[device.{table}]".ljust(32) + f"# {what}"]
            lines += [f"{tables.toml_str(k)} = {tables.toml_pieces(pieces)}"
                      for k, pieces in getattr(device, table).items()]
    if device.gemm:
        lines += ["", "[device.gemm]".ljust(32) + "# published GEMM rates: [m, n, k, flop_per_s]"]
        lines += [f"{tables.toml_str(k)} = [" + ", ".join(
            f"[{m}, {n}, {kk}, {tables.toml_num(r)}]" for m, n, kk, r in pts) + "]"
            for k, pts in device.gemm.items()]
    if device.waves:
        procs, tm, tn = device.waves
        lines += ["", "[device.waves]".ljust(32) + "# GEMM output tiles, one a processor a wave",
                  f"processors = {procs}", f"tile = [{tm}, {tn}]"]
    return lines


def _get(table: dict, key: str, where: str, kind=None):
    """table[key], ValueError naming ``where`` and the key if it is missing or not a ``kind``."""
    if key not in table:
        raise ValueError(f"{where}: missing key {key!r}")
    if kind is not None and not isinstance(table[key], kind):
        raise ValueError(f"{where}: {key} = {table[key]!r}: expected a "
                         f"{'table' if kind is dict else 'list'}")
    return table[key]


@contextlib.contextmanager
def _named(where: str):
    """Prefix a ValueError raised inside with ``where`` (the file and the table it is about)."""
    try:
        yield
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None


def loads(text: str, where: str = "<string>") -> Machine:
    """A machine from TOML text; ValueError naming ``where`` and the key on bad input."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML: {e}") from None
    at = f"{where} [device]"
    dev = _get(doc, "device", where, dict)
    with _named(at):
        device = Device(name=str(_get(dev, "name", at)), flops=_get(dev, "flops", at, dict),
                        memory_bandwidth=_get(dev, "memory_bandwidth", at),
                        memory_bytes=_get(dev, "memory_bytes", at),
                        efficiency=dev.get("efficiency", {}), overhead=dev.get("overhead", {}),
                        elementwise=dev.get("elementwise", {}), forward=dev.get("forward", {}),
                        split=dev.get("split", {}), update=dev.get("update", {}),
                        activation=dev.get("activation", {}), tokens=dev.get("tokens", {}),
                        gemm=dev.get("gemm", {}), waves=dev.get("waves", {}))
    levels = []
    for i, lv in enumerate(_get(doc, "levels", where, list)):
        at = f"{where} levels[{i}]"
        if not isinstance(lv, dict):
            raise ValueError(f"{at} = {lv!r}: expected a table ([[levels]])")
        with _named(at):
            levels.append(Level(name=_get(lv, "name", at), fanout=_get(lv, "fanout", at),
                                latency_s=_get(lv, "latency_s", at),
                                bandwidth=_get(lv, "bandwidth", at, list),
                                reduce_bandwidth=lv.get("reduce_bandwidth", ()),
                                handoff=lv.get("handoff", ()) if "handoff_s" not in lv
                                else [[0.0, lv["handoff_s"]]],
                                bubble_weight=lv.get("bubble_weight", 1.0),
                                after_compute=lv.get("after_compute", {}),
                                collective_scale=lv.get("collective_scale", 1.0),
                                group_scales=lv.get("group_scales", ()),
                                stream_bandwidth=lv.get("stream_bandwidth", ())))
    overlap = doc.get("dp_overlap", False)
    if not isinstance(overlap, bool):
        raise ValueError(f"{where}: dp_overlap = {overlap!r}: expected true or false")
    with _named(where):
        return Machine(name=str(_get(doc, "name", where)), levels=tuple(levels), device=device,
                       source=str(doc.get("source", "")), dp_overlap=overlap)


def resolve(path) -> str:
    """``path`` itself if it exists; else a relative path or bare name looked up in the
    repository's ``machines/`` folder: ``machines/archer2.toml``, ``archer2.toml`` and
    ``archer2`` all name that file from any working directory."""
    path = os.fspath(path)
    if os.path.exists(path) or os.path.isabs(path):
        return path
    name = path if path.endswith(".toml") else path + ".toml"
    for candidate in (os.path.join(os.path.dirname(MACHINES), name), os.path.join(MACHINES, name)):
        if os.path.exists(candidate):
            return candidate
    return path


def load(path) -> Machine:
    """The machine described by the TOML file ``path`` (:func:`resolve`; ValueError naming the
    file and key)."""
    path = resolve(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the machine file: {e.strerror}") from None
    return loads(text, where=path)


def this_machine() -> Machine:
    """The machine these ranks run on: the file named by $HPCNN_MACHINE, else
    ``machines/local.toml`` (what ``hpcnn calibrate --write machines/local.toml`` measured here),
    else ``machines/local-2vcpu.toml`` (the defaults measured on this kind of 2-vCPU machine)."""
    named = os.environ.get(ENV)
    if named:
        return load(named)                   # a missing file named on purpose is an error
    for path in (os.path.join(MACHINES, "local.toml"), os.path.join(MACHINES, "local-2vcpu.toml")):
        if os.path.exists(path):
            return load(path)
    raise ValueError(f"no machine file: set ${ENV} or run `hpcnn calibrate --write "
                     f"{os.path.join(MACHINES, 'local.toml')}`")
