"""The schedule record: one :class:`Op` type for every item of every schedule in hpcnn.

A schedule is a list of ops (one list per rank for a pipeline). The same record carries

- pipeline instructions (:mod:`hpcnn.schedule.pipeline`): ``F``, ``B``, ``W`` on micro-batch
  ``mb`` of stage ``stage``, and the messages ``SEND_ACT``, ``RECV_ACT``, ``SEND_GRAD``,
  ``RECV_GRAD`` with the ``peer`` rank; ``block = -1`` means the whole stage;
- rotor's rematerialization ops (:mod:`hpcnn.schedule.sequences`): ``F_ck``, ``F_n``, ``F_all``,
  ``B`` on chain element ``block`` (rotor calls it a "stage"), and the offload channel's ``OFF``,
  ``PRE`` of a stored value, ``item`` ``"x"`` (a checkpoint x[block]) or ``"bar"`` (an x̄[block]);
- data parallelism: ``AR`` launches the allreduce of gradient bucket ``block``, ``AR_WAIT``
  waits for every launched bucket.

An expanded schedule (rotor ops run inside a pipeline step) sets ``mb`` and ``stage`` on the
rotor ops too. :mod:`.price` prices any list of these records. This module owns only the record,
its kinds and its printing.

    >>> str(Op("F", mb=0, stage=1)), str(Op("F_ck", block=3)), str(Op("OFF", block=2, item="bar"))
    ('F(mb=0, stage=1)', 'F_ck3', 'OFF(x̄2)')
    >>> fmt([Op("F_all", block=0), Op("B", block=0), Op("AR", block=0), Op("AR_WAIT")])
    'F_all0 B0 AR0 AR_WAIT'
"""
from __future__ import annotations

from typing import NamedTuple

PIPELINE = ("F", "B", "W")                              # whole-stage compute of a pipeline
REMAT = ("F_ck", "F_n", "F_all", "B")                   # rotor's compute ops on one block
COMPUTE = ("F", "B", "W", "F_ck", "F_n", "F_all")       # every op that runs on the compute stream
COMM = ("SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")   # pipeline messages
CHANNEL = ("OFF", "PRE")                                # the offload channel
COLLECTIVE = ("AR", "AR_WAIT")                          # data-parallel gradient allreduce
KINDS = COMPUTE + COMM + CHANNEL + COLLECTIVE


class Op(NamedTuple):
    """One item of a schedule: ``kind`` on micro-batch ``mb`` of stage ``stage``.

    ``block``: the chain element (rotor ops), the gradient bucket (AR), -1 for the whole stage;
    ``peer``: the rank on the other side of a SEND/RECV; ``item``: "x" or "bar" for OFF/PRE.
    Build by keyword beyond the kind: ``Op("F_ck", block=i)``, ``Op("SEND_ACT", mb=0, stage=1,
    peer=2)``.
    """

    kind: str
    mb: int = 0
    stage: int = 0
    block: int = -1
    peer: int | None = None
    item: str = ""

    def _short(self) -> bool:
        """Printed in rotor's short form (``F_ck3``) rather than the pipeline's long one."""
        return self.kind in CHANNEL or self.kind in COLLECTIVE or \
            (self.kind in REMAT and (self.kind != "B" or self.block >= 0))

    def __str__(self) -> str:
        if not self._short():
            block = "" if self.block < 0 else f", block={self.block}"
            peer = "" if self.peer is None else f", peer={self.peer}"
            return f"{self.kind}(mb={self.mb}, stage={self.stage}{block}{peer})"
        if self.kind in CHANNEL:
            base = f"{self.kind}({'x̄' if self.item == 'bar' else 'x'}{self.block})"
        else:
            base = self.kind + ("" if self.block < 0 else str(self.block))
        return base + (f"[mb={self.mb}, stage={self.stage}]" if self.mb or self.stage else "")


def fmt(seq) -> str:
    """A schedule (one rank's list) as one line: ``F_ck0 F_n1 F_all2 B2 ...``."""
    return " ".join(str(op) for op in seq)
