"""Parallel execution on MPI: :mod:`.collectives` (every MPI call, the process grid),
:mod:`.data` (data parallelism), :mod:`.tensor` (tensor parallelism), :mod:`.layout` (per-Linear
layouts); pipelines are schedules (:mod:`hpcnn.schedule.pipeline`) run by :mod:`hpcnn.engine`."""
