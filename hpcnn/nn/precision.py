"""Mixed precision: 16-bit storage, fp32 compute, fp32 master copy, dynamic loss scaling.

``--precision=bf16|fp16`` (Micikevicius et al., ICLR 2018) keeps parameters and activations in
16 bits; the blocks upcast their operands to float32 for every matmul and compute LayerNorm's
statistics, the softmax and the loss in float32 (:func:`hpcnn.backend.up`), and a 16-bit
parameter's gradient is float32 (:attr:`hpcnn.nn.core.Parameter.grad_dtype`). Here:

- :class:`Format`: the storage and compute dtypes of a precision, and whether it scales the loss
  (:data:`FORMATS`; ``fp32`` is the plain run, ``None``);
- :class:`MasterCopy`: the optimizer of 16-bit parameters: SGD or AdamW steps float32 copies
  (:class:`MasterParameter`, whose gradient *is* the model parameter's float32 gradient) with
  float32 slots, and the result is written back rounded to nearest;
- :class:`LossScaler`: torch's ``GradScaler`` semantics: the loss gradient multiplied by the
  scale; on any non-finite gradient the step is skipped, the scale multiplied by ``backoff`` and
  the growth counter reset; after ``growth_interval`` consecutive good steps the scale is
  multiplied by ``growth``. Its two numbers live in the optimizer's state, so a checkpoint
  saves and restores them with the optimizer's step count.

The step engine (:func:`hpcnn.engine.step.train_step`) scales, unscales and skips;
``tests/test_precision.py`` runs the whole machinery with float64 storage and checks it equals
the plain float64 run bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy

from hpcnn import backend

PRECISIONS = ("fp32", "bf16", "fp16")
MODELS = ("mlp", "gpt")          # the models whose blocks store 16 bits and compute in fp32


@dataclass(frozen=True)
class Format:
    """``storage``: parameters and activations; ``compute``: matmuls, statistics, gradients,
    master copy and optimizer slots; ``scaled``: dynamic loss scaling (fp16's narrow range)."""

    storage: str
    compute: str
    scaled: bool


# precision -> its Format (None: the plain run in --dtype); read-only. A test replaces the whole
# mapping to run the machinery with float64 storage and compute (compared bit for bit).
FORMATS = MappingProxyType({"fp32": None, "bf16": Format("bfloat16", "float32", False),
                            "fp16": Format("float16", "float32", True)})


def format_of(cfg) -> Format | None:
    """The :class:`Format` of a run's ``--precision`` (None for fp32)."""
    return FORMATS[cfg.precision]


def storage_dtype(cfg) -> numpy.dtype:
    """The dtype of a run's parameters and activations: the format's, else ``--dtype``."""
    fmt = format_of(cfg)
    return backend.dtype_of(cfg.dtype if fmt is None else fmt.storage)


class MasterParameter:
    """The ``compute``-dtype master copy of a model parameter ``model``: its own ``data``, and
    the model parameter's gradient as its ``grad`` (reading, writing and scaling it in place)."""

    def __init__(self, model, dtype):
        self.model, self.name = model, model.name
        self.full = getattr(model, "full", model)       # (a ZeRO segment's whole parameter)
        self.data = model.data.astype(dtype)

    @property
    def grad(self):
        return self.model.grad

    @grad.setter
    def grad(self, value):
        self.model.grad = value

    @property
    def shape(self):
        return self.data.shape

    @property
    def size(self) -> int:
        return int(self.data.size)

    def write_down(self) -> None:
        """The model parameter := the master copy, rounded to nearest (even)."""
        self.model.data[...] = self.data


class MasterCopy:
    """The optimizer of a mixed-precision run: ``make(masters)`` (SGD, AdamW) steps the
    master copies of ``params`` in ``dtype``; each step ends by writing them down into the
    16-bit parameters. ``params`` (what checkpoints save and restore) are the masters."""

    def __init__(self, params, make, dtype):
        self.params = [MasterParameter(p, dtype) for p in params]
        self._by_name = {m.name: m for m in self.params}
        self.inner = make(self.params)

    @property
    def state(self) -> dict:
        return self.inner.state

    @property
    def clipped(self) -> list:
        return self.params

    def step(self, lr: float) -> None:
        self.inner.step(lr)
        self.write_down()

    def write_down(self) -> None:
        """Every model parameter := its master copy (after a step, or a restored checkpoint)."""
        for m in self.params:
            m.write_down()

    def held_arrays(self) -> list:
        """The optimizer's arrays (its slots and scratch; the master copies apart)."""
        return self.inner.held_arrays()

    def master_arrays(self) -> list:
        return [m.data for m in self.params]

    def saved_params(self, params) -> list:
        return params

    def set_master(self, name: str, array) -> None:
        """Restore the master copy of ``name`` from ``array`` and write it down into the 16-bit
        parameter (a checkpoint restores ``params``, the masters, through this too)."""
        m = self._by_name[name]
        m.data[...] = array
        m.write_down()

    def full_state(self) -> dict:
        return self.inner.full_state()

    def set_slot(self, name: str, slot: str, array) -> None:
        self.inner.set_slot(name, slot, array)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def optimizer(cfg, params, make):
    """The run's optimizer over ``params``: ``make(params)``, or with a 16-bit precision
    ``make`` over their master copies (:class:`MasterCopy`)."""
    fmt = format_of(cfg)
    if fmt is None:
        return make(params)
    return MasterCopy(params, make, backend.dtype_of(fmt.compute))


class LossScaler:
    """Dynamic loss scaling as torch's ``GradScaler`` defines it.

    ``scale`` (initially ``init``) multiplies the loss gradient. :meth:`update` after each
    step with ``found_inf`` (any non-finite gradient on any rank): True multiplies the scale by
    ``backoff`` and resets the count of good steps; False counts one, and at ``interval`` the
    scale is multiplied by ``growth`` and the count reset. The scale and the count are kept in
    ``state`` (the optimizer's state dict, under ``loss_scale`` and ``loss_scale_good_steps``),
    read each time, so a restored checkpoint brings them back.
    """

    def __init__(self, holder, init=2.0 ** 16, growth=2.0, backoff=0.5, interval=2000):
        if not (init > 0 and growth > 1 and 0 < backoff < 1 and interval >= 1):
            raise ValueError(f"loss scale: init {init} > 0, growth {growth} > 1, 0 < backoff "
                             f"{backoff} < 1 and interval {interval} >= 1 needed")
        self.holder, self.init = holder, float(init)
        self.growth, self.backoff, self.interval = float(growth), float(backoff), int(interval)
        self.skipped = 0                 # steps this process skipped (the run's result line)

    @property
    def scale(self) -> float:
        return float(self.holder.state.get("loss_scale", self.init))

    @property
    def good_steps(self) -> int:
        return int(self.holder.state.get("loss_scale_good_steps", 0))

    def update(self, found_inf: bool) -> None:
        """The scale and count after a step that found (or did not find) a non-finite
        gradient."""
        scale, good = self.scale, self.good_steps + 1
        if found_inf:
            scale, good = scale * self.backoff, 0
            self.skipped += 1
        elif good == self.interval:
            scale, good = scale * self.growth, 0
        self.holder.state["loss_scale"] = scale
        self.holder.state["loss_scale_good_steps"] = good


def attach(cfg, engine, opt) -> LossScaler | None:
    """Set the data-parallel ``engine``'s numerics for the run's precision (fp16: no error on a
    non-finite gradient, the scaler skips the step; ``--grad_reduce_dtype=param``: buckets
    reduced in the 16-bit storage dtype); returns the run's :class:`LossScaler` (its numbers in
    ``opt``'s state), or None without scaling (fp32, bf16)."""
    fmt = format_of(cfg)
    if fmt is None:
        return None
    narrow = backend.dtype_of(fmt.storage) if cfg.grad_reduce_dtype == "param" else None
    engine.numerics(check_finite=not fmt.scaled, reduce_dtype=narrow)
    if not fmt.scaled:
        return None
    return LossScaler(opt, cfg.loss_scale_init, cfg.loss_scale_growth, cfg.loss_scale_backoff,
                      cfg.loss_scale_growth_interval)


def found_non_finite(params) -> bool:
    """Whether any of the gradients of ``params`` holds an inf or a NaN (one BLAS pass each;
    an element-wise test only where a sum of squares is not finite)."""
    for p in params:
        g = p.grad.reshape(-1)
        if not backend.finite(g, backend.square_sum(g)):
            return True
    return False


def unscale(params, scale: float) -> None:
    """Every gradient of ``params`` multiplied by 1/``scale`` (exact for a power of two)."""
    inv = 1.0 / scale
    for p in params:
        p.grad *= inv
