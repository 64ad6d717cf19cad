"""Tables of results (benchmarks, experiments) in HDF5: one group per table, one dataset per column.

::

    save_table("runs/bench/serial_step.h5", "mlp", rows, attrs={"threads": 1})
    load_table("runs/bench/serial_step.h5", "mlp") -> {column: numpy array}, attrs

Rows are dicts with the same keys; numbers become float64/int64 columns, strings UTF-8 strings.
Appending to an existing file replaces a table of the same name and keeps the others.
"""
from __future__ import annotations

import json
import os
import time

import h5py
import numpy


def save_table(path: str, name: str, rows: list[dict], attrs: dict | None = None) -> None:
    if not rows:
        raise ValueError(f"table {name!r}: no rows to save")
    keys = list(rows[0])
    for i, r in enumerate(rows):
        if list(r) != keys:
            raise ValueError(f"table {name!r}: row {i} has columns {list(r)}, expected {keys}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with h5py.File(path, "a") as f:
        if name in f:
            del f[name]
        g = f.create_group(name)
        for k in keys:
            col = [r[k] for r in rows]
            if all(isinstance(v, str) for v in col):
                g.create_dataset(k, data=numpy.array([str(v) for v in col], dtype=h5py.string_dtype()))
            else:
                g.create_dataset(k, data=numpy.asarray(col, dtype=numpy.float64
                                                       if any(isinstance(v, float) for v in col)
                                                       else numpy.int64))
        g.attrs["saved"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for k, v in (attrs or {}).items():
            if isinstance(v, numpy.generic):
                v = v.item()                    # NumPy scalars, e.g. attrs read back by load_table
            if isinstance(v, str):
                v = str(v)                      # plain str (subclasses such as versions too)
            elif not isinstance(v, (int, float, bool)):
                v = json.dumps(v)
            g.attrs[k] = v


def load_table(path: str, name: str):
    """-> (columns dict name -> numpy array (strings decoded), attrs dict)."""
    with h5py.File(path, "r") as f:
        g = f[name]
        cols = {}
        for k, d in g.items():
            v = d[()]
            if v.dtype.kind == "O" or v.dtype.kind == "S":
                v = numpy.array([s.decode() if isinstance(s, bytes) else s for s in v])
            cols[k] = v
        return cols, dict(g.attrs)
