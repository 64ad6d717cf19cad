"""What ``hpcnn calibrate --write machines/NAME.toml`` measures on the ranks at hand.

The package times this machine and writes the machine file the planner reads
(:mod:`hpcnn.plan.machine`), one module per thing measured:

- :mod:`.links`: ping-pong and allreduce times, and the network level fitted from them;
- :mod:`.device`, with :mod:`.blocks`, :mod:`.passes` and :mod:`.update`: the device section,
  timed on rank 0 alone (matmul and copy rates, per block kind, through the step engine, the
  optimizer's update);
- :mod:`.shared`: what a rank gets while every rank computes (sustained rates alone and all at
  once);
- :mod:`.contention` and :mod:`.scale`, only where ranks share cores: collectives and blocking
  exchanges after compute, and the scales of training through the step engine (:mod:`.runs`)
  over the figures measured before it;
- :mod:`.machine_file`: :func:`measure` (the whole calibration) and the machine file of it;
- :mod:`.timing`: the timing primitives they share.

Every function that takes ``comm`` (an MPI communicator, as :func:`hpcnn.train.train` takes
it) is called on every rank; its MPI calls go through a
:class:`~hpcnn.parallel.collectives.Communicator`. What the figures were on the machines tried,
and the commands that gave them: docs/results/calibration.md.

    mpiexec -n 2 python -m mpi4py -m hpcnn calibrate --write machines/local.toml
"""
from hpcnn.plan.calibrate.contention import after_compute_points, handoff_points
from hpcnn.plan.calibrate.device import device_rates
from hpcnn.plan.calibrate.links import allreduce_times, fit_level, fit_reduce, pingpong
from hpcnn.plan.calibrate.machine_file import handoff_fields, machine_of, machine_text, measure
from hpcnn.plan.calibrate.scale import layout_scale
from hpcnn.plan.calibrate.shared import cores_here, shared_figures, sustained_medians
from hpcnn.plan.calibrate.timing import FULL_ROUNDS
from hpcnn.plan.calibrate.update import update_costs

__all__ = ["FULL_ROUNDS", "after_compute_points", "allreduce_times", "cores_here",
           "device_rates", "fit_level", "fit_reduce", "handoff_fields", "handoff_points",
           "layout_scale", "machine_of", "machine_text", "measure", "pingpong",
           "shared_figures", "sustained_medians", "update_costs"]
