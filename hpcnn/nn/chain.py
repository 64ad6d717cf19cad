"""A model is a chain of blocks followed by a loss."""
from __future__ import annotations

from hpcnn.nn.core import Block, BlockSpec


def splittable(block) -> bool:
    """True for a block whose backward comes in two halves, ``backward_input`` (dx) and
    ``backward_weight`` (the parameter gradients): a Linear."""
    return hasattr(block, "backward_input") and hasattr(block, "backward_weight")


def backward_block(block, dy, cache, *, need_dx: bool = True, defer=None):
    """One block's backward from its output gradient ``dy``; returns dx (None when not
    ``need_dx`` and the block can skip it). The one place that decides how a block's backward
    runs: whole; weight half only (``need_dx=False``, a splittable block first in the chain);
    or, with ``defer`` a list, the input half now and the weight halves appended to ``defer``
    as (block, dy, cache) for later (a composite block's inner Linears defer theirs too)."""
    if splittable(block) and (defer is not None or not need_dx):
        if defer is not None:
            defer.append((block, dy, cache))
        else:
            block.backward_weight(dy, cache)
        return block.backward_input(dy, cache) if need_dx else None
    if defer is not None and getattr(block, "defers_weights", False):
        return block.backward(dy, cache, defer=defer)
    return block.backward(dy, cache)


class Chain:
    """Blocks run in order, then the loss.

    ``forward(x, targets) -> (loss, caches)`` and ``backward(dloss, caches) -> dx`` (dx is None when the
    first block takes integer tokens). ``chain[i:j]`` is a sub-chain sharing the same blocks (and
    parameters): pipeline stages are slices; the loss belongs to the slice that reaches the end.
    """

    def __init__(self, blocks, loss=None, name: str = "chain"):
        self.blocks: list[Block] = list(blocks)
        self.loss = loss
        self.name = name

    # -- structure ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self.blocks))
            if step != 1:
                raise ValueError("a sub-chain is a contiguous slice (step 1)")
            loss = self.loss if stop == len(self.blocks) else None
            return Chain(self.blocks[start:stop], loss, name=f"{self.name}[{start}:{stop}]")
        return self.blocks[idx]

    @property
    def params(self):
        return [p for b in self.blocks for p in b.params]

    def num_params(self) -> int:
        return sum(p.size for p in self.params)

    def zero_grad(self) -> None:
        for b in self.blocks:
            b.zero_grad()

    def train(self, mode: bool = True) -> "Chain":
        for b in self.blocks:
            b.train(mode)
        return self

    def eval(self) -> "Chain":
        return self.train(False)

    def rng_state(self):
        return [b.rng_state() for b in self.blocks]

    def set_rng_state(self, state) -> None:
        for b, s in zip(self.blocks, state):
            b.set_rng_state(s)

    # -- compute --------------------------------------------------------------------------------
    def forward_blocks(self, x):
        """Run the blocks (not the loss): returns the output and the list of caches."""
        caches = []
        for b in self.blocks:
            x, c = b.forward(x)
            caches.append(c)
        return x, caches

    def backward_blocks(self, dy, caches, need_dx: bool = True, on_block_done=None, defer=None):
        """Backward through the blocks in reverse; returns the input gradient. The project's one
        reverse-over-blocks loop: serial, data-parallel and pipeline steps all run it (the
        rematerializing executor runs the same per-block step, :func:`backward_block`, one op
        at a time).

        With ``need_dx=False`` the first block with parameters computes only its parameter
        gradients when it can (a block with ``backward_weight``), saving one matmul, and the
        parameterless blocks before it are not run backward; the return value is then None
        (or what that block's whole backward returned).
        ``on_block_done(i)`` is called after block ``i``'s gradients are complete (data
        parallelism starts communicating a bucket as soon as its gradients are ready).
        ``defer``: a list receiving the weight halves (block, dy, cache) instead of running them
        (zero-bubble pipelines run them later as W).
        """
        blocks = self.blocks
        # without dx, the leading blocks that hold no parameters (a laid-out MLP's input slice)
        # have nothing to compute: the backward stops at the first block with parameters
        first = 0 if need_dx else next((i for i, b in enumerate(blocks) if b.params), 0)
        for i in range(len(blocks) - 1, -1, -1):
            if i < first:
                dy = None
            elif defer is None and i > first:    # the common case, without the checks below
                dy = blocks[i].backward(dy, caches[i])
            else:
                dy = backward_block(blocks[i], dy, caches[i], need_dx=need_dx or i > first,
                                    defer=defer)
            if on_block_done is not None:
                on_block_done(i)
        return dy

    def forward(self, x, targets):
        """Blocks then loss: returns (loss value, caches incl. the loss cache last)."""
        if self.loss is None:
            raise ValueError(f"{self.name} has no loss: use forward_blocks")
        out, caches = self.forward_blocks(x)
        loss, lc = self.loss.forward(out, targets)
        caches.append(lc)
        return loss, caches

    def backward(self, dloss, caches, need_dx: bool = True, on_block_done=None):
        """Backward of loss then blocks from the loss-gradient factor ``dloss`` (1.0: the
        gradient of the loss itself); accumulates parameter gradients, returns dx."""
        dy = self.loss.backward(dloss, caches[-1])
        return self.backward_blocks(dy, caches[:-1], need_dx, on_block_done)

    def predict(self, x, batch_size: int | None = None):
        """Outputs of the blocks in eval mode (dropout off), in batches if asked; mode restored."""
        modes = [b.training for b in self.blocks]
        self.eval()
        try:
            if batch_size is None:
                return self.forward_blocks(x)[0]
            from hpcnn import backend
            parts = [self.forward_blocks(x[i:i + batch_size])[0]
                     for i in range(0, x.shape[0], batch_size)]
            return backend.xp.concatenate(parts, axis=0)
        finally:
            for b, m in zip(self.blocks, modes):
                b.train(m)

    # -- cost -----------------------------------------------------------------------------------
    def spec(self, x_shape, include_loss: bool = True) -> list[BlockSpec]:
        """Per-block specs for input shape ``x_shape`` (and the loss's last, if present)."""
        specs = []
        shape = tuple(x_shape)
        for b in self.blocks:
            s = b.spec(shape)
            specs.append(s)
            shape = s.out_shape
        if include_loss and self.loss is not None:
            dtype = getattr(self.blocks[-1], "dtype", None) if self.blocks else None
            specs.append(self.loss.spec(shape, dtype) if dtype is not None else self.loss.spec(shape))
        return specs

    def __repr__(self) -> str:
        inner = ", ".join(type(b).__name__ for b in self.blocks)
        return f"Chain({self.name}: {inner}; loss={type(self.loss).__name__})"
