"""Lab 6, reference solution: rotor's dynamic program for a homogeneous chain.

A chain of k identical stages; memory in slots. Per stage (Beaumont et al., arXiv 1911.13214):
``uf``, ``ub`` the forward and backward times; ``wx`` the slots of an input x[i] (a checkpoint);
``wbar`` the slots of x̄[i+1], what stage i's backward needs besides x[i]; ``wd`` those of a
gradient δ[i]. The ops are hpcnn's (:mod:`hpcnn.schedule.sequences`): ``F_ck(i)`` runs stage i
keeping its input as a checkpoint, ``F_n(i)`` keeps nothing, ``F_all(i)`` keeps x̄[i+1], ``B(i)``
runs the backward of stage i. :func:`hpcnn.memory.simulate.simulate` checks a sequence and gives
its time and peak; :class:`hpcnn.memory.executor.Executor` runs it on a real chain.

Graded by ``python labs/06-memory/grade.py labs/06-memory/solution.py``.
"""
import numpy as np

from hpcnn.schedule.ops import Op

ALL, NONE = -1, -2          # choice: F_all first; no sequence fits


def table(n, M, uf, ub, wx, wbar, wd):
    """Opt[k][m], the least time to run the forwards and backwards of a sub-chain of k stages
    from its stored input (counted outside m) and the gradient of its output (counted inside
    m), with m slots for everything else; k = 0..n (row 0 unused, inf), m = 0..M. Returns
    (opt, choice), arrays of shape (n + 1, M + 1): opt float (inf where nothing fits), choice
    ALL, NONE or the i of the best checkpoint.

    - k = 1: F_all then B, time uf + ub, if m >= 2 wd + wbar (δ out, x̄, δ in), else inf.
    - k > 1, the best of:
      * F_all first: uf + ub + Opt[k-1][m - wbar], if m >= 2 wd + wbar;
      * a checkpoint after i stages, i = 1 .. k-1 (F_ck then i-1 F_n, keeping x at stage i):
        i uf + Opt[k-i][m - wx] + Opt[i][m], if m >= wd + wx, and for i >= 2 also
        m >= wd + 2 wx (two inputs alive while F_n runs).
      ``choice`` is ALL when F_all is the best (or equal best), else the first best i.
    """
    opt = np.full((n + 1, M + 1), np.inf)
    choice = np.full((n + 1, M + 1), NONE, dtype=int)
    for k in range(1, n + 1):
        for m in range(M + 1):
            if m >= 2 * wd + wbar:
                rest = 0.0 if k == 1 else (opt[k - 1][m - wbar] if m >= wbar else np.inf)
                opt[k][m], choice[k][m] = uf + ub + rest, ALL
            for i in range(1, k):
                if m < wd + wx or (i >= 2 and m < wd + 2 * wx):
                    break
                cand = i * uf + opt[k - i][m - wx] + opt[i][m]
                if cand < opt[k][m]:
                    opt[k][m], choice[k][m] = cand, i
            if not np.isfinite(opt[k][m]):
                choice[k][m] = NONE
    return opt, choice


def sequence(choice, k, m, wx, wbar, s=0):
    """The op sequence of Opt[k][m] for stages s .. s+k-1, rebuilt from ``choice``:

    - choice ALL: F_all(s), then the sequence of the k-1 stages from s+1 with m - wbar slots,
      then B(s) (for k = 1: F_all(s), B(s));
    - choice i: F_ck(s), F_n(s+1) .. F_n(s+i-1), then the sequence of the k-i stages from s+i
      with m - wx slots, then that of the i stages from s with m slots.
    Raises ValueError for NONE."""
    c = int(choice[k][m])
    if c == NONE:
        raise ValueError(f"no sequence for {k} stages in {m} slots")
    if k == 1:
        return [Op("F_all", block=s), Op("B", block=s)]
    if c == ALL:
        return [Op("F_all", block=s)] + sequence(choice, k - 1, m - wbar, wx, wbar, s + 1) \
            + [Op("B", block=s)]
    ahead = [Op("F_ck", block=s)] + [Op("F_n", block=j) for j in range(s + 1, s + c)]
    return ahead + sequence(choice, k - c, m - wx, wx, wbar, s + c) \
        + sequence(choice, c, m, wx, wbar, s)


def recomputed(seq, n):
    """Forwards run beyond the first of each of the n stages."""
    return sum(op.kind in ("F_ck", "F_n", "F_all") for op in seq) - n
