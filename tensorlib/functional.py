"""Neural-network functions (``import tensorlib.functional as F``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _autocast
from . import _ops_elementwise as _ew
from . import _ops_linalg as _la
from . import _ops_nn as _nn
from ._ops_elementwise import relu_backward
from ._ops_linalg import linear_backward, linear_forward
from ._ops_nn import cross_entropy_forward, cross_entropy_grad, cross_entropy_targets
from ._random import Generator, default_generator
from ._tensor import Tensor

# linear_forward, linear_backward, relu_backward and cross_entropy_*: the array functions
# (NumPy or CuPy arrays in and out, no autodiff) that Linear, relu and cross_entropy run,
# public so that a device kind fusing those ops (remote's server) runs the very same code
# and gets the same bits.
__all__ = [
    "check_indices",
    "cross_entropy",
    "cross_entropy_forward",
    "cross_entropy_grad",
    "cross_entropy_targets",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "linear_backward",
    "linear_forward",
    "log_softmax",
    "mse_loss",
    "relu",
    "relu_backward",
    "sigmoid",
    "softmax",
    "tanh",
]

_REDUCTIONS = ("mean", "sum", "none")

# TENSORLIB_CHECK_INDICES=1: GPU index checks in flight (event, pinned count, message).
_CHECK_ENV = "TENSORLIB_CHECK_INDICES"
_device_checks: list[tuple[Any, Any, Any, str]] = []


def _check_on_device(mask: Callable[[], Any], like: Tensor, message: str) -> None:
    """With TENSORLIB_CHECK_INDICES=1 on a GPU: count the bad indices (``mask()``, built only
    then: elsewhere it would cost ops every step for nothing) on the GPU and copy the count to
    pinned memory without waiting (CuPy wraps out-of-range indices instead of raising); raise
    for an earlier check whose count has arrived (see :func:`check_indices`)."""
    if like.device.type != "cuda" or os.environ.get(_CHECK_ENV, "") != "1":
        return
    cp = like.device.xp
    with like.device:  # the mask too: on like's GPU, whichever is current
        bad = mask()
        count = bad.astype(cp.int64).sum().reshape(1)
        mem = cp.cuda.alloc_pinned_memory(8)
        host = np.frombuffer(mem, dtype=np.int64, count=1)
        count.get(out=host, blocking=False)  # asynchronous into pinned memory
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record()
    _device_checks.append((ev, host, mem, message))
    _raise_arrived(wait=False)


def _raise_arrived(wait: bool) -> None:
    while _device_checks and (wait or _device_checks[0][0].done):
        ev, host, _mem, message = _device_checks.pop(0)
        if wait:
            ev.synchronize()
        if host[0]:
            _device_checks.clear()
            raise IndexError(
                f"{message} ({int(host[0])} index(es), found by {_CHECK_ENV}=1 on the GPU after "
                "the call: CuPy wraps such indices around, so the results since are wrong)"
            )


def check_indices() -> None:
    """Wait for the GPU index checks still in flight (``TENSORLIB_CHECK_INDICES=1``) and raise
    ``IndexError`` if one found an index out of range. Without the variable, a no-op.

    Raises:
        IndexError: an embedding index or cross-entropy target was out of range on a GPU.
    """
    _raise_arrived(wait=True)


def relu(x: Tensor) -> Tensor:
    """max(x, 0)."""
    return _ew.Relu.apply(x)


def gelu(x: Tensor, approximate: str = "tanh") -> Tensor:
    """GELU, tanh approximation (as GPT-2 and ``torch.nn.functional.gelu(approximate='tanh')``).

    Args:
        x: the input.
        approximate: only ``"tanh"``, tensorlib's one form (torch's default, ``"none"``, is
            the exact erf form, which differs by up to 5e-4; it is not implemented).

    Raises:
        ValueError: for any other ``approximate``.
    """
    _check_gelu(approximate)
    return _ew.Gelu.apply(x)


def _check_gelu(approximate: str) -> None:
    if approximate != "tanh":
        raise ValueError(
            f"gelu: approximate={approximate!r} is not supported; tensorlib implements the tanh "
            f"approximation only (approximate='tanh'; torch's default 'none' is the exact erf "
            f"form, within 5e-4 of it)"
        )


def sigmoid(x: Tensor) -> Tensor:
    """Logistic sigmoid, stable for large |x|."""
    return _ew.Sigmoid.apply(x)


def tanh(x: Tensor) -> Tensor:
    """Hyperbolic tangent."""
    return _ew.Tanh.apply(x)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """Softmax along ``axis`` (max-shifted, so it never overflows)."""
    return _nn.Softmax.apply(x, axis=axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    """log(softmax(x)) computed stably along ``axis``."""
    return _nn.LogSoftmax.apply(x, axis=axis)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` with weight of shape (out_features, in_features)."""
    if bias is None:
        return _la.Linear.apply(x, weight)
    return _la.Linear.apply(x, weight, bias)


def _check_reduction(fn: str, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def cross_entropy(
    logits: Tensor,
    target: Tensor | Any,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross-entropy between logits and integer class targets (torch's semantics).

    Args:
        logits: unnormalized scores of shape (N, C), (C,) (one sample), or (N, C, d1, ...)
            (a class score per position, as for segmentation or a (batch, vocab, time) layout).
        target: class indices in [0, C) of shape (N,), (), or (N, d1, ...);
            ``ignore_index`` entries are skipped.
        reduction: ``"mean"`` (over targets not ignored), ``"sum"`` or ``"none"`` (a loss per
            target, shaped like ``target``).
        ignore_index: target value that contributes neither loss nor gradient.
        label_smoothing: s in [0, 1]: the target becomes ``(1 - s) * onehot + s / C``.

    Raises:
        ValueError: on shape mismatches, ``label_smoothing`` outside [0, 1], or (on the CPU)
            targets out of range. On a GPU such targets are wrapped around, as CuPy does,
            unless ``TENSORLIB_CHECK_INDICES=1`` (see :func:`check_indices`).
        TypeError: when targets are not integers.
    """
    _check_reduction("cross_entropy", reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    t = target._data if isinstance(target, Tensor) else target
    if not isinstance(logits, Tensor):
        raise TypeError(f"cross_entropy: logits must be a Tensor, got {type(logits).__name__}")
    if logits.ndim == 0:
        raise ValueError("cross_entropy: logits must have shape (N, C), (C,) or (N, C, d1, ...)")
    if not hasattr(t, "dtype"):
        t = np.asarray(t)
    if t.dtype.kind not in "iu":
        raise TypeError(
            f"cross_entropy: target must hold integer class indices, got dtype {t.dtype}"
        )
    c = logits.shape[0] if logits.ndim == 1 else logits.shape[1]
    want = () if logits.ndim == 1 else (logits.shape[0], *logits.shape[2:])
    if tuple(t.shape) != want:
        raise ValueError(
            f"cross_entropy: target must have shape {want} to match logits {logits.shape}, "
            f"got {tuple(t.shape)} (logits (N, C) take targets (N,); (C,) a 0-d target; "
            f"(N, C, d1, ...) targets (N, d1, ...))"
        )
    if isinstance(t, np.ndarray) and t.size:
        # Range check on the CPU only: on a GPU it would force a host sync every step.
        bad = ((t < 0) | (t >= c)) & (t != ignore_index)
        if bad.any():
            first = int(t[bad][0])
            raise ValueError(f"cross_entropy: target {first} is out of range for {c} classes")
    t = _on_device(t, logits, "cross_entropy", "target")
    if not isinstance(t, np.ndarray) and t.size:
        _check_on_device(
            lambda: ((t < 0) | (t >= c)) & (t != ignore_index),
            logits,
            f"cross_entropy: a target is out of range for {c} classes",
        )
    flat = logits
    if logits.ndim == 1:
        flat = logits.reshape(1, c)
    elif logits.ndim > 2:  # (N, C, d...) -> (N * d..., C): the class axis last, then rows
        flat = logits.transpose((0, *range(2, logits.ndim), 1)).reshape(-1, c)
    loss = _nn.CrossEntropy.apply(
        flat,
        t if t.ndim == 1 else t.reshape(-1),  # (a remote reshape is a record of its own)
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=float(label_smoothing),
    )
    return loss.reshape(want) if reduction == "none" and logits.ndim != 2 else loss


def _on_device(arr: Any, like: Tensor, fn: str, what: str) -> Any:
    """Copy a host index array to ``like``'s GPU; refuse GPU indices for CPU tensors."""
    if isinstance(arr, np.ndarray):
        if like.device.type == "cpu":
            return arr
        with like.device:  # Why: asarray copies to the *current* GPU, maybe not like's
            return like.device.xp.asarray(arr)
    if like.device.type == "cpu":
        raise ValueError(f"{fn}: {what} is on a GPU but the tensor is on the CPU")
    return arr


def mse_loss(input: Tensor, target: Tensor | Any, reduction: str = "mean") -> Tensor:
    """Mean squared error (``reduction`` mean, sum or none)."""
    _check_reduction("mse_loss", reduction)
    tshape = tuple(getattr(target, "shape", ()))
    if tshape and tshape != tuple(input.shape):
        raise ValueError(
            f"mse_loss: input shape {tuple(input.shape)} and target shape {tshape} differ"
        )
    if isinstance(target, np.ndarray):
        # Why: a NumPy target (as from a data loader) worked on the CPU only; a GPU input met
        # it inside CuPy ("Unsupported type numpy.ndarray"). cross_entropy moves it too.
        target = _on_device(target, input, "mse_loss", "target")
    if _autocast.active:  # mse_loss is on torch's float32 autocast list (it is no one Function)
        input, target = _autocast.cast_args("float32", (input, target))
    d = input - target
    sq = d * d
    if reduction == "mean":
        return sq.mean()
    if reduction == "sum":
        return sq.sum()
    return sq


def dropout(
    x: Tensor, p: float = 0.5, training: bool = True, generator: Generator | None = None
) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p) when training."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    gen = generator if generator is not None else default_generator
    if p == 1.0:
        return x * 0.0
    keep = gen.random(x.shape, x.dtype, x.device) >= p
    mask = keep.astype(x.dtype) * (1.0 / (1.0 - p))
    return _ew.Mul.apply(x, mask)


def layer_norm(
    x: Tensor,
    normalized_shape: tuple[int, ...] | int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Normalize over the trailing ``normalized_shape`` axes, then apply weight and bias."""
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.ndim - len(ns) :]) != ns or len(ns) > x.ndim:
        raise ValueError(
            f"layer_norm: input of shape {x.shape} does not end with normalized_shape {ns}"
        )
    return _nn.LayerNormFn.apply(x, weight, bias, ndims=len(ns), eps=eps)


def _padding_index(padding_idx: int | None, num: int, who: str) -> int | None:
    """``padding_idx`` checked against ``num`` embeddings, negative values counted from the end.

    Raises:
        ValueError: outside ``[-num, num)``.
    """
    if padding_idx is None:
        return None
    if not -num <= padding_idx < num:
        raise ValueError(
            f"{who}: padding_idx must be in [-{num}, {num}) for {num} embeddings, got {padding_idx}"
        )
    return padding_idx % num


def embedding(indices: Tensor | Any, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """Rows of ``weight`` picked by integer ``indices`` (any shape); gradients add up.

    Args:
        indices: integer indices in [0, num_embeddings), any shape.
        weight: the (num_embeddings, embedding_dim) table.
        padding_idx: a row that receives no gradient (negative counts from the end), as in
            ``torch.nn.functional.embedding``.

    Raises:
        TypeError: when the indices are not integers.
        IndexError: (on the CPU) for indices out of range; on a GPU CuPy wraps them around,
            unless ``TENSORLIB_CHECK_INDICES=1`` (see :func:`check_indices`).
        ValueError: for a ``padding_idx`` out of range.
    """
    idx = indices._data if isinstance(indices, Tensor) else indices
    if not hasattr(idx, "dtype"):
        idx = np.asarray(idx)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"embedding: indices must be integers, got dtype {idx.dtype}")
    num = weight.shape[0]
    if isinstance(idx, np.ndarray) and idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= num:
            bad = lo if lo < 0 else hi
            raise IndexError(f"embedding: index {bad} is out of range for {num} embeddings")
    padding_idx = _padding_index(padding_idx, num, "embedding")
    if not isinstance(idx, np.ndarray) and idx.size:
        _check_on_device(
            lambda: (idx < 0) | (idx >= num),
            weight,
            f"embedding: an index is out of range for {num} embeddings",
        )
    return _nn.Embedding.apply(
        weight, index=_on_device(idx, weight, "embedding", "indices"), padding_idx=padding_idx
    )
