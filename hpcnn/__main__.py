"""``python -m hpcnn ...`` (under MPI: ``mpiexec -n N python -m mpi4py -m hpcnn ...``)."""
import sys
from hpcnn import exit_interrupted, to_stderr

try:
    from hpcnn.cli import main
except KeyboardInterrupt:           # Ctrl-C while Python loads: one line, no traceback
    to_stderr("hpcnn: interrupted during start-up")
    exit_interrupted(130)

sys.exit(main())
