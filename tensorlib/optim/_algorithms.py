"""SGD, Adam and AdamW with PyTorch's update rules, computed in place on the arrays.

Each update is written in the order of operations of torch's single-tensor CPU kernels
(``lerp`` for the first moment, ``addcmul``/``addcdiv`` for the rest), so trajectories agree
with torch's to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._autograd import no_grad
from .._ops_elementwise import xp_of
from ._optimizer import Optimizer

__all__ = ["SGD", "Adam", "AdamW"]


def _check(name: str, value: float, low: float = 0.0) -> None:
    if not value >= low:
        raise ValueError(f"invalid {name}: {value} (must be >= {low})")


def _lerp_(start: Any, end: Any, weight: float) -> None:
    """``start += weight * (end - start)`` in place, as torch's ``lerp_`` rounds it.

    torch picks the formula by the weight's size (ATen ``lerp``) so the result is exact at
    both ends; the same choice keeps our moments within an ulp of torch's.
    """
    if abs(weight) < 0.5:
        start += weight * (end - start)
    else:
        diff = end - start
        diff *= 1 - weight
        start[...] = end - diff


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay.

    Same rule as ``torch.optim.SGD``: ``g = -g`` when ``maximize``; ``g += wd * p``;
    ``buf = momentum * buf + (1 - dampening) * g`` (``buf = g`` on the first step);
    ``g = g + momentum * buf`` (Nesterov) or ``buf``; ``p -= lr * g``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
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
                "maximize": maximize,
            },
        )

    @no_grad()
    def step(self) -> None:
        """Apply one update to every parameter that has a gradient."""
        for group in self.param_groups:
            lr, mom, damp = group["lr"], group["momentum"], group["dampening"]
            wd, nesterov = group["weight_decay"], group["nesterov"]
            maximize = group.get("maximize", False)
            for p in group["params"]:
                if p._grad is None:
                    continue
                g = p._grad._data
                if maximize:
                    g = -g
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
    """Adam (``torch.optim.Adam`` rule), with optional L2 ``weight_decay`` added to the grad.

    ``amsgrad=True`` normalizes by the running maximum of the second moment (kept in the
    state as ``max_exp_avg_sq``, bias-corrected like ``exp_avg_sq``); ``maximize=True``
    ascends the gradient.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        _check("lr", lr)
        _check("eps", eps)
        _check("weight_decay", weight_decay)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        super().__init__(
            params,
            {
                "lr": lr,
                "betas": (b1, b2),
                "eps": eps,
                "weight_decay": weight_decay,
                "amsgrad": amsgrad,
                "maximize": maximize,
            },
        )

    @no_grad()
    def step(self) -> None:
        """Apply one update to every parameter that has a gradient."""
        for group in self.param_groups:
            for p in group["params"]:
                if p._grad is not None:
                    self._update(p, group)

    def _update(self, p: Any, group: dict[str, Any]) -> None:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        amsgrad = group.get("amsgrad", False)
        g = p._grad._data
        if group.get("maximize", False):
            g = -g
        data = p._data
        xp = xp_of(data)
        if wd:
            if self._decoupled:
                data *= 1 - lr * wd
            else:
                g = g + wd * data
        state = self.state.get(p)
        if state is None:
            state = {"step": 0, "exp_avg": xp.zeros_like(data), "exp_avg_sq": xp.zeros_like(data)}
            self.state[p] = state
        if amsgrad and "max_exp_avg_sq" not in state:
            # a fresh state, or one saved without amsgrad: the running max starts here
            state["max_exp_avg_sq"] = xp.zeros_like(data)
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        _lerp_(m, g, 1 - b1)
        v *= b2
        v += (1 - b2) * g * g
        step_size = lr / (1 - b1**t)
        bc2_sqrt = (1 - b2**t) ** 0.5
        if amsgrad:
            v = xp.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
        denom = v**0.5
        denom /= bc2_sqrt
        denom += eps
        upd = -step_size * m
        upd /= denom
        data += upd


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
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
        )
