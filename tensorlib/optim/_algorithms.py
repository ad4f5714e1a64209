"""SGD, Adam and AdamW with PyTorch's update rules, computed in place on the arrays."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .._autograd import no_grad
from ._optimizer import _REQUIRED, Optimizer

__all__ = ["SGD", "Adam", "AdamW"]


def _check(name: str, value: float, low: float = 0.0) -> None:
    if not value >= low:
        raise ValueError(f"invalid {name}: {value} (must be >= {low})")


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay.

    Same rule as ``torch.optim.SGD``: ``g += wd * p``; ``buf = momentum * buf + (1 - dampening)
    * g`` (``buf = g`` on the first step); ``g = g + momentum * buf`` (Nesterov) or ``buf``;
    ``p -= lr * g``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _REQUIRED,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if lr is not _REQUIRED:
            _check("lr", lr)
        _check("momentum", momentum)
        _check("weight_decay", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0")
        super().__init__(
            params,
            {
                "lr": lr,
                "momentum": momentum,
                "dampening": dampening,
                "weight_decay": weight_decay,
                "nesterov": nesterov,
            },
        )

    @no_grad()
    def step(self) -> None:
        """Apply one update to every parameter that has a gradient."""
        for group in self.param_groups:
            lr, mom, damp = group["lr"], group["momentum"], group["dampening"]
            wd, nesterov = group["weight_decay"], group["nesterov"]
            for p in group["params"]:
                if p._grad is None:
                    continue
                g = p._grad._data
                if wd:
                    g = g + wd * p._data
                if mom:
                    state = self.state.setdefault(p, {})
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = g.copy()
                        state["momentum_buffer"] = buf
                    else:
                        buf *= mom
                        buf += (1 - damp) * g if damp else g
                    g = g + mom * buf if nesterov else buf
                if lr == 1:
                    p._data -= g
                else:
                    p._data -= lr * g


class Adam(Optimizer):
    """Adam (``torch.optim.Adam`` rule), with optional L2 ``weight_decay`` added to the grad."""

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        _check("lr", lr)
        _check("eps", eps)
        _check("weight_decay", weight_decay)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        super().__init__(
            params, {"lr": lr, "betas": (b1, b2), "eps": eps, "weight_decay": weight_decay}
        )

    @no_grad()
    def step(self) -> None:
        """Apply one update to every parameter that has a gradient."""
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p._grad is None:
                    continue
                g = p._grad._data
                xp_data = p._data
                if wd:
                    if self._decoupled:
                        xp_data *= 1 - lr * wd
                    else:
                        g = g + wd * xp_data
                state = self.state.get(p)
                if state is None:
                    state = {"step": 0, "exp_avg": g * 0, "exp_avg_sq": g * 0}
                    self.state[p] = state
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m *= b1
                m += (1 - b1) * g
                v *= b2
                v += (1 - b2) * (g * g)
                bc1 = 1 - b1**t
                bc2 = 1 - b2**t
                denom = (v**0.5) * (1 / math.sqrt(bc2))
                denom += eps
                xp_data -= (lr / bc1) * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (``torch.optim.AdamW`` rule; default decay 0.01)."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
