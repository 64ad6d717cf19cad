"""Optimizers (SGD with momentum, AdamW), global-norm clipping, warm-up + cosine schedule.

Optimizer state is a plain dict ``name -> array`` (``"<param name>/momentum"``, ``".../m"``,
``".../v"``, plus ``"step"``), so later layers can shard it across ranks and checkpoint it.
Updates are in place, with the parameters' own dtype.
"""
from __future__ import annotations

import math

from hpcnn import backend


def decays(p) -> bool:
    """Default weight-decay rule: matrices and kernels decay; biases, norms, embeddings' 1-D don't.
    A part of a parameter (a ZeRO segment, a master copy: ``p.full``) decays as the whole."""
    return getattr(p, "full", p).data.ndim >= 2


class Optimizer:
    """Base class: ``step(lr)`` applies one update from ``p.grad`` to ``p.data`` for every param."""

    def __init__(self, params, weight_decay: float = 0.0, decay_filter=decays):
        self.params = list(params)
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"parameter names must be unique; repeated: {dup}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.weight_decay = float(weight_decay)
        self.decay = {p.name: bool(decay_filter(p)) for p in self.params}
        self.state: dict = {"step": 0}
        self._scratch: dict = {}

    def _tmp(self, p):
        """A scratch array shaped like ``p`` (one reused buffer per dtype, not optimizer state)."""
        key = p.data.dtype.str
        buf = self._scratch.get(key)
        if buf is None or buf.size < p.size:
            size = max(q.size for q in self.params)
            buf = self._scratch[key] = backend.xp.empty(size, p.data.dtype)
        return buf[:p.size].reshape(p.data.shape)

    def step(self, lr: float) -> None:
        raise NotImplementedError

    def held_arrays(self) -> list:
        """Every array the optimizer keeps between steps: its state (moments) and scratch."""
        return [v for v in self.state.values() if hasattr(v, "nbytes")] + list(
            self._scratch.values())

    def state_dict(self) -> dict:
        return dict(self.state)

    @property
    def clipped(self) -> list:
        """What gradient clipping scales: the parameters (a ZeRO-2 optimizer: its part of
        them)."""
        return self.params

    def full_state(self) -> dict:
        """The whole state, every slot at its parameter's full shape (here: :attr:`state`; a
        sharded optimizer assembles it over its ranks, collectively)."""
        return self.state

    def set_slot(self, name: str, slot: str, array) -> None:
        """Restore slot ``slot`` (``momentum``, ``m``, ``v``) of parameter ``name`` from its
        whole array (a sharded optimizer keeps its part)."""
        self.state[f"{name}/{slot}"] = array

    def saved_params(self, params) -> list:
        """What a checkpoint saves as the parameters ``params`` (this rank's): themselves (a
        sharded optimizer of 16-bit parameters: their float32 master copies, assembled)."""
        return params

    def set_master(self, name: str, array) -> None:
        """Restore the master copy of parameter ``name`` from its whole array: none here (a
        sharded optimizer of 16-bit parameters keeps its part)."""

    def master_arrays(self) -> list:
        """The float32 master copies this optimizer keeps (mixed precision): none here."""
        return []

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


class SGD(Optimizer):
    """v = mu v + (g + wd p); p -= lr v  (classical momentum, coupled L2 weight decay)."""

    def __init__(self, params, momentum: float = 0.9, weight_decay: float = 0.0, nesterov=False,
                 **kw):
        super().__init__(params, weight_decay, **kw)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)

    def step(self, lr: float) -> None:
        xp = backend.xp
        for p in self.params:
            g, tmp = p.grad, self._tmp(p)
            if self.weight_decay and self.decay[p.name]:
                xp.multiply(p.data, self.weight_decay, out=tmp)
                tmp += g
                g = tmp                                  # g + wd p, in the scratch array
            if self.momentum:
                key = p.name + "/momentum"
                v = self.state.get(key)
                if v is None:
                    v = self.state[key] = xp.zeros_like(p.data)
                v *= self.momentum
                v += g
                if self.nesterov:
                    if g is not tmp:
                        tmp[...] = g
                    backend.axpy(self.momentum, v, tmp)
                    g = tmp                              # g + mu v
                else:
                    g = v
            backend.axpy(-lr, g, p.data)                   # p -= lr * (v, or g + mu v, or g)
        self.state["step"] += 1


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019).

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p -= lr (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps);
    p -= lr wd p (decoupled, applied first).

    The step makes 10 passes over memory per parameter where the formula read literally makes
    13: the moment updates add ``(1-b) x`` with one BLAS axpy each, and the bias corrections
    are folded into two scalars (see :meth:`step`). Tests check it against the formula above.
    """

    def __init__(self, params, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 **kw):
        super().__init__(params, weight_decay, **kw)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        self.b1, self.b2, self.eps = float(b1), float(b2), float(eps)

    def step(self, lr: float) -> None:
        t = self.state["step"] + 1
        c1, c2 = 1.0 - self.b1 ** t, 1.0 - self.b2 ** t
        # lr m_hat / (sqrt(v_hat) + eps) = (lr sqrt(c2) / c1) m / (sqrt(v) + eps sqrt(c2)): the
        # bias corrections move onto two scalars, which saves two passes over v per parameter
        lr_scaled, eps_scaled = lr * math.sqrt(c2) / c1, self.eps * math.sqrt(c2)
        xp = backend.xp
        for p in self.params:
            m = self.state.get(p.name + "/m")
            if m is None:
                m = self.state[p.name + "/m"] = xp.zeros_like(p.data)
                self.state[p.name + "/v"] = xp.zeros_like(p.data)
            v = self.state[p.name + "/v"]
            g, tmp = p.grad, self._tmp(p)
            m *= self.b1
            backend.axpy(1.0 - self.b1, g, m)                  # m = b1 m + (1 - b1) g
            v *= self.b2
            xp.multiply(g, g, out=tmp)
            backend.axpy(1.0 - self.b2, tmp, v)                # v = b2 v + (1 - b2) g^2
            if self.weight_decay and self.decay[p.name]:
                p.data *= 1.0 - lr * self.weight_decay
            xp.sqrt(v, out=tmp)
            tmp += eps_scaled                            # sqrt(v) + eps sqrt(c2)
            xp.divide(m, tmp, out=tmp)
            backend.axpy(-lr_scaled, tmp, p.data)              # p -= lr m_hat / (sqrt(v_hat) + eps)
        self.state["step"] = t


def grad_norm_sq(params) -> float:
    """Sum of squared gradient entries (a float; parallel layers reduce it across ranks),
    summed in float64 on the device and read on the host: one counted transfer on a device."""
    xp = backend.xp
    total = sum(xp.vdot(p.grad.ravel(), p.grad.ravel()).astype("float64") for p in params)
    return float(backend.to_host(total))


def clip_grad_norm(params, max_norm: float, norm_sq: float | None = None) -> float:
    """Scale all gradients so their global L2 norm is at most ``max_norm``; returns the norm.

    ``norm_sq`` may be given when it was reduced elsewhere (sharded gradients).
    """
    total = math.sqrt(grad_norm_sq(params) if norm_sq is None else norm_sq)
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for p in params:
            p.grad *= scale
    return total


def lr_at(step: int, base_lr: float, total_steps: int, warmup: int = 0, min_lr: float = 0.0,
          schedule: str = "cosine") -> float:
    """Learning rate at ``step`` (0-based): linear warm-up, then cosine decay to ``min_lr``.

    ``schedule="constant"`` keeps ``base_lr`` after the warm-up.
    """
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant" or total_steps <= warmup:
        return base_lr
    if schedule != "cosine":
        raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(name: str, params, *, momentum=0.9, weight_decay=0.0, betas=(0.9, 0.999),
                   eps=1e-8) -> Optimizer:
    """``"sgd"`` or ``"adamw"`` by name (the CLI's ``--optimizer``)."""
    if name == "sgd":
        return SGD(params, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return AdamW(params, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r}")
