"""The step engine: every parallel and memory method is a schedule over the same chain of blocks.

A training step on any rank is the execution of a list of :class:`~hpcnn.engine.ops.Op` records:
the serial and data-parallel step is a one-stage schedule of F/B per micro-batch, a pipeline step
is a per-rank instruction list, rematerialization is a per-stage op sequence expanded inside the
same executor. :mod:`.ops` holds the record type, :mod:`.price` the one cost entry that prices a
schedule (compute, communication, memory).
"""
