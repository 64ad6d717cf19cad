"""The allreduce calibration of a run: only the sizes it needs, saved and reused.

``--allreduce=auto`` picks an algorithm per message size from ``comm.allreduce_table``
(:mod:`.algorithms`). A run needs that table only at the sizes its blocking ``auto``
reductions send (:meth:`hpcnn.parallel.data.bucketed.DataParallel.auto_sizes`: the gradient buckets
without ``--overlap``; the overlapped buckets go by fixed thresholds and need none), so
:func:`for_run` times just those, briefly (:data:`RUN_BUDGET_S` a size), and only when no saved
calibration covers them.

Saved calibrations are JSON files, one per *key*: everything the timings depend on (the hosts
and which rank runs on which, the CPUs each rank may use, the MPI library, the number of ranks,
the dtype, the algorithms available there, e.g. whether ``cma`` passed its probe, the segment
and piece sizes, the backend, the hpcnn version). The file is
``$XDG_CACHE_HOME/hpcnn/calibration-<hash of the key>.json`` (``~/.cache`` without
XDG_CACHE_HOME), or the file named by ``HPCNN_CALIBRATION`` (``HPCNN_CALIBRATION=off``: neither
read nor written). Rank 0 reads it and broadcasts what it found, so every rank decides alike; a
missing, unreadable or corrupt file, or one for another key, is ignored with a one-line note.
A file keeps, per size and algorithm, the median of the timed rounds and their quartiles
(``times``, ``low``, ``high``): ``auto`` leaves the library's call only where a path wins
clearly, spread included (:func:`.algorithms.table_from_times`); a file of the first format
(medians only) is measured again, with a note. A run merges the sizes it measured into the file; ``hpcnn calibrate`` replaces it with a sweep from
1 KiB to 64 MiB, which covers every size in between (a saved size covers the sizes within a
factor of 2 of it: ``auto`` takes the nearest size in log2 anyway). Delete the file to measure
again.

    mpiexec -n 2 python -m mpi4py -m hpcnn calibrate       # prints the table and the file
    mpiexec -n 2 python -m mpi4py -c "from mpi4py import MPI; \\
        from hpcnn.parallel.collectives import Communicator, calibration; \\
        c = Communicator(MPI.COMM_WORLD); print(calibration.for_run(c, [340000]))"
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time

import numpy

from hpcnn import backend

FORMAT = "hpcnn-allreduce-calibration/2"
OLD_FORMATS = ("hpcnn-allreduce-calibration/1",)    # medians only: measured again, with a note
SPREAD = ("times", "low", "high")   # medians and quartiles, {algorithm: [seconds a size]}
RUN_BUDGET_S = 0.05         # a run's calibration: seconds of timed rounds a size (and one warm-up)
ENV = "HPCNN_CALIBRATION"
OFF = ("off", "0", "none", "false", "no")


def key(comm, dtype=numpy.float32) -> dict:
    """What the timings on ``comm`` (a Communicator) depend on; the same dict on every rank
    (collective: one allgather, and the probes of :func:`algorithms.available_algorithms`)."""
    import mpi4py

    import hpcnn
    from hpcnn.parallel.collectives import algorithms
    from hpcnn.parallel.collectives import shm
    from hpcnn.parallel.collectives.comm import library_version
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:                  # pragma: no cover - no affinity call (macOS)
        cpus = os.cpu_count() or 1
    ranks = comm.comm.allgather((socket.gethostname(), cpus))
    hosts = list(dict.fromkeys(h for h, _ in ranks))
    return {"hosts": hosts, "node_of_rank": [hosts.index(h) for h, _ in ranks],
            "cpus_of_rank": [c for _, c in ranks], "ranks": comm.size,
            "mpi": library_version(),
            "mpi4py": mpi4py.__version__, "dtype": numpy.dtype(dtype).name,
            "algorithms": algorithms.available_algorithms(comm), "backend": backend.device,
            "segment_bytes": int(getattr(comm, "allreduce_segment_bytes",
                                         algorithms.SEGMENT_BYTES)),
            "piece_bytes": int(getattr(comm, "shm_piece_bytes", shm.PIECE_BYTES)),
            "hpcnn": hpcnn.__version__}


def path_for(k: dict) -> str | None:
    """The file of key ``k`` (see the module docstring); None when ``HPCNN_CALIBRATION=off``."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() in OFF:
        return None
    if env:
        return os.path.abspath(os.path.expanduser(env))
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hpcnn", f"calibration-{digest}.json")


def _timings(doc, algorithms) -> dict | None:
    """``{"sizes", "times", "low", "high"}`` of a parsed file if well formed for
    ``algorithms``, else None."""
    sizes = doc.get("sizes")
    if not isinstance(sizes, list) or not all(type(n) is int and n > 0 for n in sizes) \
            or len(set(sizes)) != len(sizes):
        return None
    for k in SPREAD:
        times = doc.get(k)
        if not (isinstance(times, dict) and list(times) == algorithms):
            return None
        for col in times.values():
            if not (isinstance(col, list) and len(col) == len(sizes) and all(
                    type(x) in (int, float) and math.isfinite(x) and x > 0 for x in col)):
                return None
    return {"sizes": sizes, **{k: doc[k] for k in SPREAD}}


def load(path: str, k: dict) -> tuple:
    """``(timings or None, note)``: the saved ``{"sizes", "times", "low", "high"}`` for key
    ``k`` in ``path``, or None with a one-line note saying why it was ignored ("" when there is
    no file; a file of an older format, medians without their spread, is measured again)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, RecursionError) as e:
        return None, f"ignored {path}: unreadable ({type(e).__name__}: {' '.join(str(e).split())})"
    if isinstance(doc, dict) and doc.get("format") in OLD_FORMATS:
        return None, (f"ignored {path}: an older calibration ({doc['format']}: medians without "
                      "their spread), measured again")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None, f"ignored {path}: not an hpcnn calibration file"
    saved = doc.get("key")
    if saved != k:
        differ = sorted(f for f in set(k) | set(saved if isinstance(saved, dict) else {})
                        if not isinstance(saved, dict) or saved.get(f) != k.get(f))
        return None, f"ignored {path}: made for another {', '.join(differ)}"
    got = _timings(doc, k["algorithms"])
    if got is None:
        return None, f"ignored {path}: malformed sizes or times"
    return got, ""


def merge(old: dict | None, new: dict) -> dict:
    """``old`` timings with ``new``'s added (``new`` wins at a size both have), sorted by size."""
    rows = {}
    for t in (old, new):
        if t:
            for i, n in enumerate(t["sizes"]):
                rows[int(n)] = {k: {a: float(col[i]) for a, col in t[k].items()} for k in SPREAD}
    sizes = sorted(rows)
    algorithms = list(new["times"])
    return {"sizes": sizes, **{k: {a: [rows[n][k][a] for n in sizes] for a in algorithms}
                               for k in SPREAD}}


def save(path: str, k: dict, timings: dict, replace: bool = False) -> str:
    """Write ``timings`` for key ``k`` to ``path`` (merged into what the file holds for ``k``
    now, unless ``replace``), atomically; returns "" or a one-line note why it could not."""
    try:
        if not replace:
            timings = merge(load(path, k)[0], timings)
        doc = {"format": FORMAT, "key": k, "sizes": timings["sizes"],
               **{s: timings[s] for s in SPREAD}, "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        return f"could not save {path}: {' '.join(str(e).split())}"
    return ""


def covered(nbytes: int, sizes) -> bool:
    """True if a size in ``sizes`` lies within a factor of 2 of ``nbytes``."""
    return any(max(nbytes, s) <= 2 * min(nbytes, s) for s in sizes)


def for_run(comm, sizes, dtype=numpy.float32) -> dict:
    """Set ``comm.allreduce_table`` for a run whose blocking ``auto`` reductions send ``sizes``
    (bytes, the same on every rank): from the saved file where it covers them, else measured
    (those sizes only) and merged into it. Collective unless ``sizes`` is empty or one rank.

    Returns ``{"source": none | file | measured | file+measured, "path", "sizes", "measured"
    (the sizes timed), "seconds", "choice" (size -> algorithm), "notes"}`` (notes: rank 0's)."""
    from hpcnn.parallel.collectives import algorithms
    sizes = sorted({int(n) for n in sizes})
    info = {"source": "none", "path": None, "sizes": sizes, "measured": [], "seconds": 0.0,
            "choice": {}, "notes": []}
    if comm.size == 1 or not sizes:
        return info
    t0 = time.perf_counter()
    k = key(comm, dtype)
    found = None
    if comm.rank == 0:
        path = path_for(k)
        found = (path, *(load(path, k) if path else (None, "")))
    path, timings, note = comm.comm.bcast(found, root=0)
    missing = [n for n in sizes if not (timings and covered(n, timings["sizes"]))]
    if missing:
        measured = algorithms.calibrate(comm, missing, dtype=dtype, budget=RUN_BUDGET_S)
        new = {"sizes": measured["sizes"], **{s: measured[s] for s in SPREAD}}
        timings = merge(timings, new)
        if path and comm.rank == 0:
            note = "; ".join(x for x in (note, save(path, k, new)) if x)
    comm.allreduce_table = algorithms.table_from_times(comm, timings["sizes"], timings["times"],
                                                       timings["low"], timings["high"])
    info.update(source="measured" if len(missing) == len(sizes) else
                "file+measured" if missing else "file", path=path, measured=missing,
                seconds=time.perf_counter() - t0, notes=[note] if note else [],
                choice={n: algorithms.choose(comm, n) for n in sizes})
    return info


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB" if n >= 1024 \
        else f"{n} B"


def describe(info: dict) -> list:
    """Lines for the run's header: where ``auto``'s table came from and what it picks."""
    if info["source"] == "none":
        return []
    picks = ", ".join(f"{_size(n)} {a}" for n, a in info["choice"].items())
    where = info["path"] or f"no file ({ENV}=off)"
    if info["source"] == "file":
        how = f"loaded from {where}"
    else:
        n = len(info["measured"])
        how = (f"measured {n} size{'s' * (n > 1)} in {info['seconds']:.2f} s"
               + (", the rest loaded" if info["source"] == "file+measured" else "")
               + (f", saved to {where}" if info["path"] else f", {where}"))
    return [f"allreduce auto: {how} ({picks})"] + [f"allreduce auto: {x}" for x in info["notes"]]
