"""Every tensor-parallel block's ``spec()`` describes the cache its forward keeps on this rank
(alias flags, own cache bytes, input and output bytes): rematerialization budgets rest on it.

    mpiexec -n N python -m mpi4py tests/mpi/tp_specs.py
"""
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcnn.parallel.comm import CommStats, Communicator
from hpcnn.parallel.tensor import (ColumnParallelLinear, ParallelMLPBlock, RowParallelLinear,
                                   ShardDropout, replicated_layernorm)
from hpcnn.parallel.tensor_attn import ParallelCausalSelfAttention, ParallelTransformerBlock
from hpcnn.parallel.tensor_conv import ChannelParallelConv2d
from hpcnn.parallel.tensor_vocab import VocabParallelEmbedding

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/
from cachecheck import spec_matches_cache  # noqa: E402

world = MPI.COMM_WORLD
r, P = world.Get_rank(), world.Get_size()
comm = Communicator(world, CommStats(), name="tp")
Bn, T, C, NH, V, H = 2, 8, 16, 4, 32, 24
kw = dict(seed=4, dtype=np.float64)
rng = np.random.default_rng(3)
full = rng.standard_normal((Bn, T, C))
local = full[:, :T // P]                              # a sequence slice (sp)
wide = rng.standard_normal((Bn, T, H // P))           # a column-parallel output
failures = []
for sp in (False, True):
    xs = local.copy() if sp else full.copy()
    cases = [
        (ColumnParallelLinear(comm, C, H, sequence_parallel=sp, name="col", **kw), xs),
        (RowParallelLinear(comm, H, C, sequence_parallel=sp, name="row", **kw), wide),
        (ParallelMLPBlock(comm, C, H, dropout=0.2, sequence_parallel=sp, **kw), xs),
        (ParallelCausalSelfAttention(comm, C, NH, dropout=0.2, sequence_parallel=sp, **kw), xs),
        (ParallelTransformerBlock(comm, C, NH, dropout=0.2, sequence_parallel=sp, **kw), xs),
        (VocabParallelEmbedding(comm, V, C, T, sequence_parallel=sp, **kw),
         np.random.default_rng(5).integers(0, V, (Bn, T))),
        (replicated_layernorm(C, sequence_parallel=sp, dtype=np.float64), xs),
    ]
    if sp:
        cases += [(ShardDropout(0.3, axis=1, rank=r, size=P, **kw), xs)]
    else:
        cases += [(ColumnParallelLinear(comm, C, H, gather_output=True, name="cg", **kw), xs)]
    for block, x in cases:
        try:
            spec_matches_cache(block, x)
        except AssertionError as e:                   # every mismatch, not just the first
            failures.append(f"sp={sp}: {e}")
img = rng.standard_normal((2, 3, 8, 8))
spec_matches_cache(ChannelParallelConv2d(comm, 3, 4 * P, 3, padding=1, **kw), img)
assert not failures, "\n".join(failures)
if r == 0:
    print(f"tp_specs OK on {P} ranks")
