"""The checked tables of a machine file (:mod:`hpcnn.plan.machine`) and their TOML text.

A machine file holds figures piecewise: a level's bandwidth by message size
(``[[max_bytes, bytes_per_s], ..., [inf, ...]]``), a device's slowdown by tokens per call and its
optimizer step by parameter count (interpolated in log(count) by :func:`log_interp`), the handoff
by compute before a message (:func:`read_points`, :func:`between`), the collectives' seconds after
compute (:func:`read_curves`, :func:`along`) and their scales by group size (:func:`read_group_scales`).
Each reader checks its table when the file is read and names the field and the value it
refuses; the ``toml_*`` helpers write the same tables back.
"""
from __future__ import annotations

import math
import numbers


def positive(value, what: str, allow_zero: bool = False) -> float:
    """``value`` as a float, ValueError naming ``what`` unless it is a finite number > 0 (>= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} = {value!r}: expected a number")
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} = {value!r}: expected a number {'>=' if allow_zero else '>'} 0")
    return float(value)



def finite_positive(value, what: str) -> float:
    """``value`` as a float, ValueError naming ``what`` unless it is a finite number > 0."""
    number = positive(value, what)
    if math.isinf(number):
        raise ValueError(f"{what} = {value!r}: expected a finite number > 0")
    return number



def between(points, x: float) -> float:
    """The value at ``x`` of points ((x, value), ...), x increasing: linear between them,
    flat outside them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, v0), (x1, v1) in zip(points, points[1:]):
        if x <= x1:
            return v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    return points[-1][1]



def along(curve, nbytes: float) -> float:
    """Seconds at ``nbytes`` on a curve of (bytes, seconds), bytes increasing: linear between
    its points, its first seconds below them, the last two points' slope past them."""
    if nbytes <= curve[0][0] or len(curve) == 1:
        return curve[0][1]
    for (b0, t0), (b1, t1) in zip(curve, curve[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = curve[-2], curve[-1]
    return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)



def read_curves(table, what: str) -> dict:
    """A level's ``after_compute`` checked: {"KIND.N": ((c, bytes, seconds), ...)} with KIND
    "allreduce" or "alltoall", N an integer >= 2, every number finite and >= 0, and per c the
    bytes strictly increasing; empty for none."""
    if not isinstance(table, dict):
        raise ValueError(f"{what} = {table!r}: expected a table of \"KIND.N\" = [[c, bytes, "
                         "seconds], ...]")
    out = {}
    for key, rows in table.items():
        kind, _, n = str(key).partition(".")
        if kind not in ("allreduce", "alltoall") or not n.isdigit() or int(n) < 2:
            raise ValueError(f"{what}: key {key!r}: expected \"allreduce.N\" or \"alltoall.N\" "
                             "with N an integer >= 2 (ranks)")
        if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__") or not rows:
            raise ValueError(f"{what}[{key!r}] = {rows!r}: expected a list of [c, bytes, seconds]")
        checked, last = [], {}
        for i, row in enumerate(rows):
            if isinstance(row, (str, bytes, dict)) or not hasattr(row, "__len__") or len(row) != 3:
                raise ValueError(f"{what}[{key!r}][{i}] = {row!r}: expected [c, bytes, seconds]")
            c, b, t = (positive(x, f"{what}[{key!r}][{i}] {name}", allow_zero=True)
                       for x, name in zip(row, ("c", "bytes", "seconds")))
            if any(math.isinf(x) for x in (c, b, t)):
                raise ValueError(f"{what}[{key!r}][{i}] = {list(row)!r}: expected finite numbers")
            if c in last and b <= last[c]:
                raise ValueError(f"{what}[{key!r}][{i}] bytes = {row[1]!r}: at c = {row[0]!r} "
                                 f"the bytes must increase (previous {last[c]!r})")
            last[c] = b
            checked.append((c, b, t))
        out[f"{kind}.{int(n)}"] = tuple(checked)
    return out



def read_group_scales(items, what: str, curves: dict) -> tuple:
    """A level's ``group_scales`` checked: ((int n, float k), ...), n an integer >= 2 with an
    ``after_compute`` curve of that group size, k finite and > 0, n increasing; empty for
    none."""
    out = []
    sizes = {int(key.split(".")[1]) for key in curves}
    for i, (n, k) in read_pairs(items, what, ("n", "k")):
        if isinstance(n, bool) or not isinstance(n, (int, float)) or n != int(n) or n not in sizes:
            raise ValueError(f"{what}[{i}] n = {n!r}: expected the group size of an "
                             f"after_compute curve ({sorted(sizes)})")
        k = finite_positive(k, f"{what}[{i}] k")
        if out and int(n) <= out[-1][0]:
            raise ValueError(f"{what}[{i}] n = {n!r}: the group sizes must increase (previous "
                             f"{out[-1][0]})")
        out.append((int(n), k))
    return tuple(out)



def read_pairs(items, what: str, names: tuple):
    """(i, pair) of each [a, b] pair in the list ``items``; ValueError naming ``what`` and the
    two entries' ``names`` for anything else."""
    a, b = names
    if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):
        raise ValueError(f"{what} = {items!r}: expected a list of [{a}, {b}]")
    for i, pair in enumerate(items):
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise ValueError(f"{what}[{i}] = {pair!r}: expected [{a}, {b}]")
        yield i, pair



def read_points(points, what: str) -> tuple:
    """Handoff points as a tuple of (float after_s, float seconds), checked: both finite and
    >= 0, after_s strictly increasing; empty for none."""
    out = []
    for i, pt in read_pairs(points, what, ("after_s", "seconds")):
        after, sec = (positive(x, f"{what}[{i}] {name}", allow_zero=True)
                      for x, name in zip(pt, ("after_s", "seconds")))
        if math.isinf(after) or math.isinf(sec):
            raise ValueError(f"{what}[{i}] = {list(pt)!r}: expected finite numbers")
        if out and after <= out[-1][0]:
            raise ValueError(f"{what}[{i}] after_s = {pt[0]!r}: the points' after_s must "
                             f"increase (previous {out[-1][0]!r})")
        out.append((after, sec))
    return tuple(out)



def read_pieces(pieces, what: str, names=("max_bytes", "bytes_per_s")) -> tuple:
    """Pieces as a tuple of (float max, float value), checked: at least one, the maxima strictly
    increasing, the last one infinite, every value finite and > 0. ``names`` name the two
    entries in the errors (a level's bandwidth: max_bytes, bytes_per_s)."""
    top_name, value_name = names
    out = []
    for i, piece in read_pairs(pieces, what, names):
        top = positive(piece[0], f"{what}[{i}] {top_name}")
        if out and top <= out[-1][0]:
            raise ValueError(f"{what}[{i}] {top_name} = {piece[0]!r}: the pieces' {top_name} "
                             f"must increase (previous {out[-1][0]!r})")
        value = positive(piece[1], f"{what}[{i}] {value_name}")
        if math.isinf(value):
            raise ValueError(f"{what}[{i}] {value_name} = inf: expected a finite number")
        out.append((top, value))
    if not out or not math.isinf(out[-1][0]):
        raise ValueError(f"{what} = {pieces!r}: the last piece's {top_name} must be inf")
    return tuple(out)



def log_interp(pieces: tuple, n: float, what: str) -> float:
    """The value of checked pieces ((x, value), ..., (inf, value)) at ``n`` (``what`` names it
    in the error): each finite piece is a measured point, the value interpolated linearly in
    log(x) between neighbouring points; below the first point it is its value, above the last
    finite point the last (infinite) piece's."""
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not 0 <= n < math.inf:
        raise ValueError(f"{what} = {n!r}: expected a finite number >= 0")
    points = pieces[:-1]                         # the measured points; pieces[-1] ends at inf
    if not points or n > points[-1][0]:
        return pieces[-1][1]
    if n <= points[0][0]:
        return points[0][1]
    (n0, s0), (n1, s1) = next((a, b) for a, b in zip(points, points[1:]) if n <= b[0])
    return s0 + math.log(n / n0) / math.log(n1 / n0) * (s1 - s0)



def toml_str(s: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's for the characters that matter here)."""
    import json
    return json.dumps(s, ensure_ascii=False)



def toml_num(x: float) -> str:
    """A float written so it reads back identical: inf as TOML's inf, whole numbers short."""
    if math.isinf(x):
        return "inf"
    if x == int(x) and abs(x) < 2**53:
        return str(int(x))
    return repr(float(x))



def toml_pieces(pieces) -> str:
    """Pieces ((max, value), ...) as a TOML array of pairs, inf written as TOML's inf."""
    return "[" + ", ".join(f"[{toml_num(m)}, {toml_num(v)}]" for m, v in pieces) + "]"
