"""Lab 8, reference solution: a hang, found with the watchdog's report and the schedule
validator, and fixed.

Part A, a mismatched collective. hpcnn's watchdog (``hpcnn/parallel/collectives/watchdog.py``)
records, on every rank, the communication call it is in; when one lasts more than
``--hang_timeout`` each rank writes its record (a dict: ``rank``, ``in_call``, and for a rank
that made a call ``kind``, ``comm``, ``peer``, ``nbytes``, ``since``) and rank 0 prints the table.
:func:`diagnose` reads the records; :func:`global_grad_norm` is the fixed version of the buggy
function of the README.

Part B, a deadlocked pipeline schedule (lab 5's instruction lists): :func:`blocked` runs the
lists as hpcnn's validator does, with eager sends and blocking receives, and says where each
rank waits forever.

Graded by ``python labs/08-hang/grade.py labs/08-hang/solution.py``.
"""
import math
from collections import Counter


def diagnose(records, size):
    """From the watchdog's records ({rank: record} for ranks 0 .. size-1; a rank may be
    missing), the ranks apart and the call the others wait in. The majority call is the
    (kind, comm) most ranks wait in (``in_call`` true); the ranks apart are every other rank:
    waiting in another call, in no call, or without a record. Returns (sorted list of the ranks
    apart, the majority call's kind)."""
    waiting = {r: (rec["kind"], rec["comm"]) for r, rec in records.items() if rec["in_call"]}
    (call, _), = Counter(waiting.values()).most_common(1)
    return sorted(r for r in range(size) if waiting.get(r) != call), call[0]


def global_grad_norm(comm, grads):
    """The 2-norm of all ranks' gradients together: sqrt of the sum over ranks of each rank's
    sum of squares. Every rank must make the same collective calls, whatever its gradients
    hold: one ``comm.allreduce`` of a Python float (even a rank whose gradients are all zero)."""
    local = sum(float((g * g).sum()) for g in grads)
    return math.sqrt(comm.allreduce(local))


def _key(op):
    return op.kind[5:], op.mb, op.stage          # a SEND and its RECV share it


def blocked(lists):
    """Run the per-rank instruction lists with eager sends (a SEND never waits) and blocking
    receives (a RECV waits until the matching SEND, same kind suffix ACT/GRAD, mb and stage, has
    run) until no rank can move. Ranks move in any order: the result does not depend on it.
    Returns {rank: (position, op)} for every rank that did not reach the end of its list (the
    RECV it waits in forever); {} when the schedule runs to the end."""
    pc, sent = [0] * len(lists), Counter()
    moved = True
    while moved:
        moved = False
        for r, lst in enumerate(lists):
            while pc[r] < len(lst):
                op = lst[pc[r]]
                if op.kind.startswith("RECV"):
                    if not sent[_key(op)]:
                        break
                    sent[_key(op)] -= 1
                elif op.kind.startswith("SEND"):
                    sent[_key(op)] += 1
                pc[r] += 1
                moved = True
    return {r: (pc[r], lst[pc[r]]) for r, lst in enumerate(lists) if pc[r] < len(lst)}
