"""The backward engine: graph walking, gradient accumulation, grad mode, memory and DDP hooks."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import pytest

import tensorlib as tl
from tensorlib import Function, Tensor
from tests.helpers import DEVICES


def _grad(t: Tensor) -> np.ndarray[Any, Any]:
    """The leaf's gradient as a NumPy array (fails the test when there is none)."""
    assert t.grad is not None, "expected a gradient"
    return t.grad.numpy()


def _leaf(values: Any, device: str = "cpu") -> Tensor:
    return tl.tensor(np.asarray(values, dtype=np.float64), device=device, requires_grad=True)


# ============================================================================ graph walking
def test_deep_chain_backward_is_iterative_and_exact() -> None:
    x0 = _leaf(1.0)
    x = x0
    for _ in range(10_000):  # 20,000 nodes: far deeper than Python's recursion limit
        x = x * 1.0001 + 0.0
    x.backward()
    np.testing.assert_allclose(_grad(x0), 1.0001**10_000, rtol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_diamond_graph_sums_every_path(device: str) -> None:
    xv = np.array([0.5, -1.0, 2.0])
    x = _leaf(xv, device)
    a = x * 2.0
    b = x * 3.0
    loss = (a * b + x + x * x * x).sum()  # 6x^2 + x + x^3
    loss.backward()
    np.testing.assert_allclose(_grad(x), 12 * xv + 1 + 3 * xv**2, rtol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_same_tensor_twice_in_one_op(device: str) -> None:
    xv = np.array([1.5, -2.0])
    x = _leaf(xv, device)
    (x + x).sum().backward()
    np.testing.assert_allclose(_grad(x), [2.0, 2.0])
    y = _leaf(xv, device)
    (y * y).sum().backward()
    np.testing.assert_allclose(_grad(y), 2 * xv)


def test_broadcast_gradients_are_summed_back_to_input_shapes() -> None:
    a = _leaf(np.ones((3, 1)))
    b = _leaf(np.ones((1, 4)))
    c = _leaf(2.0)
    (a * b * c).sum().backward()
    np.testing.assert_allclose(_grad(a), np.full((3, 1), 8.0))
    np.testing.assert_allclose(_grad(b), np.full((1, 4), 6.0))
    np.testing.assert_allclose(_grad(c), 12.0)


def test_gradient_reaching_a_leaf_through_a_cast_keeps_the_leaf_dtype() -> None:
    x = tl.tensor([1.0, 2.0], dtype=tl.float32, requires_grad=True)
    (x.to(tl.float64) * 3.0).sum().backward()
    assert x.grad is not None and x.grad.dtype == np.float32
    np.testing.assert_allclose(_grad(x), [3.0, 3.0])


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_accumulate_in_place_across_backward_calls(device: str) -> None:
    x = _leaf([1.0, 2.0], device)
    (x * 3.0).sum().backward()
    first = x.grad
    (x * x).sum().backward()
    assert x.grad is first  # accumulated into the same tensor (DDP's bucket views rely on it)
    np.testing.assert_allclose(_grad(x), [3.0 + 2.0, 3.0 + 4.0])


def test_explicit_gradient_weights_the_output_and_is_not_modified() -> None:
    x = _leaf([1.0, 2.0, 3.0])
    seed = np.array([1.0, 10.0, 100.0])
    kept = seed.copy()
    y = x + x
    y.backward(gradient=seed)
    np.testing.assert_allclose(_grad(x), 2 * kept)
    np.testing.assert_array_equal(seed, kept)
    assert not np.shares_memory(_grad(x), seed)


def test_backward_on_a_leaf_copies_the_given_gradient() -> None:
    x = _leaf([1.0, 2.0])
    g = tl.tensor([5.0, 6.0], dtype=tl.float64)
    x.backward(g)
    x.backward(g)
    np.testing.assert_allclose(_grad(x), [10.0, 12.0])
    np.testing.assert_allclose(g.numpy(), [5.0, 6.0])


# ============================================================================ errors
def test_backward_of_non_scalar_without_gradient_names_the_shape() -> None:
    x = _leaf(np.ones((2, 3)))
    with pytest.raises(RuntimeError, match=r"\(2, 3\)"):
        (x * 2.0).backward()


def test_backward_with_gradient_of_wrong_shape_names_both_shapes() -> None:
    x = _leaf(np.ones((2, 3)))
    with pytest.raises(RuntimeError, match=r"\(3, 2\).*\(2, 3\)"):
        (x * 2.0).backward(tl.ones(3, 2, dtype=tl.float64))


def test_second_backward_through_freed_graph_mentions_retain_graph() -> None:
    x = _leaf([1.0, 2.0])
    loss = (x * x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    np.testing.assert_allclose(_grad(x), [2.0, 4.0])  # the failed call added nothing


def test_backward_into_a_freed_subgraph_from_a_new_output_raises() -> None:
    x = _leaf([1.0, 2.0])
    h = x.exp()
    h.sum().backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        (h * 2.0).sum().backward()


def test_retain_graph_allows_a_second_backward() -> None:
    xv = np.array([1.0, -3.0])
    x = _leaf(xv)
    loss = (x * x * x).sum()
    loss.backward(retain_graph=True)
    assert loss.grad_fn is not None and not loss.grad_fn.freed
    loss.backward()
    np.testing.assert_allclose(_grad(x), 2 * 3 * xv**2)


def test_integer_and_bool_tensors_cannot_require_grad() -> None:
    with pytest.raises(TypeError, match="floating"):
        tl.tensor([1, 2], requires_grad=True)
    with pytest.raises(TypeError, match="int32"):
        tl.zeros(2, dtype=tl.int32, requires_grad=True)
    with pytest.raises(TypeError, match="bool"):
        tl.tensor([True]).requires_grad_()


def test_backward_of_tensor_without_graph_raises() -> None:
    with pytest.raises(RuntimeError, match="does not require grad"):
        tl.ones(2).sum().backward()


class _Scale(Function):
    """A custom primitive: multiplies by a constant (saved without __slots__)."""

    def forward(self, a: Any, factor: float = 1.0) -> Any:
        self.factor = factor
        self.saved = a
        return a * factor

    def backward(self, g: Any) -> Any:
        return g * self.factor


class _Stop(Function):
    """A primitive that passes no gradient back (backward returns None)."""

    __slots__ = ()

    def forward(self, a: Any) -> Any:
        return a.copy()

    def backward(self, g: Any) -> Any:
        return None


class _TwoGrads(Function):
    __slots__ = ()

    def forward(self, a: Any) -> Any:
        return a.copy()

    def backward(self, g: Any) -> Any:
        return g, g


class _BadShape(Function):
    __slots__ = ()

    def forward(self, a: Any) -> Any:
        return a.sum()

    def backward(self, g: Any) -> Any:
        return np.ones(7)


def test_custom_function_gradient_and_release_of_its_saved_state() -> None:
    x = _leaf([1.0, 2.0])
    y = _Scale.apply(x, factor=4.0)
    fn = y.grad_fn
    assert isinstance(fn, _Scale) and fn.saved is not None
    y.sum().backward()
    np.testing.assert_allclose(_grad(x), [4.0, 4.0])
    assert fn.freed
    assert not hasattr(fn, "saved")  # instance-dict state is dropped too


def test_leaf_reached_through_a_branch_without_gradient_still_gets_its_grad() -> None:
    x = _leaf([1.0, 2.0])
    calls: list[int] = []
    x.register_post_accumulate_grad_hook(lambda leaf: calls.append(1))
    h = x * 3.0
    (_Stop.apply(h) + x * 5.0).sum().backward()  # the path through h carries nothing
    np.testing.assert_allclose(_grad(x), [5.0, 5.0])
    assert calls == [1]


def test_leaf_reached_only_through_a_branch_without_gradient_gets_none() -> None:
    x = _leaf([1.0, 2.0])
    calls: list[int] = []
    x.register_post_accumulate_grad_hook(lambda leaf: calls.append(1))
    _Stop.apply(x * 3.0).sum().backward()
    assert x.grad is None
    assert calls == []


def test_function_returning_wrong_number_of_gradients_is_reported() -> None:
    x = _leaf([1.0])
    with pytest.raises(RuntimeError, match=r"_TwoGrads.*2 gradients for 1 inputs"):
        _TwoGrads.apply(x).sum().backward()


def test_function_returning_wrong_gradient_shape_is_reported() -> None:
    x = _leaf([1.0, 2.0])
    with pytest.raises(RuntimeError, match=r"_BadShape.*\(7,\).*\(2,\)"):
        _BadShape.apply(x).backward()


# ============================================================================ grad mode
def test_no_grad_context_records_nothing() -> None:
    x = _leaf([1.0, 2.0])
    with tl.no_grad():
        assert not tl.is_grad_enabled()
        y = (x * 2.0).exp()
    assert tl.is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_no_grad_decorator_records_nothing_and_restores_mode_on_error() -> None:
    @tl.no_grad()
    def double(t: Tensor) -> Tensor:
        """Docstring kept."""
        return t * 2.0

    @tl.no_grad()
    def fail() -> None:
        raise KeyError("boom")

    x = _leaf([1.0])
    y = double(x)
    assert not y.requires_grad and y.grad_fn is None
    assert double.__name__ == "double" and double.__doc__ == "Docstring kept."
    assert tl.is_grad_enabled()
    with pytest.raises(KeyError):
        fail()
    assert tl.is_grad_enabled()


def test_enable_grad_inside_no_grad_records() -> None:
    x = _leaf([1.0, 2.0])
    with tl.no_grad():
        with tl.enable_grad():
            y = x * 3.0
        z = x * 3.0
        assert not tl.is_grad_enabled()
    assert y.requires_grad and not z.requires_grad
    y.sum().backward()
    np.testing.assert_allclose(_grad(x), [3.0, 3.0])


def test_set_grad_enabled_false() -> None:
    x = _leaf([1.0])
    with tl.set_grad_enabled(False):
        y = x * 2.0
    with tl.set_grad_enabled(True):
        z = x * 2.0
    assert not y.requires_grad and z.requires_grad


def test_grad_mode_is_per_thread() -> None:
    seen: list[bool] = []
    with tl.no_grad():
        t = threading.Thread(target=lambda: seen.append(tl.is_grad_enabled()))
        t.start()
        t.join()
    assert seen == [True]


# ============================================================================ memory
def test_backward_releases_saved_state_of_every_node() -> None:
    x = _leaf([1.0, 2.0])
    y = x.exp()
    loss = (y * x).sum()
    mul, exp = loss.grad_fn, y.grad_fn
    assert mul is not None and exp is not None
    loss.backward()
    assert mul.freed and exp.freed
    assert not hasattr(exp, "out")


def _graph_with_big_intermediates() -> tuple[Tensor, Tensor, list[weakref.ref[Any]]]:
    """x -> a = 2x -> b = exp(a) -> c = b * b -> loss; only x and loss are returned."""
    x = tl.tensor(np.linspace(-1, 1, 200_000), requires_grad=True)
    a = x * 2.0
    b = a.exp()
    c = b * b
    loss = c.sum()
    refs = [weakref.ref(t.data) for t in (a, b, c)] + [weakref.ref(t) for t in (a, b, c)]
    return x, loss, refs


def test_intermediates_are_freed_while_backward_runs() -> None:
    x, loss, refs = _graph_with_big_intermediates()
    assert all(r() is not None for r in refs)  # alive through the graph before backward
    alive_in_hook: list[bool] = []
    x.register_post_accumulate_grad_hook(
        lambda leaf: alive_in_hook.extend(r() is not None for r in refs)
    )
    loss.backward()
    # x's hook fires last, after backward passed every node: nothing of theirs is left.
    assert alive_in_hook == [False] * len(refs)
    assert all(r() is None for r in refs)
    np.testing.assert_allclose(_grad(x), 4 * np.exp(4 * x.numpy()), rtol=1e-12)


def test_retain_graph_keeps_intermediates() -> None:
    _x, loss, refs = _graph_with_big_intermediates()
    loss.backward(retain_graph=True)
    assert all(r() is not None for r in refs)
    del loss
    assert all(r() is None for r in refs)


# ============================================================================ aliasing
def test_two_leaves_never_share_a_gradient_array() -> None:
    a = _leaf([1.0, 2.0])
    b = _leaf([3.0, 4.0])
    (a + b).sum().backward()
    assert a.grad is not None and b.grad is not None
    assert not np.shares_memory(a.grad.numpy(), b.grad.numpy())
    a.grad.numpy()[...] += 100.0
    np.testing.assert_allclose(_grad(b), [1.0, 1.0])


def test_two_leaves_with_a_non_scalar_seed_do_not_share() -> None:
    c = _leaf([0.0, 0.0])
    d = _leaf([0.0, 0.0])
    (c + d).backward(np.array([2.0, 3.0]))
    c.grad.numpy()[0] = -1.0  # type: ignore[union-attr]
    np.testing.assert_allclose(_grad(d), [2.0, 3.0])


def test_concatenated_leaves_get_independent_gradients() -> None:
    a = _leaf([1.0, 2.0])
    b = _leaf([3.0])
    (tl.concatenate([a, b]) * 2.0).sum().backward()
    a.grad.numpy()[...] = 0.0  # type: ignore[union-attr]
    np.testing.assert_allclose(_grad(b), [2.0])


@pytest.mark.parametrize(
    "view", [lambda t: t.reshape(6), lambda t: t[1:], lambda t: t.T, lambda t: t]
)
def test_gradient_from_view_ops_is_writable_and_owned(view: Any) -> None:
    x = _leaf(np.arange(6.0).reshape(2, 3))
    view(x).sum().backward()  # Sum's backward is a read-only broadcast view
    g = _grad(x)
    assert g.flags.writeable
    g[...] = 7.0  # would raise on a read-only or broadcast view
    (x * 1.0).sum().backward()  # accumulates into the array the user just wrote
    np.testing.assert_allclose(_grad(x), np.full((2, 3), 8.0))


def test_gradient_does_not_alias_forward_data() -> None:
    w = _leaf([1.0, 2.0])
    x = _leaf([3.0, 4.0])
    (w * x).sum().backward()  # dw = x and dx = w: must be copies, not the data itself
    w.grad.numpy()[...] = 0.0  # type: ignore[union-attr]
    x.grad.numpy()[...] = 0.0  # type: ignore[union-attr]
    np.testing.assert_allclose(w.numpy(), [1.0, 2.0])
    np.testing.assert_allclose(x.numpy(), [3.0, 4.0])


# ============================================================================ hooks for DDP
@pytest.mark.parametrize("device", DEVICES)
def test_post_accumulate_hook_fires_once_with_the_summed_gradient(device: str) -> None:
    w = _leaf([1.0, 2.0], device)
    seen: list[tuple[Tensor, np.ndarray[Any, Any]]] = []
    w.register_post_accumulate_grad_hook(lambda leaf: seen.append((leaf, _grad(leaf).copy())))
    (w * 2.0 + w * 3.0 + w * w).sum().backward()  # three uses
    assert len(seen) == 1
    assert seen[0][0] is w
    np.testing.assert_allclose(seen[0][1], [2 + 3 + 2.0, 2 + 3 + 4.0])
    (w * 1.0).sum().backward()
    assert len(seen) == 2
    np.testing.assert_allclose(seen[1][1], [8.0, 10.0])  # sees the accumulated .grad


def test_hooks_fire_for_layers_nearest_the_loss_first_and_immediately() -> None:
    tl.manual_seed(0)
    model = tl.nn.Sequential(
        tl.nn.Linear(4, 5), tl.nn.Tanh(), tl.nn.Linear(5, 5), tl.nn.Tanh(), tl.nn.Linear(5, 3)
    )
    names = {id(p): n for n, p in model.named_parameters()}
    order: list[str] = []
    grads_present: dict[str, int] = {}

    def hook(leaf: Tensor) -> None:
        order.append(names[id(leaf)])
        grads_present[names[id(leaf)]] = sum(p.grad is not None for p in model.parameters())

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    x = tl.randn(8, 4)
    tl.functional.cross_entropy(model(x), tl.tensor([0, 1, 2, 0, 1, 2, 0, 1])).backward()
    assert sorted(order) == sorted(names.values())
    layer = [int(n.split(".")[0]) for n in order]
    assert layer == sorted(layer, reverse=True), order
    # Each hook ran right after its own leaf was accumulated, not at the end of backward.
    assert grads_present[order[0]] == 1
    assert grads_present[order[-1]] == len(order)


def test_hook_handle_remove_and_multiple_hooks() -> None:
    w = _leaf([1.0])
    calls: list[str] = []
    h1 = w.register_post_accumulate_grad_hook(lambda leaf: calls.append("first"))
    w.register_post_accumulate_grad_hook(lambda leaf: calls.append("second"))
    (w * 2.0).sum().backward()
    assert calls == ["first", "second"]
    h1.remove()
    h1.remove()  # idempotent
    (w * 2.0).sum().backward()
    assert calls == ["first", "second", "second"]


def test_hook_not_fired_for_leaf_without_gradient_in_this_backward() -> None:
    used, unused = _leaf([1.0]), _leaf([1.0])
    calls: list[Tensor] = []
    for p in (used, unused):
        p.register_post_accumulate_grad_hook(calls.append)
    (used * 2.0).sum().backward()
    assert calls == [used] and unused.grad is None


def test_hook_fires_for_a_leaf_root() -> None:
    w = _leaf([1.0, 2.0])
    calls: list[Tensor] = []
    w.register_post_accumulate_grad_hook(calls.append)
    w.backward(np.array([1.0, 1.0]))
    assert calls == [w]


def test_hook_registration_errors() -> None:
    x = _leaf([1.0])
    with pytest.raises(RuntimeError, match="leaf"):
        (x * 2.0).register_post_accumulate_grad_hook(lambda leaf: None)
    with pytest.raises(RuntimeError, match="require grad"):
        tl.ones(2).register_post_accumulate_grad_hook(lambda leaf: None)


def test_queue_callback_runs_once_after_all_leaves_before_backward_returns() -> None:
    tl.manual_seed(1)
    model = tl.nn.Sequential(tl.nn.Linear(3, 4), tl.nn.Tanh(), tl.nn.Linear(4, 2))
    params = list(model.parameters())
    events: list[str] = []
    state = {"queued": False}

    def callback() -> None:
        events.append("callback")
        assert all(p.grad is not None for p in params)
        assert events.count("hook") == len(params)

    def hook(leaf: Tensor) -> None:
        events.append("hook")
        if not state["queued"]:
            state["queued"] = True
            tl.queue_callback(callback)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    model(tl.randn(5, 3)).sum().backward()
    events.append("returned")
    assert events == ["hook"] * len(params) + ["callback", "returned"]
    # A callback belongs to one backward() call only.
    events.clear()
    model(tl.randn(5, 3)).sum().backward()
    assert "callback" not in events


def test_callbacks_queued_by_callbacks_run_in_order() -> None:
    w = _leaf([1.0])
    events: list[str] = []

    def second() -> None:
        events.append("second")
        tl.queue_callback(lambda: events.append("third"))

    def first() -> None:
        events.append("first")
        tl.queue_callback(second)

    w.register_post_accumulate_grad_hook(lambda leaf: tl.queue_callback(first))
    (w * 2.0).sum().backward()
    assert events == ["first", "second", "third"]


def test_current_backward_id_tells_one_backward_from_another() -> None:
    w = _leaf([1.0, 2.0])
    seen: list[int | None] = []
    w.register_post_accumulate_grad_hook(lambda leaf: seen.append(tl.current_backward_id()))
    assert tl.current_backward_id() is None
    (w * 2.0).sum().backward()
    (w * 3.0).sum().backward()
    assert None not in seen and seen[0] != seen[1], seen

    # A backward that raised leaves no id behind; the next one gets a new one.
    class Boom(tl.Function):
        def forward(self, x: Any) -> Any:
            return x

        def backward(self, grad: Any) -> Any:
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        Boom.apply(w).sum().backward()
    assert tl.current_backward_id() is None
    (w * 4.0).sum().backward()
    assert seen[-1] not in seen[:-1], seen


def test_queue_callback_outside_backward_raises() -> None:
    with pytest.raises(RuntimeError, match=r"backward\(\)"):
        tl.queue_callback(lambda: None)


def test_error_in_hook_propagates_and_leaves_no_stale_backward_state() -> None:
    w = _leaf([1.0])
    ran: list[int] = []

    def hook(leaf: Tensor) -> None:
        tl.queue_callback(lambda: ran.append(1))
        raise ValueError("hook failed")

    w.register_post_accumulate_grad_hook(hook)
    with pytest.raises(ValueError, match="hook failed"):
        (w * 2.0).sum().backward()
    assert ran == []
    with pytest.raises(RuntimeError):
        tl.queue_callback(lambda: None)
