"""The step engine: every parallel and memory method is a schedule over the same chain of blocks.

A training step on any rank is the execution of a list of :class:`~hpcnn.schedule.ops.Op` records:
the serial and data-parallel step is a one-stage schedule of F/B per micro-batch, a pipeline step
is a per-rank instruction list, rematerialization is a per-stage op sequence expanded inside the
same executor, data parallelism the hook that launches gradient buckets as blocks finish.

- :mod:`.ops`: the record type; :mod:`.price`: the one cost entry that prices a schedule
  (compute, communication, memory);
- :mod:`.context`: :class:`~.context.ParallelContext`, what one rank needs to run its part of
  every step (grid, communicators, stages built once, data-parallel engine, balancer, remat);
- :mod:`.stage`: a stage (a sub-chain run as F, B, W); :mod:`.execute`: the executor of one
  rank's list; :mod:`.step`: one optimizer step; :mod:`.trace`: a step printed as it ran.
"""
