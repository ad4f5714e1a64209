"""``fully_shard``: FSDP2's API over :class:`~ddp.fsdp._unit.Unit`, and what a sharded module
adds (full and local state dicts)."""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import collectives
import tensorlib as tl
from collectives import NonMemberGroup, ProcessGroup
from tensorlib import Tensor
from tensorlib.nn import Module, Parameter

from ._mp import MixedPrecisionPolicy
from ._param import ShardedParam
from ._stats import ShardStats
from ._unit import Unit, shard_of

__all__ = ["FSDPModule", "fully_shard"]


class FSDPModule:
    """Mixed into the class of every module given to :func:`fully_shard` (as FSDP2 does).

    ``state_dict()`` gives full tensors, gathered over the group (a collective: every rank
    calls it); ``local_state_dict()`` gives this rank's shards (padded rows included) as the
    module and the optimizer hold them; ``load_state_dict()`` takes full tensors and keeps
    this rank's rows. ``set_requires_gradient_sync(False)`` (or ``with model.no_sync():``)
    accumulates full gradients locally over several backwards, for gradient accumulation.
    """

    @property
    def stats(self) -> ShardStats:
        """What the last step of the outermost sharded module over this one communicated and
        waited for (all-gathers, prefetches, reduce-scatters, wait seconds, bytes sent)."""
        return self.__dict__["_fsdp_unit"].schedule.stats

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduce-scatters gradients (FSDP2's name).

        With False, each unit adds its full (unsharded) gradient, in the reduce dtype, to a
        buffer it keeps (one full gradient per unit: the memory a replica's gradients take)
        instead of reduce-scattering it; the next backward with True reduce-scatters the sum,
        so the shards' ``.grad`` get the average over the group of everything accumulated:
        what DDP's ``no_sync`` gives, with one reduce-scatter per unit instead of one per
        backward.

        Args:
            requires_gradient_sync: reduce-scatter in backward (True, the default) or
                accumulate locally (False).
            recurse: also set it for every ``fully_shard`` module under this one.
        """
        for unit in _units(self, recurse):  # type: ignore[arg-type]
            unit.requires_gradient_sync = bool(requires_gradient_sync)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (FSDP1's and DDP's ``no_sync``): the
        first backward after it reduce-scatters everything accumulated."""
        units = _units(self, True)  # type: ignore[arg-type]
        before = [u.requires_gradient_sync for u in units]
        for u in units:
            u.requires_gradient_sync = False
        try:
            yield
        finally:
            for u, b in zip(units, before, strict=True):
                u.requires_gradient_sync = b

    def state_dict(self) -> OrderedDict[str, Tensor]:
        """Parameters (full, all-gathered from the shards) and buffers by qualified name."""
        local = Module.state_dict(self)  # type: ignore[arg-type]
        if self.__dict__.get("_fsdp_loading"):
            return local  # Module.load_state_dict compares with (and writes into) the shards
        named = _shard_places(self)  # type: ignore[arg-type]
        out: OrderedDict[str, Tensor] = OrderedDict()
        for k, t in local.items():
            entry = named.get(k)
            if entry is None:
                out[k] = t
                continue
            unit, sp = entry
            world = unit.group.size
            rows = unit.group.all_gather(np.ascontiguousarray(sp.shard.data))
            full = rows.reshape((sp.rows * world, *sp.shape[1:]))[: sp.shape[0]]
            out[k] = tl.from_array(np.ascontiguousarray(full), sp.shard.device)
        return out

    def local_state_dict(self) -> OrderedDict[str, Tensor]:
        """This rank's shards (``(ceil(d0 / N), ...)``, padding rows included) and the buffers,
        sharing the module's data, as ``Module.state_dict`` gives them."""
        return Module.state_dict(self)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> list[str]:
        """Load full tensors (what :meth:`state_dict` gives): each sharded parameter keeps this
        rank's rows; everything is checked as ``Module.load_state_dict`` checks it.

        Raises:
            KeyError: with strict, on missing or unexpected keys.
            ValueError: on a shape (the full one is expected) or dtype mismatch.
        """
        named = _shard_places(self)  # type: ignore[arg-type]
        local: dict[str, Any] = dict(state_dict)
        bad: list[str] = []
        for k, v in state_dict.items():
            entry = named.get(k)
            if entry is None:
                continue
            unit, sp = entry
            arr = v.numpy() if isinstance(v, Tensor) else np.asarray(v)
            if tuple(arr.shape) != sp.shape:
                bad.append(f"{k}: checkpoint {tuple(arr.shape)} vs model {sp.shape} (full)")
                continue
            r = unit.group.rank
            mine = np.zeros(sp.shard.shape, dtype=arr.dtype)
            got = arr[r * sp.rows : (r + 1) * sp.rows]
            mine[: got.shape[0]] = got
            local[k] = mine
        if bad:
            raise ValueError(
                f"load_state_dict for {type(self).__name__}: shape mismatch for " + "; ".join(bad)
            )
        object.__setattr__(self, "_fsdp_loading", True)
        try:
            return Module.load_state_dict(self, local, strict)  # type: ignore[arg-type]
        finally:
            object.__setattr__(self, "_fsdp_loading", False)


def _units(module: Module, recurse: bool) -> list[Unit]:
    if not recurse:
        return [module.__dict__["_fsdp_unit"]]
    return [
        m.__dict__["_fsdp_unit"] for _, m in module.named_modules() if "_fsdp_unit" in m.__dict__
    ]


def _shard_places(module: Module) -> dict[str, tuple[Unit, ShardedParam]]:
    """Qualified name (as ``state_dict`` names it) -> unit and layout, for every shard."""
    out: dict[str, tuple[Unit, ShardedParam]] = {}
    for m, mod in module.named_modules():
        for n in mod._parameters:
            entry = shard_of(mod, n)
            if entry is not None:
                out[f"{m}.{n}" if m else n] = entry
    return out


_CLASSES: dict[type, type] = {}


def fully_shard(
    module: Module,
    group: ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Module:
    """Shard ``module``'s parameters over ``group`` (PyTorch FSDP2's ``fully_shard``).

    Apply it bottom-up: to each block first, then to the root; each call manages the
    parameters under ``module`` that no inner call already manages. Every parameter is split
    on its first dimension (padded with zero rows to a multiple of the group size), and the
    module keeps only this rank's rows: ``module.parameters()`` are those shards, and any
    optimizer steps them as it would plain parameters. Before the module's forward its
    parameters are all-gathered into full tensors; after forward they are freed
    (``reshard_after_forward=True``: ZeRO-3; gathered again when backward reaches the module)
    or kept until backward is done with them (False: ZeRO-2). In backward the full gradients
    are reduce-scattered, averaged over the group as DDP averages, so each shard's ``.grad``
    holds this rank's rows of the average (added by a callback at the end of ``backward()``,
    the reduce-scatters having run asynchronously meanwhile). From the second forward on,
    the next unit's all-gather is prefetched in the order the last forward ran the units
    (in backward too, under ZeRO-3). The group's first rank's values are broadcast first,
    as DDP does.

    With ``mp_policy=MixedPrecisionPolicy(param_dtype=tl.float16, reduce_dtype=tl.float32)``
    the shards (the optimizer's master weights) stay float32, the all-gather sends float16
    and forward and backward compute in float16, and gradients are averaged in float32.

    ``module.state_dict()`` then gives full tensors (all-gathered: every rank must call it),
    ``module.local_state_dict()`` this rank's shards, and ``module.load_state_dict()`` takes
    full tensors.

    Args:
        module: the module to shard (its class becomes a subclass with :class:`FSDPModule`).
        group: the group to shard over (default: the default group).
        reshard_after_forward: free the gathered parameters after forward (True) or after
            backward (False).
        mp_policy: the dtypes to gather, reduce and return in (default: none changed).

    Returns:
        ``module``, sharded.

    Raises:
        TypeError: when ``module`` is not a tensorlib Module.
        ValueError: when the rank is not in ``group``, ``module`` was already given to
            ``fully_shard``, its parameters have different dtypes or no dimension, or the ranks
            disagree on the parameters (names, shapes, dtypes) or the options; every rank
            raises alike.
        NotImplementedError: for parameters off the CPU (NumPy only, for now).
    """
    if not isinstance(module, Module):
        raise TypeError(f"fully_shard takes a tensorlib nn.Module, got {module!r}")
    group = group if group is not None else collectives.get_default_group()
    if isinstance(group, NonMemberGroup) or not isinstance(group, ProcessGroup):
        raise ValueError("fully_shard: this rank is not a member of the group")
    if "_fsdp_unit" in module.__dict__:
        raise ValueError(f"fully_shard: this {type(module).__name__} is already sharded")
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    places = _unmanaged(module)
    _check_params(module, places)
    options = {"reshard_after_forward": str(bool(reshard_after_forward))}
    options["mp_policy"] = mp_policy.describe()
    _check_same(group, module, places, options)
    _broadcast(group, [p for _, _, p in places])
    unit = Unit(module, group, places, bool(reshard_after_forward), mp_policy)
    object.__setattr__(module, "_fsdp_unit", unit)
    # The units under this one (and it) share one schedule: this module's forward spans them.
    for _, mod in module.named_modules():
        inner = mod.__dict__.get("_fsdp_unit")
        if inner is not None:
            inner.schedule = unit.schedule
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        sub = _CLASSES.get(cls)
        if sub is None:
            sub = _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        module.__class__ = sub
    return module


def _unmanaged(module: Module) -> list[tuple[str, list[tuple[Module, str]], Parameter]]:
    """Parameters under ``module`` that are not shards of an inner unit, each once, with every
    place that registers it."""
    found: dict[int, tuple[str, list[tuple[Module, str]], Parameter]] = {}
    for mname, mod in module.named_modules():
        for attr, p in mod._parameters.items():
            if p is None or shard_of(mod, attr) is not None:
                continue
            entry = found.get(id(p))
            if entry is None:
                found[id(p)] = (f"{mname}.{attr}" if mname else attr, [(mod, attr)], p)
            else:
                entry[1].append((mod, attr))
    return list(found.values())


def _check_params(
    module: Module, places: list[tuple[str, list[tuple[Module, str]], Parameter]]
) -> None:
    head = f"fully_shard({type(module).__name__})"
    for name, _, p in places:
        if p.device.type != "cpu":
            raise NotImplementedError(
                f"{head}: parameter {name!r} is on {p.device}; fully_shard shards NumPy (CPU) "
                f"parameters only for now"
            )
        if p.ndim == 0:
            raise ValueError(f"{head}: parameter {name!r} is a scalar; dim-0 sharding needs a dim")
    dtypes = {str(p.dtype) for _, _, p in places}
    if len(dtypes) > 1:
        raise ValueError(
            f"{head}: the unit's parameters have different dtypes {sorted(dtypes)}; one unit "
            f"gathers them in one buffer: shard the differently typed submodules on their own "
            f"or cast the module first"
        )


def _check_same(
    group: ProcessGroup,
    module: Module,
    places: list[tuple[str, list[tuple[Module, str]], Parameter]],
    options: dict[str, str],
) -> None:
    """Every rank raises, naming the differences, when the ranks' units differ."""
    if group.size == 1:
        return
    desc = [[n, list(p.shape), str(p.dtype), bool(p.requires_grad)] for n, _, p in places]
    desc += [[k, [], v, False] for k, v in options.items()]
    text = json.dumps([type(module).__name__, desc])
    digests = group.all_gather_object([zlib.crc32(text.encode()), len(desc)])
    if all(d == digests[0] for d in digests):
        return
    every = group.all_gather_object(text)
    ref = dict((e[0], e[1:]) for e in json.loads(every[0])[1])
    problems: list[str] = []
    r0 = group.ranks[0]
    for r, theirs in enumerate(every[1:], start=1):
        rank = group.ranks[r]
        mine = dict((e[0], e[1:]) for e in json.loads(theirs)[1])
        problems += [f"rank {rank} lacks {k!r} (rank {r0} has it)" for k in ref if k not in mine]
        problems += [f"rank {rank} has an extra {k!r}" for k in mine if k not in ref]
        problems += [
            f"{k!r}: rank {r0} has {ref[k][:2]}, rank {rank} has {mine[k][:2]}"
            for k in ref
            if k in mine and mine[k] != ref[k]
        ]
    raise ValueError(
        f"fully_shard({type(module).__name__}): the ranks hold different parameters or options "
        f"(shape, dtype; every rank must shard the same model the same way): "
        + "; ".join(problems or ["the module classes differ"])
    )


def _broadcast(group: ProcessGroup, params: list[Parameter]) -> None:
    """The group's first rank's values into every rank's parameters, in one broadcast."""
    if group.size == 1 or not params:
        return
    flat = np.concatenate([np.asarray(p.data).reshape(-1) for p in params])
    group.broadcast(flat, src=group.ranks[0])
    start = 0
    for p in params:
        n = p.size
        p.data[...] = flat[start : start + n].reshape(p.shape)
        start += n
