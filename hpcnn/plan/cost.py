"""Operator-level costs of the hybrid-parallel planner (H. Wang's HSM2DL, MindSpore's SAPP).

A model is a graph of matmul-like operators ``y[i, j] = sum_k x[i, k] W[k, j]`` (``i`` batch rows,
``k`` reduction, ``j`` output features); elementwise operators have no cut of their own and follow
their producer (:func:`chain` folds them into the edge that passes through them).

Two costs, the first to search with, the second to price a finished strategy:

1. **SAPP cut costs**, in tensor elements, one bisection at a time (docs/REFERENCES section 3). An
   operator's plan over ``p = 2**L`` devices is a *cut sequence* of ``L`` letters from ``"ijkr"``:
   at bisection ``t`` it halves its local extent ``i``, ``j`` or ``k`` (an even extent >= 2), or
   replicates (``r``). Intra costs, with the local extents before the bisection: ``i``
   mu * j * k / 2 (gradient sync of the shared weights), ``j`` i * k / 2 (both halves need the
   whole input), ``k`` i * j / 2 (partial sums to reduce), ``r`` i * j * k / 2 (our choice, the
   thesis is silent: the repeated multiply-adds, so that replicating loses to any legal cut
   unless redistribution pays for it). Between a producer ``a`` and a consumer ``b`` (``a``'s
   output ``y[i, j_a]`` is ``b``'s input ``x[i, k_b]``) the redistribution cost is
   ``rho * |x|_local`` when ``a`` splits it (rows ``i``, columns ``j``, none for ``k``, ``r``)
   otherwise than ``b`` needs it (rows ``i``, columns ``k``, whole for ``j``, ``r``), except
   (our choice) when each producer half holds the whole tensor: then nothing moves. A plan's SAPP
   total sums all intra and redistribution costs over the bisections; ``mu = 0.25``,
   ``rho = 16`` (SAPP's early values).

2. **A BSP price** in seconds of a strategy of :class:`Cut` per operator on a machine
   (:class:`hpcnn.plan.machine.Machine`: ``p``, ``bisection_level(k).message_seconds(nbytes)``,
   ``device.compute_seconds(flops, dtype)``), as supersteps of one training step, see
   :func:`strategy_cost`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from hpcnn.schedule.placement import Cut, Placement, exchange_group   # what the executor runs
from hpcnn.plan.hybrid import DTYPE_BYTES, STATE_WORDS, UPDATE_PASSES, update_seconds

MU = 0.25      # SAPP's weight of a batch cut (the gradient sync happens once per step)
RHO = 16.0     # SAPP's weight of a redistribution between neighbours
CUTS = "ijkr"  # the four choices at one bisection; this order breaks ties

# How each choice lays out the shared tensor at one bisection: "row", "col" or None (whole).
PRODUCER_SPLIT = {"i": "row", "j": "col", "k": None, "r": None}   # of its output y[i, j]
CONSUMER_SPLIT = {"i": "row", "k": "col", "j": None, "r": None}   # of its input x[i, k]


class Matmul(NamedTuple):
    """y[i, j] = x[i, k] @ W[k, j]: i batch rows, k reduction, j output features."""
    i: int
    k: int
    j: int
    name: str = ""


class Elementwise(NamedTuple):
    """An operator with no cut of its own (activation, bias, dropout): it follows its producer."""
    name: str = ""


class Graph(NamedTuple):
    """Matmul operators and the edges (producer, consumer) of the tensors they share."""
    ops: tuple
    edges: tuple


def chain(nodes) -> Graph:
    """The graph of a chain of Matmul and Elementwise nodes; elementwise ones are folded away.

    An elementwise node passes its producer's output on unchanged in shape, so the next matmul
    reads its producer's tensor: the edge goes from that producer. Raises ValueError when a
    consumer's reduction extent or batch does not match its producer's output.
    """
    ops, edges, last = [], [], None
    for n, node in enumerate(nodes):
        if isinstance(node, Elementwise):
            continue
        if not isinstance(node, Matmul):
            raise ValueError(f"node {n}: {node!r} is neither Matmul nor Elementwise")
        if min(node.i, node.k, node.j) < 1:
            raise ValueError(f"node {n}: extents must be >= 1, "
                             f"got i={node.i} k={node.k} j={node.j}")
        if last is not None:
            prev = ops[last]
            if (prev.i, prev.j) != (node.i, node.k):
                raise ValueError(f"node {n}: input (i={node.i}, k={node.k}) does not match the "
                                 f"producer's output (i={prev.i}, j={prev.j})")
            edges.append((last, len(ops)))
        last = len(ops)
        ops.append(node)
    return Graph(tuple(ops), tuple(edges))


def mlp_graph(dims, batch: int) -> Graph:
    """An MLP of widths ``dims`` (input, hidden..., output) on ``batch`` rows as the planner sees
    it: a chain of Matmuls with a ReLU between neighbours."""
    nodes = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        nodes += [Matmul(batch, a, b, f"fc{i}"), Elementwise(f"relu{i}")]
    return chain(nodes[:-1])


def check_graph(graph: Graph) -> None:
    """ValueError naming the edge when an edge leaves the operators or joins unequal shapes."""
    n = len(graph.ops)
    for a, b in graph.edges:
        if not (0 <= a < n and 0 <= b < n and a != b):
            raise ValueError(f"edge ({a}, {b}) does not join two of the {n} operators")
        pa, pb = graph.ops[a], graph.ops[b]
        if (pa.i, pa.j) != (pb.i, pb.k):
            raise ValueError(f"edge ({a}, {b}): output (i={pa.i}, j={pa.j}) is not the "
                             f"consumer's input (i={pb.i}, k={pb.k})")


def log2_devices(p: int) -> int:
    """L with p = 2**L; ValueError unless p is a power of two >= 1."""
    if p < 1 or p & (p - 1):
        raise ValueError(f"the planner bisects the devices: p ({p}) must be a power of two")
    return p.bit_length() - 1


def cut_costs(i: int, k: int, j: int, mu: float = MU) -> tuple:
    """SAPP intra costs of cutting local extents (i, k, j) in two, in CUTS order; inf if illegal."""
    inf = math.inf
    return (mu * j * k / 2 if i % 2 == 0 else inf,
            i * k / 2 if j % 2 == 0 else inf,
            i * j / 2 if k % 2 == 0 else inf,
            i * j * k / 2)


def redistribution_cost(producer_cut: str, consumer_cut: str, local_input: float,
                        rho: float = RHO) -> float:
    """rho * |x| when the producer's split of the shared tensor is not the consumer's."""
    have = PRODUCER_SPLIT[producer_cut]
    if have is None or have == CONSUMER_SPLIT[consumer_cut]:
        return 0.0
    return rho * local_input


def local_extents(op: Matmul, prefix: str) -> tuple:
    """(i, k, j) of one device's part after the cuts of ``prefix``."""
    return (op.i >> prefix.count("i"), op.k >> prefix.count("k"), op.j >> prefix.count("j"))


def sapp_cost(graph: Graph, sequences, mu: float = MU, rho: float = RHO) -> float:
    """The SAPP total of a plan: one cut sequence per operator, all of the same length L.

    inf when a sequence cuts an odd extent or an extent of 1.
    """
    if len(sequences) != len(graph.ops):
        raise ValueError(f"{len(sequences)} sequences for {len(graph.ops)} operators")
    lengths = {len(s) for s in sequences}
    if len(lengths) > 1:
        raise ValueError(f"cut sequences of different lengths {sorted(lengths)}")
    total = 0.0
    inputs = []                       # per operator, its local input size before each bisection
    for op, seq in zip(graph.ops, sequences):
        i, k, j = op.i, op.k, op.j
        sizes = []
        for c in seq:
            sizes.append(i * k)
            total += cut_costs(i, k, j, mu)[CUTS.index(c)]
            i, k, j = (i // 2 if c == "i" else i, k // 2 if c == "k" else k,
                       j // 2 if c == "j" else j)
        inputs.append(sizes)
    for a, b in graph.edges:
        for t, (ca, cb) in enumerate(zip(sequences[a], sequences[b])):
            total += redistribution_cost(ca, cb, inputs[b][t], rho)
    return total


def to_cut(sequence: str, p: int) -> Cut:
    """The product of a cut sequence's halvings: Cut(batch=2**#i, reduce=2**#k, out=2**#j)."""
    if 2 ** len(sequence) != p:
        raise ValueError(f"sequence {sequence!r} has {len(sequence)} bisections, p = {p}")
    return Cut(2 ** sequence.count("i"), 2 ** sequence.count("k"), 2 ** sequence.count("j"))


# ---------------------------------------------------------------- the BSP price of a strategy

class Term(NamedTuple):
    """One superstep's contribution: what it is, its formula in the machine's symbols, seconds;
    for a communication, the bytes of its buffer and the devices it joins, for an update the
    bytes of the parameters it updates (a profiling planner runs the same message or update,
    experiments/plan_portability.py)."""
    what: str
    formula: str
    seconds: float
    nbytes: float = 0.0
    devices: int = 1


class StrategyCost(NamedTuple):
    """The supersteps of one training step, and the bytes the fullest device holds
    (:func:`strategy_memory`)."""
    terms: tuple
    memory_bytes: float = 0.0

    @property
    def seconds(self) -> float:
        return float(sum(t.seconds for t in self.terms))

    def formula(self) -> str:
        return " + ".join(t.formula for t in self.terms)


def _level(machine, span: int):
    """The level of the outermost bisection a group of ``span`` consecutive devices crosses."""
    L = log2_devices(machine.p)
    return machine.bisection_level(L - log2_devices(span))


def _allreduce(machine, what: str, n: int, stride: int, nbytes: float,
               after: float = 0.0) -> Term | None:
    """Ring allreduce of nbytes over n devices ``stride`` apart: 2(n-1) steps of nbytes/n
    (:meth:`hpcnn.plan.machine.Level.allreduce_seconds`), its handoff after ``after`` seconds
    of compute; or, where the level has ``after_compute`` curves (calibrated where ranks share
    cores), the "allreduce" curve's seconds for its bytes after that compute
    (:meth:`hpcnn.plan.machine.Level.collective_seconds`, A in the formulas): measured after
    compute, they hold the wait for the group's last rank, and replace the ring and the
    handoff."""
    if n == 1 or nbytes == 0:
        return None
    lvl = _level(machine, n * stride)
    measured = lvl.collective_seconds("allreduce", n, nbytes, after)
    if measured is not None:
        return Term(what, f"{_scale(lvl, 'allreduce', n)}A{n}_{lvl.name}({nbytes:g})", measured,
                    nbytes, n)
    g = "r" if lvl.reduce_bandwidth else "g"            # a reduce step's rate, or a message's
    return Term(what, f"{_handoff(lvl)}2*({n}-1)*(L_{lvl.name} + {nbytes / n:g}*{g}_{lvl.name})",
                lvl.allreduce_seconds(nbytes, n, after), nbytes, n)


def _handoff(lvl) -> str:
    """The handoff's symbol in a formula, where the level has one (ranks sharing cores)."""
    return f"H_{lvl.name} + " if any(h for _, h in lvl.handoff) else ""


def _scale(lvl, kind: str, n: int) -> str:
    """The symbol of the scale of the level's curve for a ``kind`` collective over ``n`` ranks
    in a formula, where it is not 1: K_level (``collective_scale``), KN_level for a curve of N
    ranks with its own (``group_scales``)."""
    group = lvl.curve_group(kind, n)
    own = group in dict(lvl.group_scales)
    return f"K{group if own else ''}_{lvl.name}*" if lvl.scale_of(group) != 1 else ""


def _product(compute: Term) -> float:
    """Seconds of one of an operator's three products (forward, input gradient, weight
    gradient) from its compute term: a third of it, the compute before each of its
    collectives and redistributions (their handoff's ``after``)."""
    return compute.seconds / 3


def _local_params(op, c: Cut) -> float:
    """Parameters of operator ``op``'s weight part W[k/nk, j/nj] and bias part b[j/nj]."""
    return (op.k / c.reduce + 1) * op.j / c.out


def _operator_terms(n: int, op, c: Cut, machine, dtype: str, optimizer: str,
                    relu: bool, held: float) -> list:
    """The supersteps of operator ``n`` under Cut ``c`` (see :func:`strategy_cost`): compute,
    update, the reductions of y and dx and the gradient allreduce; ``relu``: a ReLU follows;
    ``held``: the parameters of every operator's part on a device, whose step's seconds per
    parameter the update takes."""
    p, size = machine.p, DTYPE_BYTES[dtype]
    width = c.batch * c.reduce * c.out
    if p % width:
        raise ValueError(f"operator {n}: {c} uses {width} devices, which does not divide p = {p}")
    flops = 3 * 2 * op.i * op.j * op.k / width
    rows = op.i / c.batch
    cache = rows * op.k / c.reduce * size                    # the cached input x
    act = rows * op.j / c.out * size if relu else 0.0       # the ReLU's output y
    flop_s = f"3*2*{op.i}*{op.j}*{op.k}/{width}/(F_{dtype}*e_linear)"
    bytes_s = f" + {cache:g}*c_linear" + (f" + {act:g}*a_linear" if act else "")
    terms = [Term(f"op{n} compute",              # slowed by its rows where the device says
                  f"S_linear({rows:g})*({flop_s}{bytes_s}) + o_linear"
                  if "linear" in machine.device.tokens else f"{flop_s} + o_linear{bytes_s}",
                  machine.device.compute_seconds(flops, dtype, "linear", 1, cache, act,
                                                 tokens=rows))]
    after = _product(terms[0])           # each collective follows one of the products
    local = _local_params(op, c)                           # weight and bias parts
    measured = optimizer in getattr(machine.device, "update", {})
    terms.append(Term(f"op{n} update", f"{local:g}*U_{optimizer}({held:g})*{size}/4" if measured
                      else f"{UPDATE_PASSES[optimizer]}*3*{local:g}*{size}/B_mem",
                      local * update_seconds(held, size, machine.device, optimizer) / held,
                      local * size))
    for t in (_allreduce(machine, f"op{n} reduce y", c.reduce, c.out, rows * op.j / c.out * size,
                         after),
              _allreduce(machine, f"op{n} reduce dx", c.out, 1, rows * op.k / c.reduce * size,
                         after),
              _allreduce(machine, f"op{n} grad allreduce", c.batch, c.reduce * c.out,
                         local * size, after)):          # one buffer [dW | db], as executed
        if t is not None:
            terms.append(t)
    return terms


def strategy_cost(graph: Graph, cuts, machine, dtype: str = "float32",
                  optimizer: str = "adamw", loss: bool = True) -> StrategyCost:
    """BSP seconds of one training step of ``graph`` with one Cut per operator on ``machine``.

    Supersteps per operator with Cut(nb, nk, nj), c = nb*nk*nj, r = p/c replicas:
      - compute: forward, input gradient and weight gradient, 3 * 2*i*j*k/c FLOPs at the
        device rate times its "linear" efficiency, plus the fixed cost of one "linear" block
        call, the element-wise seconds of its cache, the local input x[i/nb, k/nk], and those
        of the ReLU's y[i/nb, j/nj] after every operator but the last
        (:class:`hpcnn.plan.machine.Device` efficiency, overhead, elementwise, activation);
      - forward reduction of the partial y[i/nb, j/nj] over the nk group (stride nj);
      - backward reduction of the partial dx[i/nb, k/nk] over the nj group (stride 1);
      - gradient allreduce of the weight and bias parts W[k/nk, j/nj] and b[j/nj] (one buffer,
        as the executor sends it) over the batch group, the nb devices
        holding it for different rows (stride nk*nj); the r replicas computed the same rows and
        hold the same gradient already (:class:`hpcnn.parallel.layout.LayoutLinear`);
      - the optimizer's update of the local weight part W[k/nk, j/nj] and bias part b[j/nj]
        (:func:`hpcnn.plan.hybrid.update_seconds`: the device's measured seconds per parameter
        U(n), or passes over memory at its bandwidth), at U of all the parts a device holds;
    and per edge, the executor's redistribution of the producer's output y[i/nb, j/nj] into the
    consumer's input x[i/nb', k/nk'] (:func:`_moves`): a message in the forward where a device
    needs data it does not hold, one in the backward where the gradient's way back does, at the
    level of the larger of the two operators' partition groups, joining the devices its
    messages connect (:func:`hpcnn.schedule.placement.exchange_group`); with ``loss``, the last
    operator's output gathered whole on every device for the softmax cross-entropy (the
    executor's ``to_loss``), which costs nothing backward.

    A group of n devices spaced ``stride`` apart spans n*stride consecutive devices; its level is
    the one of the outermost bisection it crosses, machine.bisection_level(log2 p - log2 span).
    Allreduces are rings, 2(n-1) steps of bytes/n at the level's calibrated reduce rate (one
    message a step where the level has none). Where the level's ranks share cores, every
    allreduce and message also pays its handoff once (``Level.handoff``, H in the formulas),
    after one product of compute (a third of the operator's forward + backward: an operator's
    collectives each follow one of its products; a redistribution forward follows the
    producer's, backward the consumer's). Where the level has ``after_compute`` curves, they
    price both instead (:func:`_allreduce`, :func:`_move_term`). Supersteps add (no overlap).
    """
    p = machine.p
    size = DTYPE_BYTES[dtype]
    if len(cuts) != len(graph.ops):
        raise ValueError(f"{len(cuts)} cuts for {len(graph.ops)} operators")
    terms, product = [], []       # product[n]: one of operator n's three products, seconds
    held = sum(_local_params(op, c) for op, c in zip(graph.ops, cuts))
    for n, (op, c) in enumerate(zip(graph.ops, cuts)):
        own = _operator_terms(n, op, c, machine, dtype, optimizer, n < len(graph.ops) - 1, held)
        product.append(_product(own[0]))
        terms += own
    for a, b in graph.edges:
        ca, cb = cuts[a], cuts[b]
        terms += _moves(f"{a}->{b}", Placement.output_of(ca, p), Placement.input_of(cb, p),
                        graph.ops[b].i, graph.ops[b].k, size, machine,
                        max(x.batch * x.reduce * x.out for x in (ca, cb)),
                        (product[a], product[b]))
    if loss and graph.ops:        # the logits gathered whole on every device, for the loss
        last, c = graph.ops[-1], cuts[-1]
        terms += _moves(f"{len(graph.ops) - 1}->loss", Placement.output_of(c, p),
                        Placement.full(p), last.i, last.j, size, machine,
                        c.batch * c.reduce * c.out, (product[-1], 0.0))
    return StrategyCost(tuple(terms), strategy_memory(graph, cuts, dtype, optimizer, loss))


def _moves(what: str, src: Placement, dst: Placement, rows: int, cols: int, size: int,
           machine, span: int, after=(0.0, 0.0)) -> list:
    """The messages of the executor's :class:`hpcnn.parallel.layout.Redistribute` of a
    ``rows`` x ``cols`` activation from ``src`` to ``dst``: in the forward, one message of
    ``dst``'s part where some device needs data it does not hold (where the move's exchange
    group, below, has more than one device), plus the batch size's all-gather where the source
    cuts the rows differently; in the backward, one message of ``src``'s part where the
    gradient's move back crosses (a replicated producer needs the whole gradient: a consumer
    that only sliced its input in the forward gathers it in the backward). One message each,
    at the level of ``span`` consecutive devices (our choice, an upper bound for the
    all-to-all: the thesis prices redistribution by volume only), joining the devices of the
    largest set its messages connect (:func:`hpcnn.schedule.placement.exchange_group`: a gather
    along pairs is an exchange between 2 devices, priced on the curve of 2 where the level has
    one); the batch size's all-gather joins all ``span``. ``after``: the compute before
    the forward's message and before the backward's (the producer's product, the consumer's),
    for the level's handoff."""
    out = []
    for direction, a, b, before in (("", src, dst, after[0]), (" gradient", dst, src, after[1])):
        group = exchange_group(a, b, rows, cols)     # > 1 exactly where a piece crosses
        if group > 1:
            nbytes = math.ceil(rows / b.rows) * math.ceil(cols / b.cols) * size
            out.append(_move_term(f"redistribute {what}{direction}", _level(machine, span),
                                  nbytes, group, before))
    if src.rows > 1 and not src.same_rows(dst):
        out.append(_move_term(f"redistribute {what} batch size", _level(machine, span), 8,
                              span, after[0]))
    return out


def _move_term(what: str, lvl, nbytes: float, group: int, after: float) -> Term:
    """One redistribution's exchange of ``nbytes`` (the part a device ends with) among
    ``group`` devices after ``after`` seconds of compute: the level's "alltoall" curve after
    compute where it has one (:meth:`hpcnn.plan.machine.Level.collective_seconds`, X in the
    formulas; the executor's redistributions are all-to-alls), else one message and its
    handoff."""
    measured = lvl.collective_seconds("alltoall", group, nbytes, after)
    if measured is not None:
        return Term(what, f"{_scale(lvl, 'alltoall', group)}X{group}_{lvl.name}({nbytes:g})",
                    measured, nbytes, group)
    return Term(what, f"({_handoff(lvl)}L_{lvl.name} + {nbytes:g}*g_{lvl.name})",
                lvl.message_seconds(nbytes, after), nbytes, group)


def strategy_memory(graph: Graph, cuts, dtype: str = "float32", optimizer: str = "adamw",
                    loss: bool = True) -> float:
    """Bytes the fullest device holds at the peak of a training step with one Cut per operator,
    as the layout executor (:func:`hpcnn.parallel.layout.layout_mlp`) holds them: per operator
    under Cut(nb, nk, nj) its weight part W[k/nk, j/nj] and bias part b[j/nj] with their
    gradients and optimizer state (:data:`hpcnn.plan.hybrid.STATE_WORDS` words per parameter),
    its cached input x[i/nb, k/nk] and, but after the last operator, the ReLU's output
    y[i/nb, j/nj]; the optimizer's scratch array, the size of the largest local parameter;
    with ``loss``, the softmax cross-entropy's probabilities of the last operator's output,
    gathered whole on every device, and its 9 bytes per row (int64 target, row mask). A part
    counts its largest size (ceil) where an extent does not divide. Transients (a product's
    output, the [dW | db] buffer, message buffers) are not counted: they live inside one pass.
    """
    size = DTYPE_BYTES[dtype]
    words, largest, n_ops = 0.0, 0.0, len(graph.ops)
    for n, (op, c) in enumerate(zip(graph.ops, cuts)):
        rows, k, j = -(-op.i // c.batch), -(-op.k // c.reduce), -(-op.j // c.out)
        words += STATE_WORDS[optimizer] * (k + 1) * j + rows * k + (rows * j if n < n_ops - 1
                                                                     else 0)
        largest = max(largest, k * j)
    per_row = 0
    if loss and n_ops:                  # the probabilities, and the target and mask per row
        last = graph.ops[-1]
        words, per_row = words + last.i * last.j, 9 * last.i
    return float((words + largest) * size + per_row)
