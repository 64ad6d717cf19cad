"""Does the planner's cost model rank the layouts this machine runs? Predicted against measured.

What: on ``--ranks`` ranks of this machine (issue 13, "Done when", second bullet),

1. **calibrate**: ``hpcnn calibrate --write OUT/machine-rR.toml`` on those ranks at the start of
   every round R (or ``--machine=FILE`` for all): the only figures the predictions use. A round's
   layouts are predicted on that round's machine and a layout's prediction is the median over
   rounds, as its measurement is: on a shared machine the rates drift between rounds, and a
   calibration taken once would price every round with one moment's load;
2. **enumerate** the layouts ``hpcnn train`` runs:

   - a GPT (``--gpt=L,D,H,T,B``: layers, width, heads, context, global batch; sonnet, float32):
     every dp x tp x pp of :func:`hpcnn.plan.hybrid.layouts` with one micro-batch when pp = 1 and
     every micro-batch count it has (``--microbatches``: all, 1 to 32 at batch 32; or a list)
     with each schedule (1f1b, gpipe, zb_h1) when pp > 1, each with
     remat none and full (``hpcnn train --remat=full``: every block's input kept and its
     forward run again, the planner's ``remat="full"``; not with zb_h1, which ``hpcnn train``
     does not rematerialize), the remat none layouts first;
   - an MLP on digits (``--hidden``, float32, ``--mlp_batch``): per Linear one of the cuts
     whose parts are powers of two dividing p (:func:`cut_options`: on 2 ranks data parallel
     Cut(2,1,1), row Cut(1,2,1), column Cut(1,1,2) or replicated Cut(1,1,1); on 4 ranks ten,
     the mixed ones such as Cut(2,1,2) included), written as plan files for ``hpcnn train
     --model=mlp --tp=p --plan=FILE``: every combination (``--mlp_layouts=all``: 64 on 2 ranks,
     1000 on 4) or N of them (always the uniform ones, the DRA's choice and the least BSP
     price on the first round's machine, the rest a seeded sample);

3. **measure** each with ``mpiexec -n p python -m mpi4py -m hpcnn train ... --log=``, the
   layouts' order reversed every other round (``--rounds``), the run's figure the median
   ``step_time`` after its first 20 % of steps (as benchmarks/loop_ab.py), the layout's figure
   the median over rounds; **predict** with :func:`hpcnn.plan.hybrid.price` (GPT) and
   :func:`hpcnn.plan.cost.strategy_cost` (MLP) on each round's calibrated machine;
4. per model: Kendall tau (scipy.stats.kendalltau) and MAPE of predicted against measured, the
   MAPE again after one constant scale per model (the geometric mean of measured / predicted:
   what is left is ranking error, not a uniform offset), and the planner's choice against the
   best measured: for the GPT the least priced layout (what ``hybrid.plan`` ranks first among
   these), for the MLP the layout of least BSP price (what ``--plan=auto`` runs where the
   machine file holds the ranks: ``search.least_price``); the DRA's cuts (SAPP's volumes, the
   choice on larger machines) are recorded apart, in the summary's ``dra`` column.

Memory: every row holds the planner's memory per rank (``hybrid.price().memory_bytes`` for the
GPT, ``cost.strategy_cost().memory_bytes`` for the MLP) and what the run logged
(``meas_memory_bytes``, :func:`read_log`): per rank the engine's peak activation bytes (the
caches its micro-batches hold between passes, a rematerialized pass's inside peak) plus the
bytes of its parameter, gradient and optimizer arrays, the largest rank's; transients inside a
pass (a product's output, message buffers) are in neither. Also the largest resident set size
(``/ranks`` peak_mem_bytes, which includes the interpreter and the data).

    python experiments/plan_validation.py [--machine=FILE] [--out=runs/plan_validation]
        [--rounds=3] [--gpt_steps=12] [--mlp_steps=40] [--mlp_layouts=16] [--confirm=0]
    python analysis/plan_validation.py runs/plan_validation/results.h5 docs/figures/plan_validation.png

5. **confirm** (``--confirm=N``, ``--confirm_rounds=R``): the best of a sweep is the least of
   many noisy medians, measured minutes away from the choice (under load, launch to launch
   noise is 7-13 % here), so it is biased low. The planner's choice and the N fastest other
   layouts are measured again, R rounds alternated, and the choice is compared with the best
   of these round by round (``confirm_choice_over_best``: the median of per-round ratios).
   The sweep's ``choice_over_best`` is kept as measured.

Output: OUT/results.h5, tables ``layouts`` (one row per layout: ``pred_s`` the median prediction,
``pred_min_s``/``pred_max_s`` its range over rounds), ``summary`` (one per model) and, with
``--confirm``, ``confirm`` (one row per layout measured again), the machine
files OUT/machine-rR.toml when calibrated here, the plan files and run logs under OUT/runs.
"""
import sys

from hpcnn import scripts
from hpcnn.plan.validation import HIDDEN
from hpcnn.validation_runs import validate


def parser():
    ap = scripts.parser(__doc__)
    ap.add_argument("--machine", default="", help="machine file; default: calibrate here, "
                    "once per round")
    ap.add_argument("--out", default="runs/plan_validation")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpt", default="4,128,4,64,32", help="layers,dim,heads,context,batch")
    ap.add_argument("--microbatches", default="all", help="micro-batch counts when pp > 1: "
                    "all (every count hpcnn.plan.hybrid.layouts has), or a list")
    ap.add_argument("--gpt_steps", type=int, default=12)
    ap.add_argument("--gpt_layouts", default="all", help="all, or the first N")
    ap.add_argument("--hidden", default=HIDDEN)
    ap.add_argument("--mlp_batch", type=int, default=256)
    ap.add_argument("--mlp_steps", type=int, default=40)
    ap.add_argument("--mlp_layouts", default="16", help="all (4**layers), or N")
    ap.add_argument("--confirm", type=int, default=0, help="after the sweep, measure the "
                    "planner's choice and the N fastest other layouts again, side by side")
    ap.add_argument("--confirm_rounds", type=int, default=5)
    return ap


def main(argv=None) -> int:
    return validate(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
