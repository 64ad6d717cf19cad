"""The bytes a GPT block's memory-bound operations move (hpcnn.plan.traffic), the planner's
pricing of them where a machine file has ``elementwise.moved``, and the blocks' dropout."""
import math

import pytest

from hpcnn.nn.transformer import TransformerBlock
from hpcnn.parallel.tensor.attention import ParallelTransformerBlock
from hpcnn.plan import hybrid, traffic
from hpcnn.plan.hybrid import Layout, Transformer, _ShapeComm, price
from hpcnn.plan.machine import Device, Level, Machine
from hpcnn.plan.published import loads

T, C, NH = 16, 32, 4
ACT, SCORES = T * C * 4, NH * T * T * 4           # one activation, one head-set of scores (fp32)


def test_each_memory_bound_operation_moves_its_input_output_and_cache_once_a_pass():
    """Counted by hand: LayerNorm reads x, writes y and its normalized input (+ one float a
    row), backward reads dy and the cache, writes dx; GELU on the 4C hidden likewise; a
    dropout writes a mask; a residual reads two inputs; the softmax 2 score arrays forward, 3
    backward; the GEMMs nothing (their roofline counts them); at p = 0 the dropouts are
    identities and move nothing."""
    with_drop = traffic.moved(TransformerBlock(C, NH, dtype="float32", keep=(),
                                               dropout=0.1).spec((1, T, C)))
    rows = 2 * 4 * T                                  # LayerNorm's per-row float, two of them
    assert with_drop == (30 * ACT + rows + 5 * SCORES, 30 * ACT + rows + 6 * SCORES,
                         5 * SCORES)
    without = traffic.moved(TransformerBlock(C, NH, dtype="float32", keep=()).spec((1, T, C)))
    assert without == (24 * ACT + rows + 2 * SCORES, 24 * ACT + rows + 3 * SCORES,
                       2 * SCORES)
    gemms = [leaf for leaf in traffic.leaves(TransformerBlock(C, NH, keep=()).spec((1, T, C)))
             if leaf.name.endswith(traffic.GEMM_LEAVES)]
    assert len(gemms) == 5 and all(traffic.leaf_moved(g) == (0, 0) for g in gemms)


def test_tensor_parallel_blocks_split_what_megatron_splits():
    """On tp ranks the attention core and the MLP's GELU are split; LayerNorm, the dropouts
    after the projections and the residuals run whole on every rank, unless sequence
    parallelism splits them too, when a rank moves exactly 1/tp of the serial block's bytes."""
    serial = traffic.moved(TransformerBlock(C, NH, dtype="float32", keep=(),
                                            dropout=0.1).spec((1, T, C)))

    def tp_block(sp):
        blk = ParallelTransformerBlock(_ShapeComm(4), C, NH, dtype="float32", keep=(),
                                       dropout=0.1, sequence_parallel=sp)
        return traffic.moved(blk.spec((1, T // 4 if sp else T, C)))
    assert tp_block(True) == tuple(x / 4 for x in serial)
    whole = 18 * ACT + 2 * 4 * T                 # ln1, ln2, two dropouts, two residuals
    assert [a - b for a, b in zip(tp_block(False), tp_block(True))] == [
        whole * 3 / 4, whole * 3 / 4, 0]


def _gpu(moved: float | None) -> Machine:
    dev = Device("gpu", {"bfloat16": 300e12}, 2e12, 80e9,
                 elementwise={"moved": moved} if moved is not None else {})
    return Machine(name="stub", levels=(Level("node", 8, 2e-6, ((math.inf, 250e9),)),),
                   device=dev)


@pytest.mark.parametrize("remat", ["none", "full", "selective"])
def test_the_step_pays_the_bytes_moved_at_the_machine_files_rate(remat):
    """The ``memory_bound`` part is the micro-batches' blocks' bytes (forward, backward and
    what the recomputation runs again) and the loss tail's, at ``moved`` seconds a byte; the
    step grows by exactly that over a file without the figure, and the parts still sum up."""
    gpt = Transformer(n_layers=4, dim=64, n_heads=4, seq=32, vocab=96, batch=8, dropout=0.1)
    lay = Layout(1, 2, 1, 2, remat=remat)
    with_it, bare = price(gpt, lay, _gpu(1e-12)), price(gpt, lay, _gpu(None))
    assert with_it.step_s == pytest.approx(sum(with_it.parts.values()), rel=1e-12)
    f, b, core = hybrid._moved(64, 4, 32, 2, 2, False, 0.1)
    f_tail, b_tail = hybrid._tail_moved(64, 32, 4, 96, 2, 2)
    again = {"none": 0, "full": 4 * f, "selective": 4 * core}[remat]
    # the second micro-batch's gradients added to the first's: 3 float32 words a parameter
    acc = 3 * 4 * hybrid._accumulated_params(gpt, lay, 4, True)
    expected = 2 * (4 * 4 * (f + b) + 4 * again + f_tail + b_tail) * 1e-12 + acc * 1e-12
    assert with_it.parts["memory_bound"] == pytest.approx(expected, rel=1e-9)
    assert bare.parts["memory_bound"] == 0.0
    # tp's allreduces wait on the compute between them, the rest is the bytes moved
    assert with_it.step_s - bare.step_s == pytest.approx(expected, rel=1e-2)


def test_the_gradients_accumulation_is_three_words_a_parameter_after_the_first():
    """hpcnn's engine writes the first micro-batch's weight gradients in place and adds each
    later one (Parameter.add_matmul): 3 gradient words (float32 under 16 bits) a parameter of
    the blocks and the LM head, the embedding's tables apart, on m - 1 of the m passes; in the
    backward pass (zero bubble: its weight half), and nothing with one micro-batch, nor on a
    file whose measured passes hold it (no ``moved``)."""
    gpt = Transformer(n_layers=4, dim=64, n_heads=4, seq=32, vocab=96, batch=8)
    gpu = _gpu(1e-12)
    one, four = Layout(1, 1, 2, 1), Layout(1, 1, 2, 4)
    per_block = 12 * 64 * 64 + 13 * 64          # QKV, projection, MLP (4 x wide), biases, norms
    params = hybrid._accumulated_params(gpt, four, 2, True)
    assert params == 2 * per_block + 96 * 64
    assert hybrid.accumulate_seconds(gpt, one, gpu, params) == 0.0
    assert hybrid.accumulate_seconds(gpt, four, _gpu(None), params) == 0.0
    assert hybrid.accumulate_seconds(gpt, four, gpu, params) == pytest.approx(
        3 * 4 * params * 3 / 4 * 1e-12, rel=1e-12)
    wide = Transformer(n_layers=4, dim=64, n_heads=4, seq=32, vocab=96, batch=8,
                       dtype="float64")
    assert hybrid.accumulate_seconds(wide, four, gpu, params) == pytest.approx(
        3 * 8 * params * 3 / 4 * 1e-12, rel=1e-12)
    acc = 3 * 4 * params * 3 / 4 * 1e-12
    for schedule in ("1f1b", "zb_h1"):
        lay = Layout(1, 1, 2, 4, schedule)
        with_it = hybrid.stage_times(gpt, lay, gpu)
        k, rows, lvl = hybrid._pass_args(gpt, lay, gpu)
        key = hybrid._pass_with(gpt, k, gpu, rows, 2, True, lvl)      # the pass without it
        assert with_it.t_b == pytest.approx(key[1] + acc, rel=1e-12)
        assert with_it.t_w == pytest.approx(key[2] + (acc if schedule == "zb_h1" else 0.0),
                                            rel=1e-12)


def test_dropout_caches_its_masks_and_is_checked():
    """A GPT with dropout holds each dropout's mask (the attention's a s^2 words a sequence,
    two activations' more) and moves them; a probability outside [0, 1) is refused in the
    model and in the published runs' file."""
    base = Transformer(n_layers=2, dim=64, n_heads=4, seq=32, vocab=96, batch=8)
    drop = Transformer(n_layers=2, dim=64, n_heads=4, seq=32, vocab=96, batch=8, dropout=0.1)
    lay = Layout(1, 1, 1, 1)
    grown = hybrid._layout_block(drop, lay, 1)[2] - hybrid._layout_block(base, lay, 1)[2]
    assert grown == (4 * 32 * 32 + 2 * 32 * 64) * 2           # masks in 16-bit words
    assert price(drop, lay, _gpu(1e-12)).parts["memory_bound"] > price(
        base, lay, _gpu(1e-12)).parts["memory_bound"]
    with pytest.raises(ValueError, match="0 <= dropout < 1"):
        Transformer(n_layers=2, dim=64, n_heads=4, dropout=1.0)
    row = ('[[sources]]\nid = "s"\ntitle = "t"\nurl = "u"\n[[runs]]\nname = "r"\nsource = "s"\n'
           'where = "w"\nmodel = "m"\nlayers = 2\nhidden = 64\nheads = 4\nsequence = 32\n'
           'device = "A100"\ndevices = 1\ntp = 1\npp = 1\ndp = 1\nglobal_batch = 8\n'
           'iteration_seconds = 1.0\ndropout = 1.5\n')
    with pytest.raises(ValueError, match=r"dropout = 1\.5: expected a probability in \[0, 1\)"):
        loads(row)
