"""Lab 8: a hang, found with the watchdog's report and the schedule validator, and fixed.

Part A, a mismatched collective. hpcnn's watchdog (``hpcnn/parallel/collectives/watchdog.py``)
records, on every rank, the communication call it is in; when one lasts more than
``--hang_timeout`` each rank writes its record (a dict: ``rank``, ``in_call``, and for a rank
that made a call ``kind``, ``comm``, ``peer``, ``nbytes``, ``since``) and rank 0 prints the table.
:func:`diagnose` reads the records; :func:`global_grad_norm` is the fixed version of the buggy
function of the README.

Part B, a deadlocked pipeline schedule (lab 5's instruction lists): :func:`blocked` runs the
lists as hpcnn's validator does, with eager sends and blocking receives, and says where each
rank waits forever.

Copy this file to student.py in this folder, write the functions that raise
NotImplementedError, then grade it: ``make lab N=8`` (or ``python labs/08-hang/grade.py``).
"""
import math
from collections import Counter


def diagnose(records, size):
    """From the watchdog's records ({rank: record} for ranks 0 .. size-1; a rank may be
    missing), the ranks apart and the call the others wait in. The majority call is the
    (kind, comm) most ranks wait in (``in_call`` true); the ranks apart are every other rank:
    waiting in another call, in no call, or without a record. Returns (sorted list of the ranks
    apart, the majority call's kind)."""
    raise NotImplementedError


def global_grad_norm(comm, grads):
    """The 2-norm of all ranks' gradients together: sqrt of the sum over ranks of each rank's
    sum of squares. Every rank must make the same collective calls, whatever its gradients
    hold: one ``comm.allreduce`` of a Python float (even a rank whose gradients are all zero)."""
    raise NotImplementedError


def blocked(lists):
    """Run the per-rank instruction lists with eager sends (a SEND never waits) and blocking
    receives (a RECV waits until the matching SEND, same kind suffix ACT/GRAD, mb and stage, has
    run) until no rank can move. Ranks move in any order: the result does not depend on it.
    Returns {rank: (position, op)} for every rank that did not reach the end of its list (the
    RECV it waits in forever); {} when the schedule runs to the end."""
    raise NotImplementedError
