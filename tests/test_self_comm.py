"""The one-rank communicator without MPI (``Communicator.single``): every public method of
Communicator gives the answer of a Communicator over ``MPI.COMM_SELF``, and using it never
imports mpi4py."""
import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcnn.parallel.collectives import CommStats, Communicator, Request, SelfCommunicator
from mpi_util import ROOT


def calls():
    """One call of every public method: name -> fn(comm) returning what to compare. Arrays are
    made inside, so each communicator gets its own."""
    def pair(c, buf, tag):
        rs = c.irecv(out := np.zeros(3), 0, tag)
        c.isend(buf, 0, tag).wait()
        rs.wait()
        return out

    def object_pair(c, obj, tag):
        req = c.send_object(obj, 0, tag)
        got = c.recv_object(0, tag)
        req.wait()
        return got

    def early_recv(c):                  # irecv posted before its isend
        out = np.zeros(2)
        r = c.irecv(out, 0, 7)
        c.isend(np.array([5.0, 6.0]), 0, 7)
        r.wait()
        return out

    def split_free(c):
        sub = c.split(3, 0, "sub")
        got = (sub.rank, sub.size, sub.name, sub.stats is c.stats)
        sub.free()
        return got

    def free(c):                        # a communicator made by split
        c.split(0, 0).free()
        return True

    def round_trip(c):
        buf = np.arange(3.0)
        c.bare_round_trip(buf, 0, True, tag=2)
        return buf

    def alltoall(c):
        out = np.zeros(5)
        c.bare_alltoall(np.arange(4.0), out, [3])
        return out

    return {
        "split": split_free,
        "free": free,
        "ranks_on_node": lambda c: c.ranks_on_node(),
        "ibarrier": lambda c: _waited(c.ibarrier()),
        "bare_round_trip": round_trip,
        "bare_allreduce": lambda c: c.bare_allreduce(np.arange(3.0)),
        "bare_alltoall": alltoall,
        "allreduce": lambda c: [c.allreduce(np.arange(5.0), a) for a in ("mpi", "auto")],
        "iallreduce": lambda c: [_waited(c.iallreduce(np.arange(4.0), algorithm=a))
                                 for a in ("mpi", "ring", "shm", "auto")],
        "shared_zeros": lambda c: c.shared_zeros((2, 3), np.float64),
        "allreduce_scalars": lambda c: [c.allreduce_scalars([1.5, 2.0], op)
                                        for op in ("sum", "max", "min")],
        "allreduce_max": lambda c: c.allreduce_max(np.array([3.0, -1.0])),
        "reduce_scatter": lambda c: c.reduce_scatter(np.arange(4.0), np.zeros(4)),
        "allgather": lambda c: c.allgather(np.arange(3.0), np.zeros((1, 3))),
        "allgather_parts": lambda c: c.allgather_parts(np.arange(3.0), [3]),
        "ireduce_scatter_parts": lambda c: _waited(c.ireduce_scatter_parts(
            np.arange(3.0), np.zeros(3), [3])),
        "iallgather_parts": lambda c: gathered_parts(c),
        "alltoallv": lambda c: c.alltoallv(np.arange(4.0), [3], np.zeros(5), [3]),
        "allgather_scalars": lambda c: c.allgather_scalars([1.0, 2.0]),
        "bcast": lambda c: c.bcast(np.arange(3.0)),
        "barrier": lambda c: c.barrier(),
        "sendrecv": lambda c: [c.sendrecv(np.arange(3.0), 0, np.zeros(3), 0, tag=4)],
        "isend": lambda c: pair(c, np.arange(3.0) + 1, 11),
        "irecv": early_recv,
        "allgather_objects": lambda c: c.allgather_objects({"rank": c.rank, "ok": True}),
        "gather_objects": lambda c: c.gather_objects(("x", 1)),
        "bcast_object": lambda c: c.bcast_object([1, "a"]),
        "send_object": lambda c: object_pair(c, {"a": [1, 2]}, 3),
        "recv_object": lambda c: object_pair(c, ("b", 2.5), 5),
        "reduce_array": lambda c: [c.reduce_array(np.array([[1, -2], [3, 4]]), op)
                                   for op in ("sum", "max", "min")],
        "ireduce_max": lambda c: reduced_max(c),
        "alltoall_objects": lambda c: c.alltoall_objects([("to", 0)]),
        "dup": lambda c: made(c.dup("copy")),
    }


def gathered_parts(c):
    buf = np.arange(3.0)
    _waited(c.iallgather_parts(buf, [3]))
    return buf


def reduced_max(c):
    out = np.zeros(2, np.int32)
    _waited(c.ireduce_max(np.array([3, 9], np.int32), out))
    return out


def made(sub):
    """A communicator made by split or dup: its size and rank, then freed."""
    got = (sub.size, sub.rank, sub.allreduce_scalars([2.0]))
    sub.free()
    return got


def _waited(req):
    assert isinstance(req, Request)
    req.wait()
    assert req.done
    return True


def public_methods():
    return sorted(n for n, f in inspect.getmembers(Communicator, inspect.isfunction)
                  if not n.startswith("_"))


def same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_every_method_is_checked():
    """A method added to Communicator must get a one-rank case here."""
    assert public_methods() == sorted(calls())


def test_one_rank_answers_match_comm_self():
    from mpi4py import MPI
    single = Communicator.single()
    ref = Communicator(MPI.COMM_SELF, CommStats(), "ref")
    assert isinstance(single, SelfCommunicator) and isinstance(single, Communicator)
    assert (single.rank, single.size, single.name) == (0, 1, "self")
    for name, call in calls().items():
        got, want = call(single), call(ref)
        assert same(got, want), (name, got, want)
    # the same ops counted the same number of times; nothing leaves the one rank
    assert dict(single.stats.calls) == {k: v for k, v in ref.stats.calls.items()}
    assert single.stats.bytes_sent == 0


def test_one_rank_bad_peers_and_roots():
    c = Communicator.single("solo", CommStats())
    assert c.name == "solo" and repr(c) == "SelfCommunicator(solo)"
    with pytest.raises(ValueError, match="rank 1 on a one-rank communicator"):
        c.isend(np.zeros(2), 1)
    with pytest.raises(ValueError, match="dest 0 and source -1 must both be 0"):
        c.sendrecv(np.zeros(2), 0, np.zeros(2), -1)
    with pytest.raises(ValueError, match="root 1 is not a rank of solo"):
        c.bcast_object(1, root=1)
    r = c.irecv(np.zeros(2), 0, tag=9)
    assert not r.test()
    with pytest.raises(RuntimeError, match="no isend to rank 0 with this tag"):
        r.wait()
    with pytest.raises(ValueError, match="no object sent with tag 4 from rank 0"):
        c.recv_object(0, tag=4)             # nothing could ever send it: an error, not a hang
    out = np.zeros(2)                   # no peer: nothing moves
    assert c.sendrecv(np.ones(2), -1, out, -1) is out and not out.any()


def test_using_it_does_not_import_mpi4py():
    code = ("import sys; import numpy as np\n"
            "from hpcnn.parallel.collectives import Communicator\n"
            "import test_self_comm as t\n"
            "c = Communicator.single()\n"
            "[f(c) for f in t.calls().values()]\n"
            "assert c.stats.bytes_sent == 0 and sum(c.stats.calls.values()) > 0\n"
            "bad = sorted(m for m in sys.modules if m.startswith('mpi4py'))\n"
            "assert not bad, bad\n"
            "print('no mpi4py')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0 and "no mpi4py" in p.stdout, p.stdout + p.stderr
