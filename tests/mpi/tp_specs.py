"""Every tensor-parallel block and loss keeps the block contract on this rank (tests/cachecheck.py):
its ``spec()`` counts the cache its forward keeps exactly as the memory account does (alias
flags, own cache bytes, input and output bytes), and its backward accumulates gradients.
Rematerialization budgets rest on the first, gradient accumulation (micro-batches, pipelines) on
the second.

    mpiexec -n N python -m mpi4py tests/mpi/tp_specs.py
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import hpcnn.parallel
from hpcnn.parallel.collectives import CommStats, Communicator
from hpcnn.schedule.placement import Cut, Placement
from hpcnn.parallel.layout import LayoutLinear, Redistribute
from hpcnn.parallel.tensor.linear import (ColumnParallelLinear, ParallelMLPBlock,
                                          RowParallelLinear, ShardDropout, replicated_layernorm)
from hpcnn.parallel.tensor.attention import ParallelCausalSelfAttention, ParallelTransformerBlock
from hpcnn.parallel.tensor.channel_conv import ChannelParallelConv2d
from hpcnn.parallel.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/
from cachecheck import block_kinds, grads_accumulate, spec_matches_cache  # noqa: E402

world = MPI.COMM_WORLD
r, P = world.Get_rank(), world.Get_size()
comm = Communicator(world, CommStats(), name="tp")
B, T, C, NH, V, H = 2, 8, 16, 4, 32, 24
kw = dict(seed=4, dtype=np.float64)
rng = np.random.default_rng(3)
full = rng.standard_normal((B, T, C))
local = full[:, :T // P].copy()                       # a sequence slice (sp)
wide = rng.standard_normal((B, T, H // P))           # a column-parallel output
logits = rng.standard_normal((B, T, V // P))         # this rank's vocabulary columns
targets = rng.integers(0, V, (B, T))
targets[0, :3] = -100                                 # ignored rows
img = rng.standard_normal((2, 3, 8, 8))
failures, covered = [], set()


def check(label, block, x, tgt=None):
    """Both halves of the contract; every failure is collected, not just the first."""
    covered.add(type(block))
    for what, fn in (("spec", lambda: spec_matches_cache(block, x, tgt)),
                     ("grads", lambda: grads_accumulate(block, x) if block.params else None)):
        try:
            fn()
        except AssertionError as e:
            failures.append(f"{label} {what}: {e}")


for sp in (False, True):
    xs = local if sp else full
    cases = [
        (ColumnParallelLinear(comm, C, H, sequence_parallel=sp, name="col", **kw), xs),
        (RowParallelLinear(comm, H, C, sequence_parallel=sp, name="row", **kw), wide),
        (ParallelMLPBlock(comm, C, H, dropout=0.2, sequence_parallel=sp, **kw), xs),
        (ParallelCausalSelfAttention(comm, C, NH, dropout=0.2, sequence_parallel=sp, **kw), xs),
        (ParallelTransformerBlock(comm, C, NH, dropout=0.2, sequence_parallel=sp, **kw), xs),
        (VocabParallelEmbedding(comm, V, C, T, sequence_parallel=sp, **kw),
         np.random.default_rng(5).integers(0, V, (B, T))),
        (replicated_layernorm(C, sequence_parallel=sp, dtype=np.float64), xs),
    ]
    if sp:
        cases += [(ShardDropout(0.3, axis=1, rank=r, size=P, **kw), xs)]
    else:
        cases += [(ColumnParallelLinear(comm, C, H, gather_output=True, name="cg", **kw), xs)]
    for block, x in cases:
        check(f"sp={sp} {block}", block, x)
    # the loss after an sp model's LM head: the head all-gathers, so the logits are (B, T, V/tp)
    # either way; with sum reduction too
    for reduction in ("mean", "sum"):
        check(f"sp={sp} xent-{reduction}", VocabParallelCrossEntropy(comm, reduction=reduction),
              logits, targets)
check("conv", ChannelParallelConv2d(comm, 3, 4 * P, 3, padding=1, **kw), img)
# per-layer layouts (the serial equivalence and byte counts: tests/mpi/layout_chain.py)
rows = full.reshape(-1, C)                            # (B T, C), every rank
check("layout-col", LayoutLinear(C, H, Cut(1, 1, P), comm, name="lc", **kw), rows)
check("layout-row", LayoutLinear(C, H, Cut(1, P, 1), comm, name="lr", **kw),
      rows[:, C // P * r:C // P * (r + 1)].copy())
own_rows = rows[B * T // P * r:B * T // P * (r + 1)].copy()
check("redistribute", Redistribute(Placement.output_of(Cut(P, 1, 1), P),
                                   Placement.input_of(Cut(1, P, 1), P), C, comm,
                                   dtype=np.float64), own_rows)
missing = block_kinds(hpcnn.parallel) - covered
assert not missing, f"sharded kinds not checked: {sorted(k.__name__ for k in missing)}"
assert not failures, "\n".join(failures)
if r == 0:
    print(f"tp_specs OK on {P} ranks")
