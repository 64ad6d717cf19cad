"""HDF5 run log: one file per run, written by rank 0, readable after a crash.

Schema (``schema_version`` 1)::

    /           attrs: hpcnn_version, command_line, start_time, end_time, mpi_library, backend,
                       world_size, schema_version, status ("running" | "finished" | "failed" |
                       "interrupted" | "stopped"), log_error (only if the file could not be
                       written: why rows are missing), extras
    /config     attrs: json (the whole config, sort_keys) + every top-level str/int/float/bool key
    /plan       attrs: one per key; non-scalars as JSON strings, their names listed in attr json_keys
    /metrics    step (int64) and one float64 dataset per metric, all of length n_steps; NaN = not logged
    /ranks      compound dataset (a table), one row per (step, rank): step int64, rank int32,
                compute_s comm_s idle_s float64, bytes_sent peak_mem_bytes int64 (-1 = not given)
    /timeline   compound dataset, one row per event: rank int32, kind int16, microbatch int32,
                t_start t_end float64; attr kind_names = JSON list, kind code i means kind_names[i]

Every dataset is 1-D, chunked and extendable; :func:`read_run` returns the tables as dicts of
column arrays. Only rank 0 makes a :class:`RunLog`; this module never imports MPI::

    if grid.world.rank == 0:
        log = RunLog("runs/mlp.h5", cfg, command_line=" ".join(sys.argv), world_size=size)
    log.log_metrics(step, loss=loss, lr=lr, step_time=dt)        # test_acc only on eval steps

Beside the log, outside the schema: ``<log>.lock`` while a run writes it (:mod:`hpcnn.log.lock`)
and ``<log>-journal`` (:mod:`hpcnn.log.journal`). Crash safety: rows are buffered; each flush (and
:meth:`RunLog.set_plan`, :meth:`RunLog.close`) is one all-or-nothing update through the journal,
so whatever stops it (ENOSPC, SIGKILL, a failing disk) the file reads as after the last completed
update (:func:`read_run` overlays a hot journal in memory; the writer rolls it back on disk). On
an ``OSError`` at a flush the run goes on with one warning and later rows dropped, and
:meth:`RunLog.close` tries to set ``status="failed"`` and ``log_error``. Power loss is covered
only with ``durable=True`` (``hpcnn train --log_durable=true``; off by default for its cost).
Flush costs and the fault tests: docs/results/runlog.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from datetime import datetime, timezone

import h5py
import numpy as np

import hpcnn
from hpcnn import to_stderr
from hpcnn.log import journal, lock

SCHEMA_VERSION = 1
STATUSES = ("finished", "failed", "interrupted", "stopped")   # SIGINT/SIGTERM; --stop_signal
RANK_DTYPE = np.dtype([("step", "i8"), ("rank", "i4"), ("compute_s", "f8"), ("comm_s", "f8"),
                       ("idle_s", "f8"), ("bytes_sent", "i8"), ("peak_mem_bytes", "i8")])
EVENT_DTYPE = np.dtype([("rank", "i4"), ("kind", "i2"), ("microbatch", "i4"), ("t_start", "f8"),
                        ("t_end", "f8")])
_CHUNK = {"metrics": 1024, "ranks": 2048, "timeline": 4096}   # 8, 90 and 106 KB
_MAX_BUFFERED = 200_000          # rank rows + events held before a forced flush (bounded memory)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _plain(v):
    """NumPy scalars and arrays, bytes -> Python objects (other objects unchanged)."""
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, (np.generic, np.ndarray)):
        return v.tolist()
    return v


def _dumps(obj) -> str:
    """JSON with sorted keys; NumPy values as numbers/lists, anything else unknown (a Path) as str."""
    return json.dumps(obj, sort_keys=True, default=lambda v: str(v) if _plain(v) is v else _plain(v))


def _is_scalar(v) -> bool:
    return isinstance(v, (str, int, float, bool, np.integer, np.floating, np.bool_))


def _open(path: str, mode: str) -> h5py.File:
    """Open without HDF5 file locking (NFS/Lustre safe); h5py < 3.5 has no ``locking``."""
    try:
        return h5py.File(path, mode, locking=False)
    except TypeError:
        return h5py.File(path, mode)


@contextlib.contextmanager
def _update(path: str, durable: bool):
    """``path`` open for update, all or nothing: its writes reach the disk through the journal
    (:mod:`hpcnn.log.journal`) when the block ends without error, else none of them."""
    jf = journal.JournaledFile(path, durable=durable)
    try:
        with h5py.File(jf, "r+") as f:
            yield f
    except BaseException:
        jf.discard()
        raise
    jf.commit()


def _create_file(path: str, durable: bool, fill) -> None:
    """Write a new file with ``fill(h5py.File)`` under a temporary name, then rename it to ``path``
    (a crash leaves no file or a whole one; an old journal of ``path`` goes first)."""
    tmp = f"{path}.new-{os.getpid()}"
    try:
        with _open(tmp, "w") as f:
            fill(f)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(journal.journal_path(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _append(ds: h5py.Dataset, data: np.ndarray) -> None:
    n = ds.shape[0]
    ds.resize((n + len(data),))
    ds[n:] = data


def _create(parent: h5py.Group, name: str, dtype, chunk: int) -> h5py.Dataset:
    return parent.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(chunk,))


class RunLog:
    """Writer of one run's HDF5 log (rank 0 only).

    Parameters
    ----------
    path : str or os.PathLike
        File to create; an existing file is refused unless ``overwrite=True``.
    config : dict or dataclass
        The resolved configuration, stored as JSON in ``/config``.
    command_line, world_size, mpi_library, backend : root attributes of the run.
    extra_attrs : dict, optional
        More root attributes (non-scalars are stored as JSON).
    flush_every : int
        Write buffered rows to disk every ``flush_every`` calls of :meth:`log_metrics`.
    overwrite : bool
        Replace an existing file.
    durable : bool
        fsync the journal and the file at every update (two per flush), so that a power loss
        too leaves the last committed file; off by default, since it costs several times a
        flush (docs/results/runlog.md). A SIGKILL or a full disk are covered either way.

    The run's lock ``<path>.lock`` (:mod:`hpcnn.log.lock`) is taken here and released by
    :meth:`close`: another live run writing ``path`` raises :class:`~hpcnn.log.lock.LogLockedError`.
    """

    def __init__(self, path, config, *, command_line: str, world_size: int = 1,
                 mpi_library: str = "", backend: str = "cpu", extra_attrs: dict | None = None,
                 flush_every: int = 10, overwrite: bool = False, durable: bool = False):
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not overwrite:
            raise FileExistsError(f"run log {self.path} already exists; pass overwrite=True to replace it")
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            config = dataclasses.asdict(config)
        config = dict(config or {})
        root = {"hpcnn_version": hpcnn.__version__, "command_line": command_line,
                "start_time": _now(), "mpi_library": mpi_library, "backend": backend,
                "world_size": int(world_size), "schema_version": SCHEMA_VERSION, "status": "running"}
        clash = set(root) & set(extra_attrs or {})
        if clash:
            raise ValueError(f"extra_attrs {sorted(clash)} would overwrite the run's own attributes")
        self.flush_every = int(flush_every)
        self.durable = bool(durable)
        self.closed = False
        self.error: str | None = None       # why the file could not be written (then rows are dropped)
        self.n_flushes = 0
        self.last_flush_s = 0.0
        self._metric_rows: list[tuple[int, dict]] = []
        self._rank_rows: list[tuple] = []
        self._events: list[tuple] = []
        self._kinds: dict[str, int] = {}        # event kind -> int16 code, in order of appearance
        self._kinds_on_disk = 0
        self._last_step: int | None = None
        self._rows_in_file = 0
        self._io = threading.RLock()        # one update of the file at a time (close_at_exit)
        note = lock.acquire(self.path)
        if note:
            to_stderr(f"hpcnn: {note}")

        def fill(f):
            for k, v in {**root, **(extra_attrs or {})}.items():
                f.attrs[k] = v if _is_scalar(v) else _dumps(v)
            g = f.create_group("config")
            g.attrs["json"] = _dumps(config)
            for k, v in config.items():
                if k != "json" and _is_scalar(v):
                    g.attrs[k] = v
            f.create_group("plan")
            _create(f.create_group("metrics"), "step", "i8", _CHUNK["metrics"])
            _create(f, "ranks", RANK_DTYPE, _CHUNK["ranks"])
            _create(f, "timeline", EVENT_DTYPE, _CHUNK["timeline"]).attrs["kind_names"] = "[]"
        try:
            _create_file(self.path, self.durable, fill)
        except BaseException:
            lock.release(self.path)
            raise

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._metric_rows)} rows buffered"
        return f"RunLog({self.path!r}, {self._rows_in_file} steps on disk, {state})"

    @property
    def flushed_steps(self) -> int:
        """Number of metric rows (steps) written to the file so far."""
        return self._rows_in_file

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"run log {self.path} is closed")

    def set_plan(self, plan: dict) -> None:
        """Write (or update) ``/plan`` attributes now; non-scalar values are stored as JSON."""
        self._check_open()
        self._write(lambda f: self._set_plan(f["plan"], plan))

    @staticmethod
    def _set_plan(g: h5py.Group, plan: dict) -> None:
        json_keys = set(json.loads(g.attrs.get("json_keys", "[]")))
        for k, v in plan.items():
            if _is_scalar(v):
                g.attrs[k] = v
                json_keys.discard(k)
            else:
                g.attrs[k] = _dumps(v)
                json_keys.add(k)
        g.attrs["json_keys"] = _dumps(sorted(json_keys))

    def log_metrics(self, step: int, **values: float) -> None:
        """Buffer one row of ``/metrics`` (one call per step, steps strictly increasing).

        Metrics missing from this row are stored as NaN; a new name back-fills earlier rows with NaN.
        Every ``flush_every``-th call flushes; log a step's ranks and events before its metrics so
        that they reach the file in the same flush.
        """
        self._check_open()
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} <= last logged step {self._last_step}; "
                             "pass all metrics of a step in one log_metrics call")
        bad = [k for k in values if k == "step" or "/" in k]
        if bad:
            raise ValueError(f"metric names {bad} not allowed ('step' is the row key; no '/')")
        self._last_step = step
        with self._io:
            self._metric_rows.append((step, {k: float(v) for k, v in values.items()}))
        if len(self._metric_rows) >= self.flush_every:
            self.flush()

    def log_ranks(self, step: int, rows: list[dict]) -> None:
        """Buffer per-rank rows of ``/ranks`` for ``step`` (rank 0 passes the gathered dicts).

        Each dict has ``rank`` and any of compute_s, comm_s, idle_s (NaN if absent), bytes_sent,
        peak_mem_bytes (-1 if absent).
        """
        self._check_open()
        for row in rows:
            unknown = set(row) - set(RANK_DTYPE.names)
            if unknown or "rank" not in row:
                raise KeyError(f"rank row {row} needs 'rank'; unknown keys {sorted(unknown)}, "
                               f"allowed {list(RANK_DTYPE.names)}")
            self._rank_rows.append((
                int(step), int(row["rank"]), float(row.get("compute_s", np.nan)),
                float(row.get("comm_s", np.nan)), float(row.get("idle_s", np.nan)),
                int(row.get("bytes_sent", -1)), int(row.get("peak_mem_bytes", -1))))
        self._maybe_force_flush()

    def log_events(self, events) -> None:
        """Buffer timeline events: tuples ``(rank, kind, microbatch, t_start, t_end)`` or dicts."""
        self._check_open()
        for ev in events:
            if isinstance(ev, dict):
                ev = tuple(ev[k] for k in EVENT_DTYPE.names)
            rank, kind, mb, t0, t1 = ev
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind not in self._kinds:
                if len(self._kinds) >= np.iinfo(np.int16).max:
                    raise ValueError(f"too many event kinds ({len(self._kinds)})")
                self._kinds[kind] = len(self._kinds)
            self._events.append((int(rank), self._kinds[kind], int(mb), float(t0), float(t1)))
        self._maybe_force_flush()

    def _maybe_force_flush(self) -> None:
        if len(self._rank_rows) + len(self._events) >= _MAX_BUFFERED:
            self.flush()

    def flush(self) -> None:
        """Append every buffered row to the file (open, append, close); time it in ``last_flush_s``."""
        if not (self._metric_rows or self._rank_rows or self._events):
            return
        t0 = time.perf_counter()
        with self._io:            # rows buffered by another thread meanwhile wait for the next
            if self._write(self._append_rows):
                self._rows_in_file += len(self._metric_rows)
                self._kinds_on_disk = len(self._kinds)
                self.n_flushes += 1
            self._metric_rows, self._rank_rows, self._events = [], [], []
        self.last_flush_s = time.perf_counter() - t0

    def mark(self, status: str) -> None:
        """Flush the buffered rows and write ``status`` now, the log staying open (from any
        thread): what a run about to stop already knows, kept even if it is killed before
        :meth:`close` (an interrupt, then a scheduler's or launcher's SIGKILL)."""
        with self._io:
            if not self.closed:
                self.flush()
                self._write(lambda f: f.attrs.update({"status": status}))

    def _append_rows(self, f: h5py.File) -> None:
        if self._metric_rows:
            self._flush_metrics(f["metrics"])
        if self._rank_rows:
            _append(f["ranks"], np.array(self._rank_rows, dtype=RANK_DTYPE))
        if self._events:
            _append(f["timeline"], np.array(self._events, dtype=EVENT_DTYPE))
            if len(self._kinds) != self._kinds_on_disk:
                f["timeline"].attrs["kind_names"] = _dumps(list(self._kinds))

    def _write(self, fill) -> bool:
        """One all-or-nothing update ``fill(h5py.File)``; True if committed.

        An ``OSError`` (a full disk, a lost file system) leaves the file as last committed: the
        run goes on, one warning names the path and the error, and later rows are dropped.
        """
        if self.error is not None:
            return False
        try:
            with self._io, _update(self.path, self.durable) as f:
                fill(f)
            return True
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"
            to_stderr(f"hpcnn: warning: cannot write the run log {self.path} ({self.error}); it "
                      f"keeps the {self._rows_in_file} steps written before, later rows are not "
                      f"logged")
            return False

    def _flush_metrics(self, g: h5py.Group) -> None:
        rows = self._metric_rows
        n = g["step"].shape[0]
        names = set(g) - {"step"}
        for _, vals in rows:
            names.update(vals)
        for name in sorted(names):
            if name not in g:     # appears mid-run: earlier rows are the NaN fill value
                g.create_dataset(name, shape=(n,), maxshape=(None,), dtype="f8",
                                 chunks=(_CHUNK["metrics"],), fillvalue=np.nan)
            _append(g[name], np.array([vals.get(name, np.nan) for _, vals in rows], dtype="f8"))
        _append(g["step"], np.array([s for s, _ in rows], dtype="i8"))   # last: readers trust it

    def close(self, status: str = "finished") -> None:
        """Flush, then write ``status`` (one of :data:`STATUSES`) and ``end_time``."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        if self.closed:
            return
        self.flush()
        attrs = {"status": status, "end_time": _now()}
        if self.error is None:
            self._write(lambda f: f.attrs.update(attrs))
        else:           # one last try, without a second warning: small, may fit where rows did not
            attrs.update(status="failed", log_error=self.error)
            with contextlib.suppress(OSError), _update(self.path, self.durable) as f:
                f.attrs.update(attrs)
        with contextlib.suppress(FileNotFoundError):
            if os.path.getsize(journal.journal_path(self.path)) == 0:
                os.unlink(journal.journal_path(self.path))
        lock.release(self.path)
        self.closed = True

    def close_at_exit(self, status: str, why: str, wait_s: float = 2.0) -> bool:
        """Close the log from another thread just before the process ends on its own
        (:mod:`hpcnn.signals`): wait up to ``wait_s`` for a write in progress, then, holding the
        file's update lock until the process is gone (a later write of the main thread waits
        for ever), record ``why`` under ``/plan`` ``ended``, flush every buffered row and write
        ``status``. False if the write in progress did not end in time (the log is left as
        last committed)."""
        if self.closed or not self._io.acquire(timeout=wait_s):
            return False
        self.set_plan({"ended": why})
        self.close(status)
        return True

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close("failed" if exc_type is not None else "finished")
        return False


@dataclasses.dataclass
class RunData:
    """Everything in one run log, as plain Python and NumPy objects (see :func:`read_run`)."""

    path: str
    attrs: dict
    config: dict
    plan: dict
    metrics: dict       # name -> (n_steps,) array, including "step"
    ranks: dict         # column -> (n_rows,) array
    timeline: dict      # column -> (n_events,) array; "kind" decoded to str

    @property
    def status(self) -> str:
        return self.attrs.get("status", "")


def _metric_columns(g: h5py.Group) -> dict:
    """All datasets of ``/metrics``, cut to a common length (``step`` is appended last in a flush)."""
    cols = {k: g[k][()] for k in g}
    n = min((len(c) for c in cols.values()), default=0)
    return {k: c[:n] for k, c in cols.items()}


def _table(ds: h5py.Dataset) -> dict:
    """A compound dataset as a dict of column arrays."""
    rows = ds[()]
    return {name: np.ascontiguousarray(rows[name]) for name in rows.dtype.names}


def read_run(path) -> RunData:
    """Read a run log written by :class:`RunLog`, finished or not.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    RunData
    """
    path = os.fspath(path)
    view = journal.committed_view(path)      # an update was cut short: read the state before it
    try:
        with (h5py.File(view, "r") if view is not None else _open(path, "r")) as f:
            return _read(path, f)
    finally:
        if view is not None:
            view.close()


def _read(path: str, f: h5py.File) -> RunData:
    attrs = {k: _plain(v) for k, v in f.attrs.items()}
    config = json.loads(f["config"].attrs["json"]) if "config" in f else {}
    plan = {k: _plain(v) for k, v in f["plan"].attrs.items()} if "plan" in f else {}
    for k in json.loads(plan.pop("json_keys", "[]")):
        plan[k] = json.loads(plan[k])
    metrics = _metric_columns(f["metrics"]) if "metrics" in f else {}
    ranks = _table(f["ranks"]) if "ranks" in f else {}
    timeline = _table(f["timeline"]) if "timeline" in f else {}
    kind_names = json.loads(f["timeline"].attrs.get("kind_names", "[]")) if timeline else []
    if "kind" in timeline:
        names = np.array(kind_names + ["?"], dtype=object)      # "?": code without a name
        timeline["kind"] = names[np.clip(timeline["kind"], 0, len(kind_names))].astype(str)
    return RunData(path, attrs, config, plan, metrics, ranks, timeline)
