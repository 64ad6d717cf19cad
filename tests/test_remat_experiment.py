"""The rematerialization / offloading trade-off experiment and its figures, end to end (--quick)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcnn.log.results import load_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, *script), *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


@pytest.mark.long     # ~5-8 s: the experiment's quick sweep and its figures
def test_remat_tradeoff_quick_and_figures(tmp_path):
    out = _run(("experiments", "remat_tradeoff.py"), "--quick", f"--out={tmp_path}")
    assert "HEADLINE" in out and "wrote" in out
    path = tmp_path / "results.h5"
    t, attrs = load_table(path, "tradeoff")
    assert attrs["quick"] and attrs["cores"] >= 1 and "remat_tradeoff.py" in attrs["command"]
    bws = [5e8, 2e9]
    for model in ("cnn", "gpt", "gpth"):
        m = t["model"] == model
        # store-all and sqrt once, then each of the 4 budgets: optimal and one offload per bw
        assert m.sum() == 2 + 4 * (1 + len(bws))
        assert (t["arm"][m] == "store_all").sum() == 1 and (t["arm"][m] == "sqrt").sum() == 1
        opt = m & (t["arm"] == "optimal")
        order = np.argsort(t["budget_bytes"][opt])
        assert np.all(np.diff(t["predicted_time"][opt][order]) <= 1e-12)     # more memory, faster
        assert t["n_recompute"][opt][order][-1] == 0                          # store-all at the top
        for bw in bws:
            off = m & (t["arm"] == "optimal+offload") & (t["bandwidth"] == bw)
            assert off.sum() == opt.sum()
            for b, pt in zip(t["budget_bytes"][off], t["predicted_time"][off]):
                assert pt <= t["predicted_time"][opt & (t["budget_bytes"] == b)][0] + 1e-12
        sa = m & (t["arm"] == "store_all")
        # paired with itself: a ratio of two timings of ~1 ms (its value is noise, not tested)
        assert np.isfinite(t["overhead"][sa][0]) and t["overhead"][sa][0] > 0
        assert t["n_offload"][m & (t["arm"] != "optimal+offload")].max() == 0
    # the executor's account never exceeds the budget; the model without transients predicts it
    assert np.all(t["measured_peak"] <= t["budget_bytes"])
    assert np.all(t["predicted_peak"] <= t["budget_bytes"] + 1e-6)
    assert np.all(t["predicted_account_peak"] <= t["budget_bytes"] + 1e-6)
    remat = t["arm"] != "optimal+offload"                # no channel: the account is deterministic
    # (with a channel, the model without transients can peak above the heuristic's model with
    # them: an op that needs less room waits less for a copy, which then holds its bytes longer;
    # 1 run in 5 on the quick gpth. Both stay within the budget, which is the invariant.)
    assert np.all(t["predicted_account_peak"][remat] <= t["predicted_peak"][remat] + 1e-6)
    np.testing.assert_allclose(t["measured_peak"][remat], t["predicted_account_peak"][remat],
                               rtol=1e-3)
    # tracemalloc sees the transients too: within the budget up to Python objects (64 KiB), for
    # the arms without a channel. An offload arm's traced peak also holds what the channel's
    # worker thread allocates when it runs: on the quick gpth, 1 run in 6 traced ~0.9 MB above
    # the budget (2026-11-26, the same before and after that day's changes; not explained yet),
    # so the offload arms are held to their account (above), not to the traced peak.
    assert np.all(t["traced_peak"][remat] <= t["budget_bytes"][remat] + (64 << 10))
    assert np.all(t["grad_err"] < 1e-5)                  # every arm's gradients = store-all's
    assert np.all(t["overhead"] > 0) and np.all(np.isfinite(t["measured_time"]))
    s, _ = load_table(path, "solver")
    got = sorted(zip(s["kind"].tolist(), s["L"].tolist(), s["slots"].tolist()))
    assert got == sorted((k, L, n) for k in ("rotor", "combine") for L in (8, 16)
                         for n in (100, 250, 500))
    assert np.all(s["seconds"] > 0)
    h, _ = load_table(path, "headline")
    assert len(h["model"]) == 3 * (1 + len(bws))                      # cnn, gpt, gpth
    assert np.all(h["mem_gain_predicted"][np.isfinite(h["mem_gain_predicted"])] >= 1.0)
    figs = tmp_path / "figs"
    _run(("analysis", "remat_tradeoff.py"), f"--results={path}", f"--out={figs}")
    for name in ("remat_tradeoff_cnn.png", "remat_tradeoff_gpt.png", "remat_tradeoff_gpth.png",
                 "remat_solver_time.png"):
        assert (figs / name).read_bytes()[:4] == b"\x89PNG"
