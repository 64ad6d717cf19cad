"""The bytes a block's memory-bound operations move: LayerNorm, softmax, GELU, dropout, residuals.

Where a machine file prices its device's element-wise work by the bytes moved (``moved`` in
``[device.elementwise]``: seconds per byte, the inverse of the memory bandwidth), the planner
(:mod:`hpcnn.plan.hybrid`) asks :func:`moved` for each pass's bytes, from the block's own
``spec()`` (:class:`hpcnn.nn.core.BlockSpec`): its leaves say what each operation reads,
writes and keeps. The counting rule, each operation one pass over memory (a fused kernel's),
nothing kept on chip between operations:

- **forward**: an operation reads its input and writes its output and what it keeps for the
  backward beyond them (a dropout's mask, LayerNorm's normalized input);
- **backward**: it reads its output's gradient and its cache and writes its input's gradient;
- a **residual add** reads two inputs (its spec names one) and its backward adds two
  gradients: one input more each way;
- the attention **scores**: their GEMM (Q K^T) is priced on its roofline
  (:mod:`hpcnn.plan.gemm`); the softmax reads the scores and writes the probabilities
  (forward: 2 score-sized arrays), then reads their gradient and the probabilities and writes
  the scores' gradient (backward: 3);
- the **GEMM leaves** (QKV, the projections, the MLP's two, att V; :data:`GEMM_LEAVES`) move
  nothing here: the roofline counts their operands, their bias adds fused into them; nor does
  an identity (a leaf without FLOPs: dropout at p = 0).

The loss's tail (:func:`tail`: the final LayerNorm, the softmax cross-entropy over the
vocabulary) follows the same rule. This is a count of traffic, not a measurement: kernels that
fuse several operations move less, an unfused framework more.
"""
from __future__ import annotations

# Leaves of a GPT block's spec() that are GEMMs alone (by name suffix: hpcnn.nn.transformer's
# and hpcnn.parallel.tensor.attention's sub-blocks).
GEMM_LEAVES = (".qkv", ".proj", ".fc", ".av")
# The attention core's memory-bound leaves: what selective recomputation runs again.
CORE_LEAVES = (".scores", ".attn.drop")
RESIDUALS = (".res", ".res1", ".res2")


def leaves(spec) -> list:
    """The leaves of a spec tree, in order."""
    if not spec.children:
        return [spec]
    return [leaf for c in spec.children for leaf in leaves(c)]


def leaf_moved(leaf) -> tuple:
    """(forward, backward) bytes one leaf's memory-bound work moves (module docstring)."""
    name = leaf.name
    if name.endswith(GEMM_LEAVES) or not (leaf.flops_fwd or leaf.flops_bwd):
        return 0, 0             # a GEMM, or an identity (dropout at p = 0: its input passed on)
    if name.endswith(".scores"):
        return 2 * leaf.bytes_y, 3 * leaf.bytes_y
    extra = leaf.bytes_x if name.endswith(RESIDUALS) else 0
    forward = leaf.bytes_x + leaf.bytes_y + leaf.bytes_cache_own + extra
    backward = leaf.bytes_y + leaf.bytes_x + leaf.bytes_cache + extra
    return forward, backward


def moved(spec) -> tuple:
    """(forward, backward, attention core's forward) bytes the memory-bound leaves of ``spec``
    move in one pass each."""
    fwd = bwd = core = 0
    for leaf in leaves(spec):
        f, b = leaf_moved(leaf)
        fwd, bwd = fwd + f, bwd + b
        if leaf.name.endswith(CORE_LEAVES):
            core += f
    return fwd, bwd, core


def tail(specs) -> tuple:
    """(forward, backward) bytes of the loss's tail: the leaves of ``specs`` (the final
    LayerNorm's and the loss's spec; the LM head's GEMM is on its roofline)."""
    fwd = bwd = 0
    for spec in specs:
        f, b, _ = moved(spec)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd
