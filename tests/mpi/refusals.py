"""How ``hpcnn train`` stops every rank after a refusal (hpcnn.cli._stop_every_rank), and a
script whose every rank refused its input (hpcnn.cli.leave_refused).

    mpiexec -n N python -m mpi4py tests/mpi/refusals.py all|some|leave

``all``: every rank stops with a message (rank 1 with another one): rank 0 prints each distinct
message once, naming the ranks of the odd one, MPI is finalized and the exit code is 2.
``some``: only the last rank stops while the others wait in a collective: after the agreement
time (shortened here) that rank prints its message with its rank and aborts the job: no hang.
``leave``: every rank prints its own refusal, the last one a second after the others, and
leaves by cli.leave_refused: every message is out, the exit code is 2, no MPI_Abort.
"""
import sys
import time

from mpi4py import MPI

from hpcnn import cli

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
agree = world.Dup()
cli.AGREE_SECONDS = 2.0
if sys.argv[1] == "leave":
    if rank == size - 1:
        time.sleep(1.0)
    print(f"rank {rank}: refused", file=sys.stderr)
    sys.exit(cli.leave_refused(world))
if sys.argv[1] == "all":
    sys.exit(cli._stop_every_rank("odd one out" if rank == 1 else "refused", agree))
if rank == size - 1:
    sys.exit(cli._stop_every_rank("refused here only", agree))
world.Barrier()                  # never completes: the last rank does not come
