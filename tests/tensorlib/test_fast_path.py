"""The arithmetic operators' shorter path (``_autograd.binary``) and the engine's shortcuts
give exactly what the general path (``Function.apply``, ``Function.release``) gives.

The operators take the shorter path for tensors of one floating dtype on one device and for
Python numbers, and fall back to ``apply`` for everything else; each case below is computed
both ways and compared: values, dtype, device, whether a graph was recorded, the node's type,
the gradients, and the error messages.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import Function, Tensor
from tensorlib import _ops_elementwise as ew
from tests.helpers import DEVICES

OPS: list[tuple[Callable[[Any, Any], Any], type[Function]]] = [
    (operator.add, ew.Add),
    (operator.sub, ew.Sub),
    (operator.mul, ew.Mul),
    (operator.truediv, ew.Div),
    (operator.pow, ew.Pow),
]


def _operand(kind: str, device: str) -> Any:
    """One operand of the kind named: a tensor (dtype, requires_grad) or a constant."""
    if kind == "float":
        return 1.5
    if kind == "int":
        return 2
    if kind == "True":
        return True
    if kind == "np.float64":
        return np.float64(0.5)
    dtype, _, grad = kind.partition("+")
    values = np.array([1.5, 2.25, 3.0], dtype=dtype)
    return tl.tensor(values, device=device, requires_grad=grad == "grad")


def _run(
    f: Callable[[], Tensor], leaves: list[Tensor]
) -> tuple[np.ndarray[Any, Any], Any, Any, bool, type | None, list[Any]]:
    """The result of ``f()`` as everything a user can see, and each leaf's gradient."""
    for t in leaves:
        t.grad = None
    out = f()
    grads: list[Any] = []
    if out.requires_grad:
        out.sum().backward()
        grads = [None if t.grad is None else t.grad.numpy().copy() for t in leaves]
    return (
        out.numpy(),
        out.dtype,
        out.device,
        out.requires_grad,
        None if out.grad_fn is None else type(out.grad_fn),
        grads,
    )


def _same(fast: tuple[Any, ...], general: tuple[Any, ...]) -> None:
    np.testing.assert_array_equal(fast[0], general[0])
    assert fast[1:5] == general[1:5]
    assert len(fast[5]) == len(general[5])
    for a, b in zip(fast[5], general[5], strict=True):
        if a is None or b is None:
            assert a is b
        else:
            np.testing.assert_array_equal(a, b)


TENSORS = ["float32", "float32+grad", "float64+grad", "float16", "int64", "int32", "bool"]
CONSTANTS = ["float", "int", "True", "np.float64"]
PAIRS = (
    [(a, b) for a in TENSORS for b in TENSORS]
    + [(a, c) for a in TENSORS for c in CONSTANTS]
    + [(c, a) for a in TENSORS for c in CONSTANTS]
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,cls", OPS, ids=[c.__name__ for _, c in OPS])
@pytest.mark.parametrize("left,right", PAIRS)
def test_operator_equals_apply(
    op: Callable[[Any, Any], Any], cls: type[Function], left: str, right: str, device: str
) -> None:
    a, b = _operand(left, device), _operand(right, device)
    leaves = [t for t in (a, b) if isinstance(t, Tensor) and t.requires_grad]
    try:
        general = _run(lambda: cls.apply(a, b), leaves)
    except Exception as exc:  # the operator must fail alike
        with pytest.raises(type(exc)) as info:
            op(a, b)
        assert str(info.value) == str(exc)
        return
    _same(_run(lambda: op(a, b), leaves), general)


@pytest.mark.parametrize("op,cls", OPS, ids=[c.__name__ for _, c in OPS])
def test_operator_under_no_grad_and_autocast_equals_apply(
    op: Callable[[Any, Any], Any], cls: type[Function]
) -> None:
    a = _operand("float32+grad", "cpu")
    b = _operand("float32", "cpu")
    with tl.no_grad():
        fast, general = op(a, b), cls.apply(a, b)
    assert not fast.requires_grad and fast.grad_fn is None
    np.testing.assert_array_equal(fast.numpy(), general.numpy())
    with tl.autocast(dtype=tl.float16):  # Pow runs in float32 there, the others as they are
        _same(_run(lambda: op(a, b), [a]), _run(lambda: cls.apply(a, b), [a]))


@pytest.mark.parametrize("op,cls", OPS, ids=[c.__name__ for _, c in OPS])
def test_operator_error_messages_equal_apply(
    op: Callable[[Any, Any], Any], cls: type[Function]
) -> None:
    a = tl.ones(3, requires_grad=True)
    b = tl.ones(4)
    with pytest.raises(ValueError) as general:
        cls.apply(a, b)
    with pytest.raises(ValueError) as fast:
        op(a, b)
    assert str(fast.value) == str(general.value)
    message = str(fast.value)
    assert message.startswith(f"{cls.__name__}: ") and "(3,) float32, (4,) float32" in message


def test_a_node_that_saves_nothing_is_freed_after_backward() -> None:
    x = tl.ones(3, requires_grad=True)
    y = (x + 1.0) - x  # Add and Sub save nothing: the engine frees them without release()
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    z = (x + 1.0) - x
    z.sum().backward(retain_graph=True)
    z.sum().backward()  # retained: a second backward accumulates
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [0.0, 0.0, 0.0])


def test_a_custom_release_still_runs() -> None:
    released: list[str] = []

    class Twice(Function):
        __slots__ = ()

        def forward(self, a: Any) -> Any:
            return a * 2

        def backward(self, g: Any) -> Any:
            return g * 2

        def release(self) -> None:
            released.append("Twice")
            super().release()

    x = tl.ones(2, requires_grad=True)
    Twice.apply(x).sum().backward()
    assert released == ["Twice"]
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 2.0])


def test_a_tensor_used_twice_gets_both_gradients_and_one_hook_call() -> None:
    x = tl.tensor([1.0, 2.0], requires_grad=True)
    calls: list[np.ndarray[Any, Any]] = []

    def hook(t: Tensor) -> None:
        assert t.grad is not None
        calls.append(t.grad.numpy().copy())

    x.register_post_accumulate_grad_hook(hook)
    (x * x + x).sum().backward()
    np.testing.assert_array_equal(_only(calls), [3.0, 5.0])


def _only(calls: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    assert len(calls) == 1, f"expected one hook call, got {len(calls)}"
    return calls[0]
