"""Blocks with explicit forward/backward, models as chains, optimizers."""
from hpcnn.nn.chain import Chain
from hpcnn.nn.core import Block, BlockSpec, Parameter

__all__ = ["Block", "BlockSpec", "Chain", "Parameter"]
