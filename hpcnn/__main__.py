"""``python -m hpcnn ...`` (under MPI: ``mpiexec -n N python -m mpi4py -m hpcnn ...``).

First of all, SIGINT is made to note that it came (:func:`hpcnn.note_start_up_interrupts`):
any error that ends start-up after a Ctrl-C is then taken for the interrupt (one line, exit
status 130, no traceback), also where an import in C turned the ``KeyboardInterrupt`` into an
``ImportError``."""
import sys
from hpcnn import exit_interrupted, note_start_up_interrupts, start_up_interrupted, to_stderr

try:
    note_start_up_interrupts()
    from hpcnn.cli import main
except BaseException as e:          # Ctrl-C while hpcnn loads: one line, no traceback
    if not (isinstance(e, KeyboardInterrupt) or start_up_interrupted()):
        raise
    to_stderr("hpcnn: interrupted during start-up")
    exit_interrupted(130)

sys.exit(main())
