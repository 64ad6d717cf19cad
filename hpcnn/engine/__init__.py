"""The step engine: every parallel and memory method is a schedule over the same chain of blocks.

A training step on any rank is the execution of a list of :class:`~hpcnn.schedule.ops.Op` records
(built, validated and priced by :mod:`hpcnn.schedule`): the serial and data-parallel step is a
one-stage schedule of F/B per micro-batch, a pipeline step is a per-rank instruction list,
rematerialization is a per-stage op sequence expanded inside the same executor, data parallelism
the hook that launches gradient buckets as blocks finish.

- :mod:`.context`: :class:`~.context.ParallelContext`, what one rank needs to run its part of
  every step (grid, communicators, stages built once, data-parallel engine, balancer, remat);
- :mod:`.stage`: a stage (a sub-chain run as F, B, W); :mod:`.execute`: the executor of one
  rank's list; :mod:`.step`: one optimizer step; :mod:`.remat`: the ``--remat`` policy (a
  sequence per stage and input shape); :mod:`.record`: what a run records;
- :mod:`.pipelined`: a pipelined step on its own (experiments, tests);
  :mod:`.plain_pipeline`: GPipe and 1F1B as plain loops, to read beside the executor.
"""
