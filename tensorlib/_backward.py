"""Reverse-mode autodiff, the engine: ``backward()`` over the graph :class:`~._autograd.Function`
nodes recorded, gradient ownership and accumulation, and the hooks DDP uses.

The engine works on raw arrays (NumPy or CuPy), never builds a graph while differentiating,
and walks the graph iteratively, so graph depth is limited only by memory. What a
``Function.backward`` may return is the contract in :mod:`._autograd`'s docstring.

Hooks used by DistributedDataParallel:

* ``Tensor.register_post_accumulate_grad_hook(fn)``: ``fn(leaf)`` runs right after the leaf's
  ``.grad`` received its gradient for the current ``backward()`` call (once per call, after all
  contributions to that leaf were summed).
* :func:`queue_callback`: ``fn()`` runs once at the end of the current ``backward()`` call,
  after every gradient was accumulated and before ``backward()`` returns.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _device_guard
from ._device_guard import DeviceGuard
from ._grad_mode import _state

if TYPE_CHECKING:
    from ._autograd import Function
    from ._device import Device
    from ._tensor import Tensor

__all__ = [
    "RemovableHandle",
    "current_backward_id",
    "queue_callback",
    "run_backward",
    "take_grad_buffer",
]

# Numbers the backward() calls of this process (see current_backward_id).
_backward_ids = itertools.count(1)


def current_backward_id() -> int | None:
    """A number for the ``backward()`` call now running on this thread (the innermost, when
    a hook runs another), unique in the process; None outside ``backward()``.

    Code that keeps work across the steps of one backward (a gradient hook that batches
    communication) tells with it whether what it kept belongs to the backward now running or
    to one that raised before its callbacks could finish it.
    """
    return _state.backward_ids[-1] if _state.backward_ids else None


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` once at the end of the ``backward()`` call now in progress.

    Callbacks run in the order they were queued, after every leaf gradient was accumulated and
    before ``backward()`` returns. A callback may queue further callbacks; they run too.

    Raises:
        RuntimeError: if no ``backward()`` is running on this thread.
    """
    if not _state.callback_stack:
        raise RuntimeError(
            "queue_callback() can only be called while backward() is running "
            "(e.g. from a post-accumulate-grad hook)"
        )
    _state.callback_stack[-1].append(callback)


def _unbroadcast(fn: Function, grad: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``grad`` down to ``shape`` (undoing NumPy broadcasting)."""
    gshape = grad.shape
    lead = len(gshape) - len(shape)
    if lead < 0 or any(s != 1 and s != gs for s, gs in zip(shape, gshape[lead:], strict=True)):
        raise RuntimeError(
            f"Function `{type(fn).__name__}` returned a gradient of shape {tuple(gshape)} "
            f"for an input of shape {tuple(shape)} (this is a bug in that function)"
        )
    axes = tuple(range(lead)) + tuple(
        i + lead for i, s in enumerate(shape) if s == 1 and gshape[i + lead] != 1
    )
    if axes:
        grad = grad.sum(axis=axes)
    if grad.shape != shape:
        grad = grad.reshape(shape)
    return grad


def _owns(array: Any) -> bool:
    # An array that is no view of another one can only be referenced by whoever just made it.
    return getattr(array, "base", None) is None


def run_backward(root: Tensor, grad: Any | None, retain_graph: bool) -> None:
    """Backpropagate from ``root`` and accumulate gradients into the leaves' ``.grad``."""
    if not root.requires_grad:
        raise RuntimeError(
            "backward(): this tensor does not require grad and has no graph "
            "(was it computed under no_grad(), or from tensors with requires_grad=False?)"
        )
    callbacks: list[Callable[[], None]] = []
    _state.callback_stack.append(callbacks)
    _state.backward_ids.append(next(_backward_ids))
    outer_taken, _state.taken = _state.taken, set()
    # Gradients are computed on the graph's GPU whichever is current, and the caller's current
    # device is back afterwards (see _device_guard). Every node of a graph is on its root's
    # device unless a node that moves data between devices was ever recorded: then the
    # engine makes each node's device current as it runs it.
    with DeviceGuard() as guard:
        guard.use(root._device)
        try:
            seed, seed_owned = _seed(root, grad)
            if root._ctx is None:
                _accumulate(root, seed, seed_owned)
            else:
                per_node = guard if _device_guard.cross_device_recorded else None
                _run_graph(root._ctx, seed, seed_owned, retain_graph, per_node)
                if per_node is not None:
                    guard.use(root._device)  # callbacks run on the root's device
            # Callbacks may queue more callbacks; run until none is left.
            i = 0
            while i < len(callbacks):
                callbacks[i]()
                i += 1
        finally:
            _state.callback_stack.pop()
            _state.backward_ids.pop()
            _state.taken = outer_taken


def _seed(root: Tensor, grad: Any | None) -> tuple[Any, bool]:
    """The gradient backward starts from (``grad``, or ones for a scalar), and whether it is
    the engine's own array (one it may accumulate into)."""
    if grad is None:
        if root._data.size != 1:
            raise RuntimeError(
                f"backward(): grad can be implicitly created only for scalar outputs, but this "
                f"tensor has shape {tuple(root.shape)}; pass gradient=... of that shape"
            )
        return root._device.xp.ones(root._data.shape, dtype=root._data.dtype), True
    seed = grad._data if isinstance(grad, _tensor.Tensor) else root._device.xp.asarray(grad)
    if tuple(seed.shape) != tuple(root.shape):
        raise RuntimeError(
            f"backward(): gradient has shape {tuple(seed.shape)} but the tensor has shape "
            f"{tuple(root.shape)}"
        )
    if seed.dtype != root._data.dtype:
        seed = seed.astype(root._data.dtype)
    return seed, False


# The engine keeps its bookkeeping in three places (as chainer's `_backprop` and tinygrad's
# engine keep theirs central): how many gradients each node and leaf waits for
# (_count_consumers), the order nodes run in (_run_graph), and which gradient arrays the
# engine owns, so that it may sum into them in place (_owned, _shared_arrays, _wait). Gradients on
# their way to a node or leaf wait in {id(node or leaf): (array, owned)}.
_Waiting = dict[int, tuple[Any, bool]]


def _run_graph(
    root_fn: Function,
    seed: Any,
    seed_owned: bool,
    retain_graph: bool,
    per_node: DeviceGuard | None = None,
) -> None:
    """Run the backward of every node below ``root_fn``, each once all its consumers have run.

    Kahn's algorithm over the counts of :func:`_count_consumers`: iterative, so graph depth is
    limited only by memory. A leaf receives its summed gradient (and fires its hooks) when its
    last consumer has run. With ``per_node``, each node's device is made current before its
    backward runs (for graphs that may span devices).
    """
    consumers = _count_consumers(root_fn)
    grads: _Waiting = {id(root_fn): (seed, seed_owned)}
    ready = [root_fn]
    while ready:
        fn = ready.pop()
        inputs = fn.inputs  # read before release() drops them
        entry = grads.pop(id(fn), None)
        if entry is None:
            # No gradient reached this node (its consumers returned None for it). Its inputs
            # are still counted down below: otherwise a leaf also reached through another path
            # would never reach 0 and never get its .grad or hooks.
            result: tuple[Any, ...] = (None,) * len(inputs)
            shared = None
        else:
            g, g_owned = entry
            if per_node is not None and not fn.moves_device:  # (a move picks its devices)
                per_node.use(_node_device(inputs))
            result = fn.backward(g)
            if not isinstance(result, tuple):
                result = (result,)
            if not retain_graph:
                if fn._plain_release:  # nothing saved: release() would only do this
                    fn.inputs = ()
                    fn.freed = True
                else:
                    fn.release()
            n = len(result)
            if n != len(inputs):
                raise RuntimeError(
                    f"Function `{type(fn).__name__}` returned {n} gradients for "
                    f"{len(inputs)} inputs (this is a bug in that function)"
                )
            shared = None
            # A binary op with one input that needs no gradient (x + b) shares nothing.
            if n > 2 or (n == 2 and inputs[0] is not None and inputs[1] is not None):
                shared, g_owned = _shared_arrays(inputs, result, g, g_owned)
        # strict=False: the lengths were checked, and a strict zip costs time on this path.
        for t, r in zip(inputs, result, strict=False):
            if t is None:
                continue
            tctx = t._ctx
            key = id(tctx) if tctx is not None else id(t)
            if r is not None:
                if shared is not None and id(r) in shared:
                    owned = False
                elif r is g:
                    owned = g_owned
                else:
                    owned = _owned(t, r)
                data = t._data
                # The common case inline: the first gradient for t, of its type, shape, dtype.
                if (
                    type(r) is type(data)
                    and r.dtype is data.dtype
                    and r.shape == data.shape
                    and key not in grads
                ):
                    grads[key] = (r, owned)
                else:
                    _wait(grads, key, fn, t, r, owned)
            left = consumers[key] - 1
            consumers[key] = left
            if left == 0:
                if tctx is not None:
                    ready.append(tctx)  # with or without a gradient (see above)
                else:
                    done = grads.pop(key, None)
                    if done is not None:
                        _accumulate(t, done[0], done[1])


def _node_device(inputs: tuple[Tensor | None, ...]) -> Device | None:
    """The device a node ran on: its inputs' (one device: ``Function.apply`` checks it)."""
    for t in inputs:
        if t is not None:
            return t._device
    return None


def _count_consumers(root_fn: Function) -> dict[int, int]:
    """For every node and leaf below ``root_fn`` (by id), how many edges feed it a gradient.

    Raises:
        RuntimeError: when a node's saved intermediates were freed by an earlier backward.
    """
    counts: dict[int, int] = {}
    stack = [root_fn]
    while stack:
        fn = stack.pop()
        if fn.freed:
            raise RuntimeError(
                f"Trying to backward through the graph a second time (through `"
                f"{type(fn).__name__}`), but its saved intermediates were already freed. "
                f"Pass retain_graph=True to the first backward() if you need to backward twice."
            )
        for t in fn.inputs:
            if t is None:
                continue
            tctx = t._ctx
            if tctx is None:
                key = id(t)
                counts[key] = counts.get(key, 0) + 1
            else:
                # A node is in `counts` once it was reached: only the first visit goes below it
                # (the root is nobody's input, so it never comes back).
                key = id(tctx)
                n = counts.get(key)
                if n is None:
                    counts[key] = 1
                    stack.append(tctx)
                else:
                    counts[key] = n + 1
    return counts


def _owned(t: Tensor, r: Any) -> bool:
    """Whether the engine owns ``r``, a gradient for ``t`` that is neither ``g`` nor shared:
    new arrays are; a view only when it is the leaf's grad buffer (see :func:`take_grad_buffer`),
    which is meant to become ``.grad``."""
    if getattr(r, "base", None) is None:
        return True
    buf = getattr(t, "_grad_buffer", None) if t._ctx is None else None
    return buf is not None and r is buf._data


def _wait(grads: _Waiting, key: int, fn: Function, t: Tensor, r: Any, owned: bool) -> None:
    """Add ``r``, a gradient ``fn.backward`` returned for its input ``t``, into what ``t``
    waits for (``grads[key]``).

    It is first brought to ``t``'s shape (un-broadcast: the one place that happens) and
    dtype. Ownership (``owned``, see :func:`_run_graph`): a gradient may be summed into in
    place, or become a leaf's ``.grad`` without a copy, only if nothing else can see it. New
    arrays are owned; ``g`` is owned as far as it was unless a view of it escaped; an array
    returned for two inputs is owned by neither (see :func:`_shared_arrays`).
    """
    if isinstance(r, np.generic):
        r = np.asarray(r)
        owned = True
    data = t._data
    if r.shape != data.shape:
        r = _unbroadcast(fn, r, data.shape)
        owned = owned or _owns(r)
    rdt = r.dtype
    if rdt is not data.dtype and rdt != data.dtype:
        r = r.astype(data.dtype)
        owned = True
    prev = grads.get(key)
    if prev is None:
        grads[key] = (r, owned)
    elif prev[1]:
        acc = prev[0]
        acc += r  # ours alone: sum in place
    else:
        grads[key] = (prev[0] + r, True)


def _shared_arrays(
    inputs: tuple[Tensor | None, ...], result: tuple[Any, ...], g: Any, g_owned: bool
) -> tuple[set[int] | None, bool]:
    """Ids of the arrays ``result`` gives to more than one input (None: no such array), and
    whether the engine still owns ``g`` (not if some other gradient is a view that escaped)."""
    if len(result) == 2:  # binary ops: the common case, without a set
        r0, r1 = result
        if inputs[0] is None or inputs[1] is None or r0 is None or r1 is None:
            return None, g_owned  # one gradient goes on at most: nothing to share
        view = (r0 is not g and r0.base is not None) or (r1 is not g and r1.base is not None)
        return ({id(r0)} if r0 is r1 else None), g_owned and not view
    shared: set[int] | None = None
    any_view = False
    seen: set[int] = set()
    for t, r in zip(inputs, result, strict=False):
        if t is None or r is None:
            continue
        rid = id(r)
        if rid in seen:
            if shared is None:
                shared = set()
            shared.add(rid)
        seen.add(rid)
        if r is not g and r.base is not None:
            any_view = True
    return shared, g_owned and not any_view


def take_grad_buffer(t: Tensor | None) -> Any | None:
    """For ``Function.backward``: the array to write input ``t``'s gradient into, or None.

    Returns the leaf's grad buffer (``Tensor.set_grad_buffer``) when ``t`` is a leaf with one,
    its ``.grad`` is None, and no other op of this backward wrote into it yet (a tensor used
    twice gets the buffer once; the engine adds the other gradient into it). The op must
    write the full gradient there (``out=``) and return that array.
    """
    if t is None or t._ctx is not None or t._grad is not None:
        return None
    buf = getattr(t, "_grad_buffer", None)
    if buf is None or id(t) in _state.taken:
        return None
    _state.taken.add(id(t))
    return buf._data


def _accumulate(leaf: Tensor, g: Any, owned: bool) -> None:
    """Add ``g`` into ``leaf.grad`` (in place when one exists) and fire its hooks."""
    current = leaf._grad
    if current is None:
        buf = getattr(leaf, "_grad_buffer", None)
        if buf is not None and g is buf._data:
            leaf._grad = buf  # an op wrote the gradient into the buffer: it is .grad
        else:
            leaf._grad = _tensor.Tensor._wrap(g if owned else g.copy(), leaf._device)
    else:
        current._data += g
    hooks = leaf._hooks
    if hooks:
        for hook in list(hooks.values()):
            hook(leaf)


class RemovableHandle:
    """Returned by hook registration; ``remove()`` unregisters the hook."""

    _next_id = 0

    def __init__(self, hooks: dict[int, Any]) -> None:
        self._hooks = hooks
        self.id = RemovableHandle._next_id
        RemovableHandle._next_id += 1

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        self._hooks.pop(self.id, None)


# The module, not the class: _tensor imports this module while it is being defined.
from . import _tensor  # noqa: E402
