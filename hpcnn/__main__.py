"""``python -m hpcnn ...`` (under MPI: ``mpiexec -n N python -m mpi4py -m hpcnn ...``)."""
import sys

try:
    from hpcnn.cli import main
except KeyboardInterrupt:           # Ctrl-C while Python loads: one line, no traceback
    print("hpcnn: interrupted during start-up", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
