"""The teaching labs (labs/) never rot: each grader passes its reference solution and fails,
naming the problem, on the unmodified skeleton and on planted mistakes.

A planted mistake is the reference solution with a few lines changed (:data:`PLANTED`: the lab,
what it plants, the replacements, and a phrase the grader's message must contain), written to a
temporary file and graded like a student's. ``make labs-reference`` grades the solutions alone.
``make test`` grades lab 1 (:data:`FIRST_LAB`): its solution, skeleton and first planted mistake;
``make test-long`` every other lab and planted mistake.
"""
import os
import subprocess
import sys

import pytest

from mpi_util import ROOT

LABS = {1: "01-collectives", 2: "02-data-parallel", 3: "03-zero", 4: "04-tensor-parallel",
        5: "05-pipelines", 6: "06-memory", 7: "07-planning", 8: "08-hang"}
TIMEOUT = 150           # seconds per grading run; the graders end a hang themselves after 90
# the lab graded in make test (its solution, skeleton and first planted mistake); the other labs'
# gradings, each a few seconds of mpiexec, are in make test-long (the suite's time budget)
FIRST_LAB = 1

# (lab, mistake, [(old, new), ...] on solution.py, a phrase the FAIL message must contain)
PLANTED = [
    (1, "reversed ring direction", [("right, left = (r + 1) % p, (r - 1) % p",
                                     "right, left = (r - 1) % p, (r + 1) % p")],
     "sends to its right neighbour"),
    (1, "all-gather one step short", [("for k in range(p - 1):                                 # all-gather",
                                       "for k in range(p - 2):")],
     "the number of Sendrecv calls"),
    (1, "missing 1/p in the model", [("2 * (p - 1) / p * np.asarray", "2 * (p - 1) * np.asarray")],
     "ring_model(5e-6"),
    (1, "reduce-scatter adds the wrong chunk", [("mine = chunk(r - k - 1)", "mine = chunk(r - k)")],
     "the sum of"),
    (2, "missing 1/p", [("        g /= comm.Get_size()\n\n\ndef naive_step", "\n\ndef naive_step")],
     "naive: the gradient of"),
    (2, "buckets in forward order", [("for j in reversed(range(len(sizes))):",
                                      "for j in range(len(sizes)):")], "make_buckets("),
    (2, "buckets launched after the backward", [("if self.ready_at[k] == i:", "if i == 0:")],
     "the block at whose completion"),
    (2, "plain mean on unequal shares", [("g *= n_local", "g *= 1"),
                                         ("g /= total", "g /= comm.Get_size()")],
     "weighted mean, unequal shares: the gradient of"),
    (3, "missing 1/p", [("        grads /= self.comm.Get_size()\n", "")],
     "Zero1: the parameters after step 0"),
    (3, "the remainder's elements lost", [("return lo, lo + q + (r < extra)", "return r * q, r * q + q")],
     "shard_range("),
    (3, "the whole optimizer state on every rank",
     [("self.m = np.zeros(self.hi - self.lo)", "self.m = np.zeros(n)")],
     "the size of this rank's moment `m`"),
    (3, "ZeRO-2 by an allreduce",
     [("self.comm.Reduce_scatter(grads, part, recvcounts=self.counts, op=MPI.SUM)",
       "self.comm.Allreduce(MPI.IN_PLACE, grads)\n        part[:] = grads[self.lo:self.hi]")],
     "the collectives of a ZeRO-2 step"),
    (4, "weight gradient assigned instead of accumulated",
     [("        self.dw += x.T @ dy\n        self.db += dy.sum(axis=0)\n        return f_backward",
       "        self.dw = x.T @ dy\n        self.db += dy.sum(axis=0)\n        return f_backward")],
     "dw after a second backward"),
    (4, "bias added on every rank before the sum",
     [("return g_forward(self.comm, x @ self.w) + self.b, x",
       "return g_forward(self.comm, x @ self.w + self.b), x")], "RowParallelLinear: y"),
    (4, "transposed shard", [("k = w.shape[-1] // p\n    return w[..., r * k:(r + 1) * k].copy()",
                              "k = w.shape[0] // p\n    return w[r * k:(r + 1) * k].copy()")],
     "shard_columns("),
    (4, "f's backward without its allreduce",
     [("    comm.Allreduce(MPI.IN_PLACE, out)\n    return out\n\n\ndef g_forward",
       "    return out\n\n\ndef g_forward")], "f_backward"),
    (5, "1F1B warm-up one forward too long",
     [("    warm = min(S - 1 - s, M)\n    ops = [(\"F\", mb) for mb in range(warm)]  ",
       "    warm = min(S - s, M)\n    ops = [(\"F\", mb) for mb in range(warm)]  ")],
     "one_f_one_b_order("),
    (5, "GPipe backwards in reversed micro-batch order",
     [("[(\"B\", mb) for mb in range(M)]", "[(\"B\", mb) for mb in reversed(range(M))]")],
     "gpipe_order("),
    (5, "weight gradient assigned instead of accumulated",
     [("self.dw += x.T @ dz", "self.dw = x.T @ dz")], "dw after a second backward_weight"),
    (5, "B runs the whole backward in a split schedule",
     [("stage.backward_input(dy, cache), (dy, cache)", "stage.backward(dy, cache), (dy, cache)")],
     "zb_h1, M=4: the weight gradient"),
    (6, "off-by-one in the checkpoint positions",
     [("for i in range(1, k):", "for i in range(1, k - 1):")], "Opt["),
    (6, "a checkpoint's slots not charged",
     [("opt[k - i][m - wx] + opt[i][m]", "opt[k - i][m] + opt[i][m]")], "Opt["),
    (6, "the two halves rebuilt in the wrong order",
     [("return ahead + sequence(choice, k - c, m - wx, wx, wbar, s + c) \\\n"
       "        + sequence(choice, c, m, wx, wbar, s)",
       "return sequence(choice, c, m, wx, wbar, s) + ahead \\\n"
       "        + sequence(choice, k - c, m - wx, wx, wbar, s + c)")], "is not a valid sequence"),
    (6, "recomputations counted with the first forwards",
     [("for op in seq) - n", "for op in seq)")], "recomputed("),
    (7, "missing 1/n in the ring", [("latency + nbytes / n * g", "latency + nbytes * g")],
     "ring_allreduce("),
    (7, "gradient allreduce over the wrong group",
     [("\"grad allreduce\": ring(nb, local * word)", "\"grad allreduce\": ring(nk, local * word)")],
     "'grad allreduce' superstep"),
    (7, "bias left out of the update",
     [("local = i / nb, (k / nk + 1) * j / nj", "local = i / nb, k / nk * j / nj")],
     "'update' superstep"),
    (7, "forward FLOPs only", [("3 * 2 * i * k * j", "2 * i * k * j")], "'compute' superstep"),
    (8, "the rank with nothing to add still skips the allreduce",
     [("    return math.sqrt(comm.allreduce(local))\n\n\ndef _key",
       "    if local == 0.0:\n        return 0.0\n    return math.sqrt(comm.allreduce(local))\n\n\n"
       "def _key")], "collective calls in global_grad_norm differ"),
    (8, "the sum of the ranks' norms",
     [("return math.sqrt(comm.allreduce(local))", "return comm.allreduce(math.sqrt(local))")],
     "global_grad_norm: largest"),
    (8, "the majority named instead of the ranks apart",
     [("if waiting.get(r) != call", "if waiting.get(r) == call")],
     "diagnose(the watchdog's records"),
    (8, "only the first blocked rank reported",
     [("for r, lst in enumerate(lists) if pc[r] < len(lst)}",
       "for r, lst in enumerate(lists) if pc[r] < len(lst) and r == 0}")],
     "blocked(1f1b, stage 1 without warm-up)"),
]


def grade(lab: int, path: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(ROOT, "labs", LABS[lab], "grade.py"), path,
           "--out", str(tmp_path / "results.h5")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)


def lab_file(lab: int, name: str) -> str:
    return os.path.join(ROOT, "labs", LABS[lab], name)


def _lab_params():
    """Every lab, those but :data:`FIRST_LAB` in make test-long."""
    return [pytest.param(lab, marks=[] if lab == FIRST_LAB else [pytest.mark.long])
            for lab in sorted(LABS)]


@pytest.mark.parametrize("lab", _lab_params())
def test_the_reference_solution_passes(lab, tmp_path):
    p = grade(lab, lab_file(lab, "solution.py"), tmp_path)
    assert p.returncode == 0 and f"PASS lab {lab}" in p.stdout, p.stdout + p.stderr
    assert (tmp_path / "results.h5").exists()
    plot = subprocess.run([sys.executable, lab_file(lab, "plot.py"), str(tmp_path / "results.h5"),
                           str(tmp_path / "figure.png")], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep
                                   + os.environ.get("PYTHONPATH", "")))
    assert plot.returncode == 0 and (tmp_path / "figure.png").stat().st_size > 10000, plot.stderr


@pytest.mark.parametrize("lab", _lab_params())
def test_the_skeleton_fails_saying_what_to_write(lab, tmp_path):
    p = grade(lab, lab_file(lab, "skeleton.py"), tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "is not written yet (it raises NotImplementedError)" in p.stdout, p.stdout


def _planted_params():
    """:data:`FIRST_LAB`'s first planted mistake in ``make test``, every other one in
    ``make test-long`` (each grading run is a few seconds of mpiexec: the suite's time budget)."""
    seen = set()
    for lab, mistake, edits, phrase in PLANTED:
        marks = [pytest.mark.long] if lab in seen or lab != FIRST_LAB else []
        seen.add(lab)
        yield pytest.param(lab, mistake, edits, phrase, marks=marks, id=f"lab{lab}: {mistake}")


@pytest.mark.parametrize("lab, mistake, edits, phrase", list(_planted_params()))
def test_a_planted_mistake_fails_with_its_message(lab, mistake, edits, phrase, tmp_path):
    with open(lab_file(lab, "solution.py")) as f:
        text = f.read()
    for old, new in edits:
        assert text.count(old) == 1, f"the solution changed: {old!r} is not there once"
        text = text.replace(old, new)
    planted = tmp_path / "planted.py"
    planted.write_text(text)
    p = grade(lab, str(planted), tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    message = p.stdout.split(f"FAIL lab {lab}", 1)[-1]
    assert "FAIL" in p.stdout and phrase in message and "hint:" in message, p.stdout


def test_every_lab_has_three_planted_mistakes_and_its_files():
    for lab, folder in LABS.items():
        assert sum(1 for k, *_ in PLANTED if k == lab) >= 3, lab
        for name in ("README.md", "skeleton.py", "solution.py", "grade.py", "plot.py"):
            assert os.path.exists(lab_file(lab, name)), (folder, name)


def test_a_missing_student_file_says_to_copy_the_skeleton(tmp_path):
    p = grade(1, str(tmp_path / "student.py"), tmp_path)
    assert p.returncode == 2 and "cp labs/01-collectives/skeleton.py" in p.stdout, p.stdout


@pytest.mark.long
def test_a_hang_ends_with_each_ranks_last_step(tmp_path):
    """Rank 0 spins inside ring_allreduce: the grader kills the job at its timeout and names the
    step every rank was in (long: it waits out the timeout)."""
    with open(lab_file(1, "solution.py")) as f:
        text = f.read()
    old = "    p, r = comm.Get_size(), comm.Get_rank()\n"
    planted = tmp_path / "hang.py"
    planted.write_text(text.replace(old, old + "    while r == 0:\n        pass\n", 1))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, lab_file(1, "grade.py"), str(planted), "--timeout", "8",
                        "--out", str(tmp_path / "r.h5")], capture_output=True, text=True,
                       timeout=TIMEOUT, env=env, cwd=ROOT)
    assert p.returncode == 1 and "did not finish within 8 s (a hang)" in p.stdout, p.stdout
    assert "rank 3: 'ring_allreduce of 1000 elements'" in p.stdout, p.stdout
