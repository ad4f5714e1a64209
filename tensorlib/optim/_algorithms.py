"""SGD, Adam and AdamW with PyTorch's update rules, computed in place on the arrays.

Each update is written in the order of operations of torch's single-tensor CPU kernels
(``lerp`` for the first moment, ``addcmul``/``addcdiv`` for the rest), so trajectories agree
with torch's to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._autograd import no_grad
from .._device_guard import DeviceGuard
from .._device_kinds import fused_op
from .._ops_elementwise import xp_of
from ._optimizer import Optimizer

__all__ = ["SGD", "Adam", "AdamW", "adam_update"]


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
        with DeviceGuard() as guard:  # each update on its parameter's GPU, whichever is current
            for group in self.param_groups:
                self._step_group(group, guard)

    def _step_group(self, group: dict[str, Any], guard: DeviceGuard) -> None:
        """One group's updates, each with its parameter's GPU made current by ``guard``."""
        lr, mom, damp = group["lr"], group["momentum"], group["dampening"]
        wd, nesterov = group["weight_decay"], group["nesterov"]
        maximize = group.get("maximize", False)
        for p in group["params"]:
            if p._grad is None:
                continue
            guard.use(p._device)
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
        """Apply one update to every parameter that has a gradient.

        A device kind that supplies a fused ``"adam"`` update (``fused_op``; a remote
        device runs it as one record on its server) gets each group's parameters at once;
        it computes exactly :func:`adam_update` per parameter. Elsewhere (cpu, cuda) each
        parameter is updated here, one after the other.
        """
        with DeviceGuard() as guard:  # each update on its parameter's GPU, whichever is current
            for group in self.param_groups:
                params = [p for p in group["params"] if p._grad is not None]
                hyper = self._hyper(group)
                fused = fused_op(params[0]._data, "adam") if params else None
                if fused is not None and all(fused_op(p._data, "adam") is fused for p in params):
                    fused([self._prepare(p, group) for p in params], **hyper)
                    continue
                for p in params:
                    guard.use(p._device)  # the state is made there too (zeros_like)
                    adam_update(*self._prepare(p, group), **hyper)

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        b1, b2 = group["betas"]
        return {
            "lr": group["lr"], "beta1": b1, "beta2": b2, "eps": group["eps"],
            "weight_decay": group["weight_decay"], "decoupled": self._decoupled,
            "maximize": group.get("maximize", False),
        }  # fmt: skip

    def _prepare(self, p: Any, group: dict[str, Any]) -> AdamArrays:
        """``p``'s arrays for :func:`adam_update` (its state made on the first step), and
        the state's step count advanced."""
        data = p._data
        state = self.state.get(p)
        if state is None:
            xp = xp_of(data)
            state = {"step": 0, "exp_avg": xp.zeros_like(data), "exp_avg_sq": xp.zeros_like(data)}
            self.state[p] = state
        vmax = None
        if group.get("amsgrad", False):
            if "max_exp_avg_sq" not in state:
                # a fresh state, or one saved without amsgrad: the running max starts here
                state["max_exp_avg_sq"] = xp_of(data).zeros_like(data)
            vmax = state["max_exp_avg_sq"]
        state["step"] += 1
        return data, p._grad._data, state["exp_avg"], state["exp_avg_sq"], vmax, state["step"]


AdamArrays = tuple[Any, Any, Any, Any, Any, int]


def adam_update(
    data: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Any,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
) -> None:
    """One Adam (``decoupled``: AdamW) update of one parameter, in place on its arrays.

    ``step`` is the update's count from 1 (already advanced); ``max_exp_avg_sq`` is the
    amsgrad running maximum, or None without amsgrad. A fused update that a device kind
    supplies must compute exactly this (the remote server calls it).
    """
    g = -grad if maximize else grad
    xp = xp_of(data)
    if weight_decay:
        if decoupled:
            data *= 1 - lr * weight_decay
        else:
            g = g + weight_decay * data
    b1, b2, t = beta1, beta2, step
    m, v = exp_avg, exp_avg_sq
    _lerp_(m, g, 1 - b1)
    v *= b2
    v += (1 - b2) * g * g
    step_size = lr / (1 - b1**t)
    bc2_sqrt = (1 - b2**t) ** 0.5
    if max_exp_avg_sq is not None:
        v = xp.maximum(max_exp_avg_sq, v, out=max_exp_avg_sq)
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
