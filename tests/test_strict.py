"""The strict device backend (hpcnn/strict.py): what it refuses, what it counts, and hpcnn's code
run under it. Every block kind's forward and backward under strict equal NumPy's bit for bit,
with no transfer to the host; a serial training run makes no host transfer between log
flushes; a host round-trip planted in a block's backward fails the run, naming the block and
the call. The parallel layouts under strict: tests/test_strict_mpi.py."""
import numpy as np
import pytest

from hpcnn import backend
from hpcnn.strict import StrictArray, StrictError

from test_block_contract import cases


@pytest.fixture
def strict():
    backend.set_device("strict")
    backend.strict_stats(reset=True)
    yield backend
    backend.set_device("cpu")


def test_implicit_host_copies_are_refused_with_the_call_site(strict):
    a = backend.to_device(np.arange(6.0).reshape(2, 3))
    for call, what in [(lambda: float(a.sum()), "float()"), (lambda: int(a[0, 0]), "int()"),
                       (lambda: bool(a.all()), "bool()"), (lambda: a.sum().item(), ".item()"),
                       (lambda: a.tolist(), ".tolist()"), (lambda: np.asarray(a), "__array__"),
                       (lambda: np.exp(a), "numpy.exp()"),
                       (lambda: np.concatenate([a, a]), "numpy.concatenate()"),
                       (lambda: a + np.ones(3), "a host array (3,)")]:
        with pytest.raises(StrictError) as e:
            call()
        assert what in str(e.value) and "test_strict.py" in str(e.value), str(e.value)
    assert backend.strict_stats()["to_host"] == 0


def test_sanctioned_transfers_are_counted_and_results_are_numpy_s(strict):
    h = np.arange(6.0).reshape(2, 3)
    a = backend.to_device(h)
    assert isinstance(a, StrictArray) and isinstance(a, backend.xp.ndarray)
    h[0, 0] = 7.0                                    # a device copy: not an alias of the host
    y = backend.xp.matmul(a, a.T) * np.float32(2) - 1.0
    ref = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(backend.to_host(y), ref @ ref.T * np.float32(2) - 1.0)
    with backend.host_ok():
        assert float(a.sum()) == 15.0
    backend.sync()
    got = backend.strict_stats()
    assert (got["to_device"], got["to_host"], got["host_ok"], got["sync"]) == (1, 2, 1, 1), got
    assert got["to_host_bytes"] == y.nbytes + 8


def test_mpi_is_refused_a_device_buffer(strict):
    from hpcnn.parallel.collectives.mpi_base import mpi_buffers
    with pytest.raises(backend.DeviceBufferError, match="device buffer handed to MPI in isend"):
        mpi_buffers("isend", backend.xp.zeros(3))
    h = np.zeros(3)
    assert mpi_buffers("isend", h) == (h,)


def _block_run(device):
    """Per case: y (or the loss), dx and the parameter gradients as host arrays, and the host
    transfers the forward and backward made."""
    backend.set_device(device)
    out = {}
    for name, block, x, targets in cases():
        try:
            out[name] = _one_block(block, x, targets)
        except (StrictError, NotImplementedError) as e:     # the test of that case shows it
            out[name] = f"{type(e).__name__}: {e}"
    backend.set_device("cpu")
    return out


def _one_block(block, x, targets):
    dev = backend.to_device(x)
    backend.strict_stats(reset=True)
    if targets is not None:
        y, cache = block.forward(dev, backend.to_device(targets))
        dx = block.backward(1.0, cache)
    else:
        y, cache = block.forward(dev)
        dy = np.random.default_rng(1).standard_normal(y.shape).astype(y.dtype)
        dx = block.backward(backend.to_device(dy), cache)
    moved = backend.strict_stats()["to_host"]
    arrays = [y, dx] + [p.grad for p in block.params]
    return [np.asarray(backend.to_host(a)) for a in arrays if a is not None], moved


@pytest.fixture(scope="module")
def block_runs():
    try:
        return _block_run("cpu"), _block_run("strict")
    finally:
        backend.set_device("cpu")


HOST_ONLY = ("gcn", "gcn-nobias")          # scipy.sparse: refused on a device (nn/gcn.py)


def test_graph_convolution_refuses_a_device(block_runs):
    for name in HOST_ONLY:
        assert block_runs[1][name].startswith("NotImplementedError: gcn: graph convolution runs "
                                              "on the CPU only"), block_runs[1][name]


@pytest.mark.parametrize("name", [c[0] for c in cases() if c[0] not in HOST_ONLY])
def test_every_block_under_strict_equals_numpy_exactly(block_runs, name):
    ref, got = block_runs[0][name], block_runs[1][name]
    assert not isinstance(got, str), got                    # refused under strict
    (ref, _), (got, moved) = ref, got
    assert moved == 0, f"{name}: {moved} host transfers in its forward and backward"
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(b, a, err_msg=name)


def _counted_run(tmp_path, monkeypatch, name, *args):
    """Train under strict with ``args``; returns the run's summary and the log of what each
    step, log flush and evaluation moved to the host: [(what, step, to_host, sync)]."""
    import hpcnn.train as loop
    from hpcnn.config import parse_overrides
    seen = []

    def counted(kind, fn):
        def f(*a, **kw):
            backend.strict_stats(reset=True)
            out = fn(*a, **kw)
            got = backend.strict_stats(reset=True)
            seen.append((kind, got["to_host"], got["sync"]))
            return out
        return f
    for kind, attr in (("step", "train_step"), ("flush", "log_metrics"), ("eval", "_evaluate")):
        monkeypatch.setattr(loop, attr, counted(kind, getattr(loop, attr)))
    cfg = parse_overrides([f"--log={tmp_path / name}", "--progress=false", "--device=strict",
                           *args])
    try:
        return loop.train(cfg), seen
    finally:
        backend.set_device("cpu")


GPT = ("--model=gpt", "--dataset=sonnet", "--steps=6", "--batch_size=4", "--block_size=16",
       "--dim=16", "--n_heads=2", "--dropout=0.1", "--optimizer=adamw", "--grad_accum=2",
       "--log_interval=3", "--eval_interval=6", "--eval_batches=2")


def test_a_serial_step_moves_nothing_to_the_host_between_log_flushes(tmp_path, monkeypatch):
    from hpcnn.log import read_run
    from hpcnn.train import train
    from hpcnn.config import parse_overrides
    r, seen = _counted_run(tmp_path, monkeypatch, "strict.h5", *GPT)
    steps = [s for s in seen if s[0] == "step"]
    assert len(steps) == 6 and all(s[1:] == (0, 1) for s in steps), seen  # one sync: the step's end
    assert [s[:2] for s in seen if s[0] == "flush"] == [("flush", 1)] * 2, seen  # 3 rows at once
    assert [s[0] for s in seen] == ["step"] * 3 + ["flush"] + ["step"] * 3 + ["eval", "flush"]
    ref = train(parse_overrides([f"--log={tmp_path / 'cpu.h5'}", "--progress=false", *GPT]))
    a, b = read_run(tmp_path / "cpu.h5").metrics, read_run(tmp_path / "strict.h5").metrics
    for k in ("loss", "val_loss", "lr"):
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    for p, q in zip(ref["model"].params, r["model"].params):
        np.testing.assert_array_equal(backend.to_host(q.data), p.data, err_msg=p.name)


def test_a_host_round_trip_planted_in_a_backward_fails_naming_block_and_call(tmp_path,
                                                                             monkeypatch):
    from hpcnn.nn.layers import LayerNorm
    honest = LayerNorm.backward

    def backward(self, dy, cache, *args, **kwargs):
        if float(dy.max()) > 1e9:            # the hidden round-trip: a device scalar read
            raise AssertionError("unreachable")
        return honest(self, dy, cache, *args, **kwargs)
    monkeypatch.setattr(LayerNorm, "backward", backward)
    with pytest.raises(StrictError) as e:
        _counted_run(tmp_path, monkeypatch, "planted.h5", *GPT)
    assert "float() at backward (" in str(e.value) and "test_strict.py:" in str(e.value)
    assert "in block LayerNorm" in str(e.value), str(e.value)


@pytest.mark.parametrize("extra", [("--remat=sqrt", "--n_layers=3"), ("--precision=fp16",)],
                         ids=["remat", "fp16"])
def test_remat_and_mixed_precision_under_strict_equal_numpy(tmp_path, extra):
    from hpcnn.config import parse_overrides
    from hpcnn.log import read_run
    from hpcnn.train import train
    args = (*GPT[:2], "--steps=3", *GPT[3:9], "--log_interval=3", *extra)
    for device in ("cpu", "strict"):
        try:
            train(parse_overrides([f"--log={tmp_path / device}.h5", "--progress=false",
                                   f"--device={device}", *args]))
        finally:
            backend.set_device("cpu")
    a, b = (read_run(tmp_path / f"{d}.h5").metrics for d in ("cpu", "strict"))
    for k in ("loss", "val_loss"):
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
