"""HDF5 run log: :class:`RunLog` writes one file per run (rank 0), :func:`read_run` reads it back.

Figures and text summaries from a log are in :mod:`hpcnn.log.report` (imported on demand, so that
importing :mod:`hpcnn.log` never loads matplotlib).
"""
from .runlog import RunData, RunLog, read_run

__all__ = ["RunLog", "RunData", "read_run"]
