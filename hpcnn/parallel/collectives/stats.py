"""Per-operation communication counters: calls, bytes sent by this rank, seconds inside calls.

One :class:`CommStats` is shared by the communicators of a process and read into the run log's
``/ranks`` table. Communicators keep the :meth:`CommStats.counter` objects of their hot paths and
bump them in place; when the optional C module is built (:mod:`.lean_build`) the
counters are its ``Counter`` type, with the same fields, so that its allreduce bumps them
without Python.
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from math import gcd

_LEAN = None                # the optional C module: None = not looked for yet, False = absent

# Below SAMPLED_BELOW bytes, the lean allreduce path times one call in SAMPLE_EVERY and counts
# that call's seconds SAMPLE_EVERY times: the two clock reads would otherwise be ~3-5 % of a
# ~6 us small-message allreduce. Calls and bytes are always exact; small-message seconds are a
# sampled estimate.
SAMPLED_BELOW = 64 * 1024
SAMPLE_EVERY = 8                            # a power of two


def _c_lean():
    """The optional C module (:mod:`.lean_build`), once mpi4py.MPI is imported, or
    None (not built, or ``HPCNN_LEAN=0``)."""
    global _LEAN
    if _LEAN is None:
        _LEAN = False
        if "mpi4py.MPI" in sys.modules and os.environ.get("HPCNN_LEAN", "1") not in ("0", "false"):
            try:
                _LEAN = importlib.import_module("hpcnn.parallel.collectives._lean")
            except ImportError:
                pass
    return _LEAN or None


class _Counter:
    """Calls, seconds and ``raw`` bytes of one op, of which ``num/den`` count (2(p-1)/p for an
    allreduce on p ranks, floored on the total): communicators bump these attributes. The C
    module's ``Counter`` has the same fields (its allreduce bumps them without Python)."""

    __slots__ = ("calls", "raw", "seconds", "num", "den")

    def __init__(self, num, den):
        self.calls, self.raw, self.seconds, self.num, self.den = 0, 0, 0.0, num, den


class _Column(Mapping):
    """Read-only ``op -> total`` of one field of a :class:`CommStats` (0 for an op not seen)."""

    def __init__(self, stats, field):
        self._stats, self._field = stats, field

    def __getitem__(self, op):
        f, zero = self._field, 0.0 if self._field == "seconds" else 0
        return sum((c.raw * c.num // c.den if f == "bytes" else getattr(c, f))
                   for (o, _, _), c in self._stats._counters.items() if o == op) or zero

    def __iter__(self):
        return iter(dict.fromkeys(o for (o, _, _), c in self._stats._counters.items() if c.calls))

    def __len__(self):
        return len(list(iter(self)))


class CommStats:
    """Per-operation counters: calls, bytes sent by this rank, seconds spent inside the call.

    Seconds of library allreduces under ``SAMPLED_BELOW`` bytes are sampled (one call in
    ``SAMPLE_EVERY`` is timed and weighted by it); calls and bytes are exact.

    ``calls``, ``bytes`` and ``seconds`` are read-only mappings ``op -> total``; :meth:`add`
    counts one call; a Communicator keeps the :meth:`counter` objects of its hot paths.
    """

    def __init__(self):
        self._counters = {}                 # (op, num, den) -> _Counter
        self.calls, self.bytes = _Column(self, "calls"), _Column(self, "bytes")
        self.seconds = _Column(self, "seconds")

    def counter(self, op: str, num: int = 1, den: int = 1) -> _Counter:
        """The counter of ``op`` that counts ``num/den`` of the raw bytes added to it."""
        g = gcd(num, den) or 1
        key = (op, num // g, den // g)
        c = self._counters.get(key)
        if c is None:
            lean = _c_lean()
            c = self._counters[key] = (lean.Counter if lean else _Counter)(num // g, den // g)
        return c

    def reset(self) -> None:
        """Zero every counter (communicators keep theirs)."""
        for c in self._counters.values():
            c.calls, c.raw, c.seconds = 0, 0, 0.0

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        c = self._counters.get((op, 1, 1)) or self.counter(op)
        c.calls += 1
        c.raw += int(nbytes)
        c.seconds += seconds

    @property
    def bytes_sent(self) -> int:
        return sum(c.raw * c.num // c.den for c in self._counters.values())

    @property
    def comm_seconds(self) -> float:
        return sum(c.seconds for c in self._counters.values())

    def snapshot(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "comm_s": self.comm_seconds,
                "calls": dict(self.calls)}
