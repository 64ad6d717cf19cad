"""Schedules as data, without MPI: the bottom layer every parallel and memory method builds on.

A training step on any rank is a list of :class:`~hpcnn.schedule.ops.Op` records. This package
builds, validates and prices such lists; it never runs them (the executor is :mod:`hpcnn.engine`)
and never imports MPI, the blocks or the run's configuration.

- :mod:`.ops`: the one record type, ``Op(kind, mb, stage, block, peer, item)``;
- :mod:`.price`: the one cost entry, ``price(lists, model)``: a discrete-event run of per-rank
  lists (compute, messages, an offload channel, overlapped allreduces, a memory account);
- :mod:`.pipeline`: the pipeline schedules (GPipe, 1F1B, interleaved, ZB-H1, ZB-V), ``validate``
  and ``simulate``;
- :mod:`.stages`: cutting a chain of blocks into pipeline stages (uniform, by cost, bounded);
- :mod:`.sequences`: rotor's op sequences (F_ck, F_n, F_all, B, OFF, PRE) and their checks;
- :mod:`.expand`: a rank's step printed as the single list it ran (``--show_schedule``);
- :mod:`.placement`: the pure layout algebra of operator cuts (``Cut``, ``Placement``, plan
  files, which elements move between two placements), which the planner prices and
  :mod:`hpcnn.parallel.layout` executes.
"""
