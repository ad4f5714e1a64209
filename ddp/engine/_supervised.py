"""``create_supervised_trainer`` / ``create_supervised_evaluator``: Ignite's two engines.

The trainer's step is Ignite's ``supervised_training_step`` (zero_grad, forward, loss,
backward, step, with gradient accumulation and tensorlib's autocast/GradScaler for
``amp_mode="amp"``); under DDP the backward of an accumulation step that does not end with an
optimizer step runs in ``model.no_sync()``, so gradients are all-reduced once per step, not
once per micro-batch (Ignite leaves that to the user). The evaluator runs the model under
``no_grad`` and returns ``(y_pred, y)`` for metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import tensorlib as tl
from tensorlib.amp import GradScaler

from ._engine import Engine

__all__ = [
    "create_supervised_evaluator",
    "create_supervised_trainer",
    "supervised_evaluation_step",
    "supervised_training_step",
]


def _prepare_batch(
    batch: Sequence[Any], device: Any = None, non_blocking: bool = False
) -> tuple[Any, Any]:
    """``(x, y)`` from a batch, moved to ``device`` when one is given (Ignite's default)."""
    if not isinstance(batch, Sequence) or len(batch) != 2:
        raise ValueError(
            "prepare_batch: the default expects batches of (x, y); got "
            f"{type(batch).__name__}"
            f"{f' of length {len(batch)}' if isinstance(batch, Sequence) else ''}"
            "; pass prepare_batch=... for another layout"
        )
    x, y = batch
    if device is not None:
        x, y = (t.to(device) if isinstance(t, tl.Tensor) else t for t in (x, y))
    return x, y


def _loss_item(x: Any, y: Any, y_pred: Any, loss: Any) -> Any:
    return loss.item()


def _pred_and_target(x: Any, y: Any, y_pred: Any) -> tuple[Any, Any]:
    return y_pred, y


def _check_amp(amp_mode: str | None, scaler: bool | GradScaler) -> GradScaler | None:
    if amp_mode not in (None, "amp"):
        raise ValueError(
            f"create_supervised_trainer: amp_mode must be None or 'amp' (tensorlib's autocast), "
            f"got {amp_mode!r}; 'apex' has no counterpart here"
        )
    if scaler is False or scaler is None:
        return None
    if amp_mode != "amp":
        raise ValueError("create_supervised_trainer: scaler needs amp_mode='amp'")
    return GradScaler() if scaler is True else scaler


def supervised_training_step(
    model: Any,
    optimizer: Any,
    loss_fn: Callable[[Any, Any], Any],
    device: Any = None,
    non_blocking: bool = False,
    prepare_batch: Callable[..., tuple[Any, Any]] = _prepare_batch,
    model_transform: Callable[[Any], Any] = lambda output: output,
    output_transform: Callable[..., Any] = _loss_item,
    gradient_accumulation_steps: int = 1,
    amp_mode: str | None = None,
    scaler: bool | GradScaler = False,
    model_fn: Callable[[Any, Any], Any] = lambda model, x: model(x),
) -> Callable[[Engine, Any], Any]:
    """The trainer's process function: one optimizer step every
    ``gradient_accumulation_steps`` batches.

    Raises:
        ValueError: for ``gradient_accumulation_steps`` < 1 or an unknown ``amp_mode``.
    """
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ValueError(
            "Gradient_accumulation_steps must be strictly positive. No gradient accumulation "
            f"if the value set to one (default), got {gradient_accumulation_steps!r}"
        )
    grad_scaler = _check_amp(amp_mode, scaler)
    steps = gradient_accumulation_steps
    no_sync = getattr(model, "no_sync", None)

    def update(engine: Engine, batch: Any) -> Any:
        it = engine.state.iteration
        if (it - 1) % steps == 0:
            optimizer.zero_grad()
        model.train()
        x, y = prepare_batch(batch, device=device, non_blocking=non_blocking)
        with tl.autocast() if amp_mode == "amp" else contextlib.nullcontext():
            output = model_fn(model, x)
            y_pred = model_transform(output)
            loss = loss_fn(y_pred, y)
        if steps > 1:
            loss = loss / steps
        stepping = it % steps == 0
        # DDP all-reduces in backward: only the last micro-batch of a step needs it.
        with no_sync() if no_sync is not None and not stepping else contextlib.nullcontext():
            (grad_scaler.scale(loss) if grad_scaler is not None else loss).backward()
        if stepping:
            if grad_scaler is not None:
                grad_scaler.step(optimizer)
                grad_scaler.update()
            else:
                optimizer.step()
        return output_transform(x, y, y_pred, loss * steps if steps > 1 else loss)

    return update


def create_supervised_trainer(
    model: Any,
    optimizer: Any,
    loss_fn: Callable[[Any, Any], Any],
    device: Any = None,
    non_blocking: bool = False,
    prepare_batch: Callable[..., tuple[Any, Any]] = _prepare_batch,
    model_transform: Callable[[Any], Any] = lambda output: output,
    output_transform: Callable[..., Any] = _loss_item,
    deterministic: bool = False,
    amp_mode: str | None = None,
    scaler: bool | GradScaler = False,
    gradient_accumulation_steps: int = 1,
    model_fn: Callable[[Any, Any], Any] = lambda model, x: model(x),
) -> Engine:
    """An engine that trains ``model`` with ``optimizer`` on ``loss_fn(model(x), y)``.

    Args:
        model: a tensorlib Module (DDP-wrapped or not).
        optimizer: its optimizer.
        loss_fn: ``(y_pred, y) -> loss`` Tensor.
        device: move x and y there (default: leave them where the loader put them).
        non_blocking: accepted for Ignite's signature; copies here are what the device does.
        prepare_batch: ``(batch, device, non_blocking) -> (x, y)``.
        model_transform: output of the model -> ``y_pred``.
        output_transform: ``(x, y, y_pred, loss) -> state.output`` (default ``loss.item()``).
        deterministic: accepted for Ignite's signature; ``run(..., seed=)`` gives
            reproducible runs here (see ``Engine``).
        amp_mode: None, or ``"amp"`` for tensorlib's autocast around forward and loss.
        scaler: with ``amp_mode="amp"``: True for a new ``GradScaler``, or one's own.
        gradient_accumulation_steps: batches per optimizer step (the loss is divided by it).
        model_fn: ``(model, x) -> output``.

    Returns:
        The trainer ``Engine``.

    Raises:
        ValueError: for bad ``amp_mode``/``scaler`` or accumulation steps.
    """
    step = supervised_training_step(
        model, optimizer, loss_fn, device, non_blocking, prepare_batch, model_transform,
        output_transform, gradient_accumulation_steps, amp_mode, scaler, model_fn,
    )  # fmt: skip
    trainer = Engine(step)
    grad_scaler = _check_amp(amp_mode, scaler)
    if grad_scaler is not None:
        trainer.state.scaler = grad_scaler  # type: ignore[attr-defined]
    return trainer


def supervised_evaluation_step(
    model: Any,
    device: Any = None,
    non_blocking: bool = False,
    prepare_batch: Callable[..., tuple[Any, Any]] = _prepare_batch,
    model_transform: Callable[[Any], Any] = lambda output: output,
    output_transform: Callable[..., Any] = _pred_and_target,
    amp_mode: str | None = None,
    model_fn: Callable[[Any, Any], Any] = lambda model, x: model(x),
) -> Callable[[Engine, Any], Any]:
    """The evaluator's process function: the model in eval mode, under ``no_grad``."""
    _check_amp(amp_mode, False)

    def evaluate(engine: Engine, batch: Any) -> Any:
        model.eval()
        with tl.no_grad():
            x, y = prepare_batch(batch, device=device, non_blocking=non_blocking)
            with tl.autocast() if amp_mode == "amp" else contextlib.nullcontext():
                y_pred = model_transform(model_fn(model, x))
        return output_transform(x, y, y_pred)

    return evaluate


def create_supervised_evaluator(
    model: Any,
    metrics: dict[str, Any] | None = None,
    device: Any = None,
    non_blocking: bool = False,
    prepare_batch: Callable[..., tuple[Any, Any]] = _prepare_batch,
    model_transform: Callable[[Any], Any] = lambda output: output,
    output_transform: Callable[..., Any] = _pred_and_target,
    amp_mode: str | None = None,
    model_fn: Callable[[Any, Any], Any] = lambda model, x: model(x),
) -> Engine:
    """An engine that runs ``model`` over data without gradients and computes ``metrics``.

    Args:
        model: a tensorlib Module (DDP-wrapped or not).
        metrics: name -> ``ddp.metrics.Metric``; attached, results in ``state.metrics``.
        device: move x and y there.
        non_blocking: accepted for Ignite's signature.
        prepare_batch: ``(batch, device, non_blocking) -> (x, y)``.
        model_transform: output of the model -> ``y_pred``.
        output_transform: ``(x, y, y_pred) -> state.output`` (default ``(y_pred, y)``).
        amp_mode: None, or ``"amp"`` for autocast.
        model_fn: ``(model, x) -> output``.

    Returns:
        The evaluator ``Engine``.
    """
    step = supervised_evaluation_step(
        model, device, non_blocking, prepare_batch, model_transform, output_transform,
        amp_mode, model_fn,
    )  # fmt: skip
    evaluator = Engine(step)
    for name, metric in (metrics or {}).items():
        metric.attach(evaluator, name)
    return evaluator
