"""The machine a plan is made for: a hierarchical, symmetric BSP machine (HSM2DL).

H. Wang's thesis (Orléans 2022, ../shared/REFERENCES.md section 3) models the machine as a tree of
levels: level l has p_l identical children, a per-word cost g_l and a latency L_l, and
p = prod p_l devices sit at the leaves. A BSP superstep costs max work + h g_l + L_l. What the
thesis leaves open, and what is chosen here:

- **g is piecewise in the message size.** One g does not fit all sizes (on this machine MPICH moves
  2-4 GB/s at 1-16 MiB and 13 GB/s at 256 MiB), so a level holds pieces
  ``((max_bytes, bytes_per_s), ...)``: g_l(n) = 1 / bytes_per_s of the first piece with
  n <= max_bytes; the last piece ends at infinity.
- **Symmetric levels.** All children of a level are alike and every pair of devices whose lowest
  common level is l talks at that level's cost; a level is named after the group it forms
  ("node": the devices of one node, "cluster": the nodes) and its fan-out counts its children.
- **Bandwidth per device when all communicate.** bytes_per_s is what one device gets while every
  device of the group sends at once (a BSP h-relation): a node's network injection bandwidth is
  divided among the devices below it. Calibration measures it that way (all pairs at once).
- **Innermost first.** ``Machine.levels[0]`` is the innermost level; device d's coordinates are
  its mixed-radix digits with the innermost fan-out varying fastest, so consecutive ranks share
  the innermost level.
- **The device** has a compute rate per dtype (FLOP/s), a memory bandwidth and a capacity; when
  several ranks share cores, calibration records the rate each gets while all compute at once.
- **A handoff and a bubble weight where ranks share cores.** When a level holds more ranks than
  cores, a rank that blocks on a peer (a message, a collective) waits until the scheduler gives
  that peer a core, which rates measured all at once and exchanges timed in step do not see, and
  the longer the ranks computed since their last exchange, the longer (their turns drift apart).
  ``handoff`` on the level (H_l(c), points of compute c and wait, none by default) is paid once
  per message, per allreduce and per pipeline stage pass, after the compute before it; and
  ``bubble_weight`` (1 by default) is the share of its length a pipeline's fill and drain take
  (while some ranks wait for the first or last micro-batches, the others compute faster than
  all at once). Calibration sets the weight to cores / ranks and fits the handoff to small
  pipelines through the step engine
  (:func:`hpcnn.plan.calibrate.contention.handoff_points`): on 4 ranks over 2 cores here, in
  eight calibrations, 40-90 us after 0.2 ms passes, 30-230 us after 0.9 ms, 140-760 us after
  4 ms, and a weight (fitted then) of 0.26-0.57. With one pipeline the two cancel (without
  either, a 4-stage pipeline of 1.1 ms passes ran 1.00-1.09x its price at 8 micro-batches,
  1.22-1.24x at 32), so each size is run with p and 4p micro-batches.
- **Collectives after compute where ranks share cores.** A collective over a group waits for
  the last of its ranks to get a core, and a rank that waits spins on a core another needs: a
  1 MiB allreduce over 4 ranks on 2 cores here took 0.8-1.05 ms after 0.5-8 ms of compute
  against 0.55 ms back to back. ``after_compute`` on the level holds what an allreduce (per
  group size) and an all-to-all took after c seconds of compute, per size
  (:func:`hpcnn.plan.calibrate.contention.after_compute_points`); the MLP's cost
  (:mod:`hpcnn.plan.cost`) prices the layout executor's collectives from it. The GPT's cost
  (:mod:`hpcnn.plan.hybrid`) prices its allreduces from them too (tp and dp), and keeps the
  messages and the handoff for its pipelines.
- **Efficiency per block kind.** The rate is a matmul's; a framework's block also runs element-wise
  passes (LayerNorm, GELU, softmax, the residual adds), which NumPy does not fuse into the
  matmuls. ``efficiency`` maps a block kind ("transformer", "linear") to the fraction of the
  rate its forward + backward FLOPs (``spec()``) attain; calibration measures it on one reference
  size per kind, public-specification files take it from published model-FLOP utilisations.
  A kind not listed runs at the full rate. ``elementwise`` maps a kind to the seconds its
  forward + backward spends per byte of the block's cache (``spec().bytes_cache``: the arrays
  the element-wise passes write and read again), so that a block costs
  overhead + FLOPs / (rate x efficiency) + cache bytes x elementwise: with one efficiency alone a
  narrow block (more element-wise work per FLOP) was predicted 1.3x too fast and a wide one 1.4x
  too slow; with both terms, fitted on two reference sizes, within -5 % .. +14 % over widths
  64-512. ``overhead`` maps a kind to the fixed seconds of one block's forward + backward
  whatever its size (the interpreter's and the kernel launches' share: what makes many tiny
  micro-batches slow); calibration times a tiny block of the kind. ``forward`` maps a kind to
  the share of its fixed and element-wise seconds spent in the forward pass (missing kinds 1/3,
  the FLOPs' share): the planner splits a block's time into forward and backward for the
  pipeline schedules, and element-wise passes do not split as the matmuls' 1 : 2 (a transformer
  block's forward measured ~42 % of its time on this kind of machine, priced at 35 % with 1/3).
  ``split`` maps a kind to the (input, weight) halves of its backward as a zero-bubble pipeline
  runs them, each a fraction of the whole backward (missing kinds (0.5, 0.5)): split, the two
  halves cost more than the whole (1.13x for a transformer block on this kind of machine).
  The kind ``"stage"`` in ``overhead`` and ``forward`` is a pipeline stage pass's cost around
  its blocks (the step engine's instruction, embedding, the tail's small calls, the loss), per
  micro-batch: calibration runs a tiny GPT through the step engine and subtracts its block.
- **Small calls run slower than the references price.** ``tokens`` maps a kind to pieces
  ((tokens, slowdown), ..., (inf, slowdown)): the factor on a block's FLOP and element-wise
  seconds when it is called on that many tokens (rows of its matmuls) at a time, interpolated
  in log(tokens) as the optimizer's pieces are. Efficiency and element-wise figures are fitted
  on references of 512-2048 tokens; a width-128 transformer block on one sequence of 64 tokens
  ran 1.22x the time they price (its matmuls of 64 rows at ~0.8 of the rate, its attention's
  smaller still), which left a pipeline of 32 one-sequence micro-batches 1.23-1.42x its price.
  Calibration runs a ladder of one-block GPTs through the step engine on micro-batches of 1
  to 8 sequences (64-512 tokens) and gives each rung its pass time beyond the fixed cost per
  token over the top rung's (1 there and above): here 1.39-1.44 at 64 tokens, 1.12-1.19 at
  128 (the element-wise seconds, 25-65 % of such a block, slow with the FLOPs'). The same
  block timed bare gave 1.67-1.90 at 64 tokens for widths 128-256, and priced the one-sequence
  pipelines 10-25 % above their measured times. The linear kind's pieces are by rows, from a
  ladder of a Linear and its ReLU (:func:`hpcnn.plan.calibrate.passes.rows_costs`).
  Where ranks share cores the transformer's ladder is damped by how much better its bottom
  rung shares a core than its top (:func:`hpcnn.plan.calibrate.machine_file.machine_of`).
- **A non-linearity's output costs more per byte than a block's input.** ``activation`` maps a
  kind to the seconds per byte of the ReLU output that follows a Linear (written by the matmul,
  passed by the bias add, the ReLU forward and backward), its ``elementwise`` figure then
  pricing the cached input alone. Calibration separates the two with a third, rectangular
  reference block (128 -> 1024 features: an output 8x its input; here a ReLU output byte cost
  ~5x an input byte). With one figure for both, the plan validation's MLPs whose middle Linear
  is cut on its input (a whole ReLU output on each rank) measured 1.04-1.13x their price against
  0.95-1.02x for those cut on its output; priced with the two, the MLP's Kendall tau rose by
  0.03-0.05 on each of five validation runs' measurements.
- **The optimizer's update is measured, not derived from the memory bandwidth.** ``update`` maps
  an optimizer ("adamw", "sgd") to pieces ((max_params, seconds_per_param), ...) of hpcnn's own
  step on float32 parameters, timed at a few parameter counts: a small model's arrays sit in
  cache and each array costs a fixed dispatch, so the rate depends on the size (AdamW on a
  0.83 M-parameter GPT took 1.6 ms here where the 24.5 GB/s copy bandwidth of
  ``local-2vcpu.toml`` predicted 4.5 ms; the measured figure predicted 1.5 ms). Between the
  measured counts the seconds per parameter are interpolated linearly in log(count)
  (:meth:`Device.update_seconds`). Files without the table price the update from the
  bandwidth (:func:`hpcnn.plan.hybrid.update_seconds`).

Files are TOML (read with :mod:`tomllib`, written by :meth:`Machine.to_toml`); see
``machines/*.toml`` for examples with the sources of their numbers.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import tomllib
from dataclasses import dataclass, field, replace

MACHINES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "machines")
ENV = "HPCNN_MACHINE"        # a machine file this_machine() reads before machines/local.toml


def _positive(value, what: str, allow_zero: bool = False) -> float:
    """``value`` as a float, ValueError naming ``what`` unless it is a finite number > 0 (>= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} = {value!r}: expected a number")
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} = {value!r}: expected a number {'>=' if allow_zero else '>'} 0")
    return float(value)


def _finite_positive(value, what: str) -> float:
    """``value`` as a float, ValueError naming ``what`` unless it is a finite number > 0."""
    number = _positive(value, what)
    if math.isinf(number):
        raise ValueError(f"{what} = {value!r}: expected a finite number > 0")
    return number


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: ``fanout`` identical children talking at latency ``latency_s``
    (seconds per message, also the cost of a barrier at this level) and a per-byte cost that
    depends on the message size through ``bandwidth`` pieces ((max_bytes, bytes_per_s), ...).

    ``reduce_bandwidth`` (optional, the same form) is the rate of one step of a ring allreduce
    at this level: a part sent, one received and summed into the buffer. Calibration fits it
    from the MPI allreduce it times, which on this kind of machine runs ~4x slower than the ring
    of ping-pong messages (the sums, the library's copies); without it a step is one message.
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
    calibration fits one for the groups of 2 where the ranks pair up (on 4 ranks over 2 cores
    here the reference MLPs' collectives over pairs took 0.69x the scale of those over all
    ranks, 0.905 against 1.32)."""
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

    def __post_init__(self):
        where = f"level {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"level name = {self.name!r}: expected a non-empty string")
        if isinstance(self.fanout, bool) or not isinstance(self.fanout, int) or self.fanout < 1:
            raise ValueError(f"{where}: fanout = {self.fanout!r}: expected an integer >= 1")
        object.__setattr__(self, "latency_s", _positive(self.latency_s, f"{where}: latency_s",
                                                        allow_zero=True))
        object.__setattr__(self, "bandwidth", _pieces(self.bandwidth, f"{where}: bandwidth"))
        object.__setattr__(self, "handoff", _points(self.handoff, f"{where}: handoff"))
        w = _positive(self.bubble_weight, f"{where}: bubble_weight")
        if w > 1:
            raise ValueError(f"{where}: bubble_weight = {self.bubble_weight!r}: expected a number "
                             "in (0, 1]")
        object.__setattr__(self, "bubble_weight", w)
        if self.reduce_bandwidth:
            object.__setattr__(self, "reduce_bandwidth", _pieces(
                self.reduce_bandwidth, f"{where}: reduce_bandwidth"))
        object.__setattr__(self, "after_compute", _curves(self.after_compute,
                                                          f"{where}: after_compute"))
        object.__setattr__(self, "collective_scale", _finite_positive(
            self.collective_scale, f"{where}: collective_scale"))
        object.__setattr__(self, "group_scales", _group_scales(
            self.group_scales, f"{where}: group_scales", self.after_compute))

    def seconds_per_byte(self, nbytes: int) -> float:
        """g_l(n): 1 / bytes_per_s of the first piece with n <= max_bytes."""
        if nbytes < 0:
            raise ValueError(f"level {self.name!r}: nbytes = {nbytes}: expected >= 0")
        for max_bytes, rate in self.bandwidth:
            if nbytes <= max_bytes:
                return 1.0 / rate
        raise AssertionError("the last piece ends at infinity")     # checked in _pieces

    def handoff_after(self, after: float = 0.0) -> float:
        """H_l(c): the handoff after c = ``after`` seconds of compute (the ``handoff`` points,
        linear between them, flat outside; 0 without points)."""
        return _between(self.handoff, after) if self.handoff else 0.0

    def message_seconds(self, nbytes: int, after: float = 0.0) -> float:
        """H_l(c) + L_l + n g_l(n): one message of ``nbytes`` between two children of this level
        after c = ``after`` seconds of compute (H_l the handoff, :meth:`handoff_after`)."""
        return self.handoff_after(after) + self._wire_seconds(nbytes)

    def _wire_seconds(self, nbytes: float) -> float:
        """L_l + n g_l(n): a message's latency and bytes, without the handoff."""
        return self.latency_s + nbytes * self.seconds_per_byte(nbytes)

    def reduce_step_seconds(self, nbytes: float) -> float:
        """One step of a ring allreduce exchanging parts of ``nbytes``: L_l + n / its
        ``reduce_bandwidth`` piece's rate, or one message where the level has none."""
        if not self.reduce_bandwidth:
            return self._wire_seconds(nbytes)
        if nbytes < 0:
            raise ValueError(f"level {self.name!r}: nbytes = {nbytes}: expected >= 0")
        rate = next(r for top, r in self.reduce_bandwidth if nbytes <= top)
        return self.latency_s + nbytes / rate

    def allreduce_seconds(self, nbytes: float, n: int, after: float = 0.0) -> float:
        """A ring allreduce of ``nbytes`` over ``n`` children: 2(n-1) steps of n-th parts, and
        one handoff after ``after`` seconds of compute (:meth:`handoff_after`)."""
        if n == 1 or nbytes == 0:
            return 0.0
        return self.handoff_after(after) + 2 * (n - 1) * self.reduce_step_seconds(nbytes / n)

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
        at = [(c, _along(curves[c], nbytes)) for c in sorted(curves)]
        return self.scale_of(near) * _between(at, after)

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


def _between(points, x: float) -> float:
    """The value at ``x`` of points ((x, value), ...), x increasing: linear between them,
    flat outside them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, v0), (x1, v1) in zip(points, points[1:]):
        if x <= x1:
            return v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def _along(curve, nbytes: float) -> float:
    """Seconds at ``nbytes`` on a curve of (bytes, seconds), bytes increasing: linear between
    its points, its first seconds below them, the last two points' slope past them."""
    if nbytes <= curve[0][0] or len(curve) == 1:
        return curve[0][1]
    for (b0, t0), (b1, t1) in zip(curve, curve[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = curve[-2], curve[-1]
    return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)


def _curves(table, what: str) -> dict:
    """A level's ``after_compute`` checked: {"KIND.N": ((c, bytes, seconds), ...)} with KIND
    "allreduce" or "alltoall", N an integer >= 2, every number finite and >= 0, and per c the
    bytes strictly increasing; empty for none."""
    if not isinstance(table, dict):
        raise ValueError(f"{what} = {table!r}: expected a table of \"KIND.N\" = [[c, bytes, "
                         "seconds], ...]")
    out = {}
    for key, rows in table.items():
        kind, _, n = str(key).partition(".")
        if kind not in ("allreduce", "alltoall") or not n.isdigit() or int(n) < 2:
            raise ValueError(f"{what}: key {key!r}: expected \"allreduce.N\" or \"alltoall.N\" "
                             "with N an integer >= 2 (ranks)")
        if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__") or not rows:
            raise ValueError(f"{what}[{key!r}] = {rows!r}: expected a list of [c, bytes, seconds]")
        checked, last = [], {}
        for i, row in enumerate(rows):
            if isinstance(row, (str, bytes, dict)) or not hasattr(row, "__len__") or len(row) != 3:
                raise ValueError(f"{what}[{key!r}][{i}] = {row!r}: expected [c, bytes, seconds]")
            c, b, t = (_positive(x, f"{what}[{key!r}][{i}] {name}", allow_zero=True)
                       for x, name in zip(row, ("c", "bytes", "seconds")))
            if any(math.isinf(x) for x in (c, b, t)):
                raise ValueError(f"{what}[{key!r}][{i}] = {list(row)!r}: expected finite numbers")
            if c in last and b <= last[c]:
                raise ValueError(f"{what}[{key!r}][{i}] bytes = {row[1]!r}: at c = {row[0]!r} "
                                 f"the bytes must increase (previous {last[c]!r})")
            last[c] = b
            checked.append((c, b, t))
        out[f"{kind}.{int(n)}"] = tuple(checked)
    return out


def _group_scales(items, what: str, curves: dict) -> tuple:
    """A level's ``group_scales`` checked: ((int n, float k), ...), n an integer >= 2 with an
    ``after_compute`` curve of that group size, k finite and > 0, n increasing; empty for
    none."""
    out = []
    sizes = {int(key.split(".")[1]) for key in curves}
    for i, (n, k) in _pairs(items, what, ("n", "k")):
        if isinstance(n, bool) or not isinstance(n, (int, float)) or n != int(n) or n not in sizes:
            raise ValueError(f"{what}[{i}] n = {n!r}: expected the group size of an "
                             f"after_compute curve ({sorted(sizes)})")
        k = _finite_positive(k, f"{what}[{i}] k")
        if out and int(n) <= out[-1][0]:
            raise ValueError(f"{what}[{i}] n = {n!r}: the group sizes must increase (previous "
                             f"{out[-1][0]})")
        out.append((int(n), k))
    return tuple(out)


def _pairs(items, what: str, names: tuple):
    """(i, pair) of each [a, b] pair in the list ``items``; ValueError naming ``what`` and the
    two entries' ``names`` for anything else."""
    a, b = names
    if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):
        raise ValueError(f"{what} = {items!r}: expected a list of [{a}, {b}]")
    for i, pair in enumerate(items):
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise ValueError(f"{what}[{i}] = {pair!r}: expected [{a}, {b}]")
        yield i, pair


def _points(points, what: str) -> tuple:
    """Handoff points as a tuple of (float after_s, float seconds), checked: both finite and
    >= 0, after_s strictly increasing; empty for none."""
    out = []
    for i, pt in _pairs(points, what, ("after_s", "seconds")):
        after, sec = (_positive(x, f"{what}[{i}] {name}", allow_zero=True)
                      for x, name in zip(pt, ("after_s", "seconds")))
        if math.isinf(after) or math.isinf(sec):
            raise ValueError(f"{what}[{i}] = {list(pt)!r}: expected finite numbers")
        if out and after <= out[-1][0]:
            raise ValueError(f"{what}[{i}] after_s = {pt[0]!r}: the points' after_s must "
                             f"increase (previous {out[-1][0]!r})")
        out.append((after, sec))
    return tuple(out)


def _pieces(pieces, what: str, names=("max_bytes", "bytes_per_s")) -> tuple:
    """Pieces as a tuple of (float max, float value), checked: at least one, the maxima strictly
    increasing, the last one infinite, every value finite and > 0. ``names`` name the two
    entries in the errors (a level's bandwidth: max_bytes, bytes_per_s)."""
    top_name, value_name = names
    out = []
    for i, piece in _pairs(pieces, what, names):
        top = _positive(piece[0], f"{what}[{i}] {top_name}")
        if out and top <= out[-1][0]:
            raise ValueError(f"{what}[{i}] {top_name} = {piece[0]!r}: the pieces' {top_name} "
                             f"must increase (previous {out[-1][0]!r})")
        value = _positive(piece[1], f"{what}[{i}] {value_name}")
        if math.isinf(value):
            raise ValueError(f"{what}[{i}] {value_name} = inf: expected a finite number")
        out.append((top, value))
    if not out or not math.isinf(out[-1][0]):
        raise ValueError(f"{what} = {pieces!r}: the last piece's {top_name} must be inf")
    return tuple(out)


def _log_interp(pieces: tuple, n: float, what: str) -> float:
    """The value of checked pieces ((x, value), ..., (inf, value)) at ``n`` (``what`` names it
    in the error): each finite piece is a measured point, the value interpolated linearly in
    log(x) between neighbouring points; below the first point it is its value, above the last
    finite point the last (infinite) piece's."""
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not 0 <= n < math.inf:
        raise ValueError(f"{what} = {n!r}: expected a finite number >= 0")
    points = pieces[:-1]                         # the measured points; pieces[-1] ends at inf
    if not points or n > points[-1][0]:
        return pieces[-1][1]
    if n <= points[0][0]:
        return points[0][1]
    (n0, s0), (n1, s1) = next((a, b) for a, b in zip(points, points[1:]) if n <= b[0])
    return s0 + math.log(n / n0) / math.log(n1 / n0) * (s1 - s0)


@dataclass(frozen=True)
class Device:
    """One device (a core, a GPU): compute rate per dtype name (FLOP/s), memory bandwidth
    (bytes/s), memory capacity (bytes), the fraction of the rate each block kind attains
    (``efficiency``, kind -> (0, 1]; missing kinds 1), its seconds per cache byte
    (``elementwise``, kind -> seconds >= 0; missing kinds 0; the pseudo-kind "held": seconds
    per byte of the activations a pipeline stage holds beyond one micro-batch's,
    :func:`hpcnn.plan.hybrid.held_seconds`), its fixed seconds per forward +
    backward (``overhead``, kind -> seconds >= 0; missing kinds 0), the forward's share of
    those two (``forward``, kind -> (0, 1); missing kinds 1/3), its backward's zero-bubble
    halves (``split``, kind -> (input, weight) fractions of the whole backward; missing kinds
    (0.5, 0.5)) and the measured seconds per parameter of an optimizer step (``update``,
    optimizer name -> pieces ((max_params, seconds_per_param), ..., (inf, seconds_per_param))
    for float32 parameters; an optimizer not listed is priced from the memory bandwidth) and
    the seconds per byte of the output of the non-linearity that ends a block (``activation``,
    kind -> seconds >= 0; missing kinds their ``elementwise`` figure) and the slowdown of a
    kind's FLOP and element-wise seconds by tokens per call (``tokens``, kind -> pieces
    ((tokens, slowdown), ..., (inf, slowdown)); missing kinds 1)."""
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

    def __post_init__(self):
        if not isinstance(self.flops, dict) or not self.flops:
            raise ValueError(f"device {self.name!r}: flops = {self.flops!r}: expected a table "
                             "dtype name -> FLOP/s")
        object.__setattr__(self, "flops", {str(k): _positive(v, f"device flops.{k}")
                                           for k, v in self.flops.items()})
        object.__setattr__(self, "memory_bandwidth",
                           _positive(self.memory_bandwidth, "device memory_bandwidth"))
        object.__setattr__(self, "memory_bytes",
                           _positive(self.memory_bytes, "device memory_bytes"))
        if not isinstance(self.efficiency, dict):
            raise ValueError(f"device {self.name!r}: efficiency = {self.efficiency!r}: expected "
                             "a table block kind -> fraction of the rate")
        eff = {str(k): _positive(v, f"device efficiency.{k}") for k, v in self.efficiency.items()}
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
                str(k): _positive(v, f"device {table}.{k}", allow_zero=True)
                for k, v in value.items()})
        if not isinstance(self.forward, dict):
            raise ValueError(f"device {self.name!r}: forward = {self.forward!r}: expected a "
                             "table block kind -> share of the forward pass")
        fwd = {str(k): _positive(v, f"device forward.{k}") for k, v in self.forward.items()}
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
            halves[str(k)] = tuple(_positive(x, f"device split.{k}") for x in v)
        object.__setattr__(self, "split", halves)
        for table, key, names in (("update", "optimizer", ("max_params", "seconds_per_param")),
                                  ("tokens", "block kind", ("tokens", "slowdown"))):
            value = getattr(self, table)
            if not isinstance(value, dict):
                raise ValueError(f"device {self.name!r}: {table} = {value!r}: expected a table "
                                 f"{key} -> [[{', '.join(names)}], ..., [inf, {names[1]}]]")
            object.__setattr__(self, table, {
                str(k): _pieces(v, f"device {table}.{k}", names) for k, v in value.items()})

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
        return 1.0 if tokens is None or pieces is None else _log_interp(
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
        slow = self.slowdown(kind, tokens)
        rest = (calls * self.overhead.get(kind, 0.0)
                + cache_bytes * self.elementwise.get(kind, 0.0) * slow)
        return flops / self.rate(dtype, kind) * slow + (share if forward else 1 - share) * rest

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
        per_param = _log_interp(pieces, n_params, f"device {self.name!r}: n_params")
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
        factor = _finite_positive(factor, "device slowdown factor")
        return replace(self, flops={k: v / factor for k, v in self.flops.items()},
                       memory_bandwidth=self.memory_bandwidth / factor,
                       **{t: {k: v * factor for k, v in getattr(self, t).items()}
                          for t in ("overhead", "elementwise", "activation")},
                       update={k: tuple((n, s * factor) for n, s in v)
                               for k, v in self.update.items()})


@dataclass(frozen=True)
class Machine:
    """Devices at the leaves of ``levels`` (innermost first): p = product of the fan-outs."""
    name: str
    levels: tuple
    device: Device
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "levels", tuple(self.levels))
        if not all(isinstance(lv, Level) for lv in self.levels):
            raise ValueError(f"machine {self.name!r}: levels must be Level objects")
        names = [lv.name for lv in self.levels]
        if len(set(names)) != len(names):
            raise ValueError(f"machine {self.name!r}: level names repeat: {names}")

    @property
    def p(self) -> int:
        return math.prod(lv.fanout for lv in self.levels)

    def _spans(self) -> list:
        """Devices under each level, innermost first (level l holds prod_{i<=l} p_i devices)."""
        spans, n = [], 1
        for lv in self.levels:
            n *= lv.fanout
            spans.append(n)
        return spans

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
        for lv, span in zip(self.levels, self._spans()):
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
        lines = [f"name = {_toml_str(self.name)}", f"source = {_toml_str(self.source)}", "",
                 "[device]", f"name = {_toml_str(self.device.name)}",
                 f"memory_bandwidth = {_toml_num(self.device.memory_bandwidth)}   # bytes/s",
                 f"memory_bytes = {_toml_num(self.device.memory_bytes)}", "",
                 "[device.flops]                  # FLOP/s per dtype"]
        lines += [f"{_toml_str(k)} = {_toml_num(v)}" for k, v in self.device.flops.items()]
        for table, what in (("efficiency", "fraction of the rate per block kind"),
                            ("overhead", "seconds per forward + backward of one block"),
                            ("elementwise", "seconds per byte of a block's cache (held: of "
                                            "activations held beyond one micro-batch's)"),
                            ("activation", "seconds per byte of a ReLU's output"),
                            ("forward", "share of overhead + elementwise in the forward"),
                            ("split", "zero-bubble backward halves [input, weight]")):
            if getattr(self.device, table):
                lines += ["", f"[device.{table}]".ljust(32) + f"# {what}"]
                lines += [f"{_toml_str(k)} = " + (
                    f"[{', '.join(_toml_num(x) for x in v)}]" if isinstance(v, tuple)
                    else _toml_num(v)) for k, v in getattr(self.device, table).items()]
        for table, what in (("update", "optimizer step: [max_params, seconds_per_param] "
                                       "(float32)"),
                            ("tokens", "slowdown by tokens per call: [tokens, slowdown]")):
            if getattr(self.device, table):
                lines += ["", f"[device.{table}]".ljust(32) + f"# {what}"]
                lines += [f"{_toml_str(k)} = {_toml_pieces(pieces)}"
                          for k, pieces in getattr(self.device, table).items()]
        if not self.levels:
            lines.insert(2, "levels = []                     # one device, no network")
        for lv in self.levels:
            lines += ["", "[[levels]]                      # innermost first",
                      f"name = {_toml_str(lv.name)}", f"fanout = {lv.fanout}",
                      f"latency_s = {_toml_num(lv.latency_s)}",
                      f"bandwidth = {_toml_pieces(lv.bandwidth)}   # [max_bytes, bytes_per_s]"]
            if lv.reduce_bandwidth:
                lines.append(f"reduce_bandwidth = {_toml_pieces(lv.reduce_bandwidth)}"
                             "   # a ring allreduce's step")
            if lv.handoff:
                lines.append(f"handoff = {_toml_pieces(lv.handoff)}"
                             "   # [after_s, seconds]: a blocking exchange's wait for its peer's "
                             "core after that much compute")
            if lv.bubble_weight != 1:
                lines.append(f"bubble_weight = {_toml_num(lv.bubble_weight)}"
                             "   # a pipeline's fill and drain, share of their length")
            if lv.collective_scale != 1:
                lines.append(f"collective_scale = {_toml_num(lv.collective_scale)}"
                             "   # the executor's collectives in training / after_compute")
            if lv.group_scales:
                lines.append("group_scales = [" + ", ".join(
                    f"[{n}, {_toml_num(k)}]" for n, k in lv.group_scales)
                    + "]   # [n, k]: the scale of the curves of n ranks, where not the one above")
            if lv.after_compute:
                lines += ["", "[levels.after_compute]".ljust(32) + "# a collective's seconds "
                          "after c seconds of compute: [c, bytes, seconds]"]
                lines += [f"{_toml_str(k)} = [" + ", ".join(
                    f"[{_toml_num(c)}, {_toml_num(b)}, {_toml_num(t)}]" for c, b, t in rows)
                    + "]" for k, rows in lv.after_compute.items()]
        return "\n".join(lines) + "\n"


def _toml_str(s: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's for the characters that matter here)."""
    import json
    return json.dumps(s, ensure_ascii=False)


def _toml_num(x: float) -> str:
    """A float written so it reads back identical: inf as TOML's inf, whole numbers short."""
    if math.isinf(x):
        return "inf"
    if x == int(x) and abs(x) < 2**53:
        return str(int(x))
    return repr(float(x))


def _toml_pieces(pieces) -> str:
    """Pieces ((max, value), ...) as a TOML array of pairs, inf written as TOML's inf."""
    return "[" + ", ".join(f"[{_toml_num(m)}, {_toml_num(v)}]" for m, v in pieces) + "]"


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
                        activation=dev.get("activation", {}), tokens=dev.get("tokens", {}))
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
                                group_scales=lv.get("group_scales", ())))
    with _named(where):
        return Machine(name=str(_get(doc, "name", where)), levels=tuple(levels), device=device,
                       source=str(doc.get("source", "")))


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
