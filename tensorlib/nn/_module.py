"""``Module`` and ``Parameter``: the containers that models are built from."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .._backward import RemovableHandle
from .._device import Device, is_device_spec
from .._device_guard import on_device
from .._dtype import is_floating
from .._serialization import state_cast_error
from .._tensor import Tensor, _clear_grads

__all__ = ["Module", "Parameter"]


@dataclass
class StateMismatch:
    """What :meth:`Module.load_state_dict` found wrong: key lists and ``"key: ..."`` lines."""

    missing: list[str]
    unexpected: list[str]
    shapes: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)


class Parameter(Tensor):
    """A Tensor that a Module registers as trainable (``requires_grad=True`` by default)."""

    __slots__ = ()

    def __init__(self, data: Any, requires_grad: bool = True) -> None:
        src = data._data if isinstance(data, Tensor) else data
        super().__init__(src, dtype=getattr(src, "dtype", None), requires_grad=requires_grad)
        if isinstance(data, Tensor):
            # Keep the data where it is and do not copy: Parameter(t) wraps t's array.
            self._data = data._data
            self._device = data._device

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


class Module:
    """Base class of layers and models.

    Assigning a :class:`Parameter` or ``Module`` as an attribute registers it; buffers
    (non-trainable state saved in ``state_dict``) are registered with :meth:`register_buffer`.
    Subclasses implement ``forward``; calling the module calls ``forward``.
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    # ------------------------------------------------------------------ registration
    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(
                f"cannot assign {name!r} before Module.__init__() was called "
                f"(call super().__init__() first in {type(self).__name__}.__init__)"
            )
        params, buffers, modules = self._parameters, self._buffers, self._modules
        is_buffer = name in buffers
        if isinstance(value, Parameter):
            params[name] = value
            buffers.pop(name, None)
            modules.pop(name, None)
        elif isinstance(value, Module):
            modules[name] = value
            params.pop(name, None)
            buffers.pop(name, None)
        elif is_buffer and (value is None or isinstance(value, Tensor)):
            buffers[name] = value
        elif name in params and value is None:
            params[name] = None
        else:
            for table in (params, buffers, modules):
                table.pop(name, None)
            object.__setattr__(self, name, value)
            return
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            t = d.get(table)
            if t is not None and name in t:
                return t[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def register_buffer(self, name: str, value: Tensor | None) -> None:
        """Register non-trainable state (saved in ``state_dict``, moved by ``to``)."""
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"buffer {name!r} must be a Tensor or None, got {type(value).__name__}")
        self.__dict__.pop(name, None)
        self._buffers[name] = value

    def register_parameter(self, name: str, value: Parameter | None) -> None:
        """Register a parameter under ``name`` (None registers an absent one)."""
        if value is not None and not isinstance(value, Parameter):
            raise TypeError(f"parameter {name!r} must be a Parameter, got {type(value).__name__}")
        self.__dict__.pop(name, None)
        self._parameters[name] = value

    def add_module(self, name: str, module: Module | None) -> None:
        """Register a child module under ``name``."""
        self.__dict__.pop(name, None)
        self._modules[name] = module

    # ------------------------------------------------------------------ traversal
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """Yield (qualified name, module) for this module and every descendant, once each."""
        seen: set[int] = set()
        stack: list[tuple[str, Module]] = [(prefix, self)]
        while stack:
            name, mod = stack.pop()
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            yield name, mod
            children = [
                (f"{name}.{k}" if name else k, m) for k, m in mod._modules.items() if m is not None
            ]
            stack.extend(reversed(children))

    def modules(self) -> Iterator[Module]:
        """Yield every module in the tree (self first)."""
        for _, m in self.named_modules():
            yield m

    def children(self) -> Iterator[Module]:
        """Yield direct child modules."""
        for m in self._modules.values():
            if m is not None:
                yield m

    def _named_tensors(self, kind: str, prefix: str) -> Iterator[tuple[str, Any]]:
        """Yield (qualified name, tensor) from every module's ``kind`` dict (``"_parameters"``
        or ``"_buffers"``) in registration order; a tensor registered twice comes once."""
        seen: set[int] = set()
        for mname, mod in self.named_modules(prefix):
            for name, t in getattr(mod, kind).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{mname}.{name}" if mname else name), t

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """Yield (qualified name, parameter) in registration order; shared ones once."""
        return self._named_tensors("_parameters", prefix)

    def parameters(self) -> Iterator[Parameter]:
        """Yield every parameter once."""
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """Yield (qualified name, buffer)."""
        return self._named_tensors("_buffers", prefix)

    def buffers(self) -> Iterator[Tensor]:
        """Yield every buffer once."""
        for _, b in self.named_buffers():
            yield b

    # ------------------------------------------------------------------ modes and devices
    def train(self, mode: bool = True) -> Module:
        """Set training mode (affects Dropout and similar layers) on the whole tree."""
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        """Set evaluation mode."""
        return self.train(False)

    def to(self, device: str | Device | Any = None, dtype: Any = None) -> Module:
        """Move (and/or cast) every parameter and buffer in place; identities are kept.

        ``device`` may also be a dtype (``model.to(tensorlib.float64)``), as in ``Tensor.to``.
        Only floating-point parameters and buffers are cast.
        """
        if device is not None and not is_device_spec(device):
            device, dtype = None, device  # a dtype given positionally: cast it like dtype=
        for t in list(self.parameters()) + list(self.buffers()):
            # Only floating tensors are cast (as in PyTorch): an int64 index or counter buffer
            # must stay integral. `is not None`: NumPy 1.x dtypes are falsy (len() == 0).
            dt = dtype if dtype is not None and is_floating(t.dtype) else None
            if device is None and dt is None:
                continue
            t.data = t.detach().to(device, dtype=dt)  # a Tensor: its device comes along
            if t._grad is not None:
                t._grad = t._grad.detach().to(device, dtype=dt)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (to None by default, or to zeros in place)."""
        _clear_grads(self.parameters(), set_to_none)

    def apply(self, fn: Callable[[Module], None]) -> Module:
        """Call ``fn(module)`` on every module in the tree (children first), then return self."""
        for m in reversed(list(self.modules())):
            fn(m)
        return self

    # ------------------------------------------------------------------ state
    def state_dict(self) -> OrderedDict[str, Tensor]:
        """Parameters and buffers by qualified name (tensors sharing this module's data)."""
        out: OrderedDict[str, Tensor] = OrderedDict()
        for mname, mod in self.named_modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    if t is not None:
                        out[f"{mname}.{name}" if mname else name] = t.detach()
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> list[str]:
        """Copy values into parameters and buffers in place (keeping each one's device and
        dtype); everything is checked first, so an error changes nothing.

        A value's dtype may differ from the tensor's only by a cast that keeps the kind of
        number: float16/float32/float64 among themselves (rounded to the nearest, as PyTorch's
        ``copy_``), integers among int32/int64 when every value fits. Unlike ``copy_``, an
        integer or bool value into a float tensor, a float into an integer or bool buffer, and
        text, complex or object arrays are refused.

        Args:
            state_dict: name -> Tensor or array, as produced by :meth:`state_dict`.
            strict: require exactly the same names; shapes and dtypes must always match.

        Returns:
            The names that were missing from ``state_dict`` (always empty when strict).

        Raises:
            KeyError: with strict, listing missing and unexpected keys.
            ValueError: listing every shape and dtype mismatch (key, checkpoint's and model's).
        """
        found = self._state_dict_mismatch(state_dict)
        if strict and (found.missing or found.unexpected):
            parts = []
            if found.missing:
                parts.append(f"missing keys: {found.missing}")
            if found.unexpected:
                parts.append(f"unexpected keys: {found.unexpected}")
            raise KeyError(f"load_state_dict for {type(self).__name__}: " + "; ".join(parts))
        parts = []
        if found.shapes:
            parts.append("shape mismatch for " + "; ".join(found.shapes))
        if found.dtypes:
            parts.append("dtype mismatch for " + "; ".join(found.dtypes))
        if parts:
            raise ValueError(f"load_state_dict for {type(self).__name__}: " + "; ".join(parts))
        for k, t in self.state_dict().items():
            if k not in state_dict:
                continue
            v = state_dict[k]
            src = (
                v.detach().to(t.device, dtype=t.dtype)
                if isinstance(v, Tensor)
                else Tensor(v, dtype=t.dtype, device=t.device)
            )
            # On t's GPU, whichever is current: CuPy copies on the current one.
            on_device(t._device, t._data.__setitem__, Ellipsis, src._data)
        return found.missing

    def _state_dict_mismatch(self, state_dict: dict[str, Any]) -> StateMismatch:
        """How ``state_dict`` differs from this module's state: the checks of
        :meth:`load_state_dict`, shared with ``ddp.load_checkpoint`` (which must check the
        model before it loads anything else)."""
        own = self.state_dict()
        found = StateMismatch(
            missing=[k for k in own if k not in state_dict],
            unexpected=[k for k in state_dict if k not in own],
        )
        for k, t in own.items():
            if k not in state_dict:
                continue
            v = state_dict[k]
            shape = tuple(getattr(v, "shape", ()))
            if shape != t.shape:
                found.shapes.append(f"{k}: checkpoint {shape} vs model {t.shape}")
                continue
            problem = state_cast_error(v, t.dtype)
            if problem is not None:
                found.dtypes.append(f"{k}: {problem}")
        return found

    # ------------------------------------------------------------------ calling
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        pre, post = d.get("_forward_pre_hooks"), d.get("_forward_hooks")
        if not pre and not post:  # the common case: one dict lookup each, no hook machinery
            return self.forward(*args, **kwargs)
        for hook in list((pre or {}).values()):
            new_args = hook(self, args)
            if new_args is not None:
                args = new_args if isinstance(new_args, tuple) else (new_args,)
        out = self.forward(*args, **kwargs)
        for hook in list((post or {}).values()):
            new_out = hook(self, args, out)
            if new_out is not None:
                out = new_out
        return out

    def register_forward_pre_hook(self, hook: Callable[[Module, tuple[Any, ...]], Any]) -> Any:
        """Call ``hook(module, args)`` before each ``forward`` (PyTorch's signature).

        ``args`` are the positional arguments (keyword arguments go to ``forward`` untouched);
        a hook that returns something other than None replaces them (a non-tuple becomes a
        one-element tuple). Hooks run in registration order.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return self._add_hook("_forward_pre_hooks", hook)

    def register_forward_hook(self, hook: Callable[[Module, tuple[Any, ...], Any], Any]) -> Any:
        """Call ``hook(module, args, output)`` after each ``forward`` (PyTorch's signature).

        A hook that returns something other than None replaces the output. Hooks run in
        registration order.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return self._add_hook("_forward_hooks", hook)

    def _add_hook(self, table: str, hook: Callable[..., Any]) -> Any:
        if not callable(hook):
            raise TypeError(f"a forward hook must be callable, got {hook!r}")
        hooks = self.__dict__.get(table)
        if hooks is None:
            # Made on first use, so modules without hooks (and subclasses that never call
            # this) pay nothing in __call__.
            hooks = OrderedDict()
            object.__setattr__(self, table, hooks)
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def extra_repr(self) -> str:
        """Extra text shown in ``repr`` (layer sizes and options)."""
        return ""

    def __repr__(self) -> str:
        lines = []
        for name, m in self._modules.items():
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({name}): {sub}")
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n" + "\n".join(lines) + "\n)"
