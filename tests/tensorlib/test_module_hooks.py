"""Module forward hooks (PyTorch's ``register_forward_pre_hook`` / ``register_forward_hook``):
what ``ddp.fully_shard`` builds on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import Tensor, nn


def test_pre_hook_replaces_args_and_post_hook_replaces_output_in_order() -> None:
    layer = nn.Linear(3, 2, dtype="float64", generator=tl.Generator(0))
    x = tl.tensor(np.ones((1, 3)))
    calls: list[str] = []

    def double_input(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        calls.append("pre")
        return (args[0] * 2.0,)

    def plus_one(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
        calls.append("post")
        assert mod is layer and args[0].numpy()[0, 0] == 2.0  # the replaced args
        return out + 1.0

    def watch(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        calls.append("watch")  # returns None: the output stays

    h1 = layer.register_forward_pre_hook(double_input)
    h2 = layer.register_forward_hook(plus_one)
    layer.register_forward_hook(watch)
    expected = layer.forward(x * 2.0).numpy() + 1.0
    np.testing.assert_array_equal(layer(x).numpy(), expected)
    assert calls == ["pre", "post", "watch"]
    h1.remove()
    h2.remove()
    h2.remove()  # idempotent
    np.testing.assert_array_equal(layer(x).numpy(), layer.forward(x).numpy())
    assert calls[3:] == ["watch"]


def test_hooks_see_keyword_arguments_pass_through_and_gradients_flow() -> None:
    seen: list[tuple[Any, ...]] = []

    class Scale(nn.Module):
        def forward(self, x: Tensor, factor: float = 1.0) -> Tensor:
            return x * factor

    m = Scale()
    m.register_forward_pre_hook(lambda mod, args: seen.append(args))
    x = tl.tensor(np.array([1.0, 2.0]), requires_grad=True)
    m(x, factor=3.0).sum().backward()
    assert len(seen) == 1 and seen[0][0] is x  # positional only, as in PyTorch
    np.testing.assert_array_equal(x.grad.numpy(), [3.0, 3.0])


def test_a_non_callable_hook_is_refused() -> None:
    with pytest.raises(TypeError, match="must be callable"):
        nn.ReLU().register_forward_hook(3)  # type: ignore[arg-type]
