"""``python -m hpcnn ...`` (under MPI: ``mpiexec -n N python -m mpi4py -m hpcnn ...``)."""
import sys

from hpcnn.cli import main

sys.exit(main())
