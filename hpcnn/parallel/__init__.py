"""Parallel execution on MPI: the process grid, collectives, data/tensor/pipeline parallelism."""
