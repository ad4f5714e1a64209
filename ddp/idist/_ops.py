"""Ignite's collective helpers on tensorlib Tensors, Python numbers and strings.

Each takes Ignite's argument order and the seed's: ``all_reduce(tensor, op, group)`` and
``all_reduce(tensor, group, op)``, ``broadcast(tensor, src, safe_mode)`` and
``broadcast(tensor, src, group)``, ``sync(temporary)`` and ``sync(group)``. They are told
apart by type: a string is an op, a bool is a flag, and a group (what :func:`new_group`
returned, or a list of global ranks) is a group.

Result shapes follow Ignite: ``all_reduce`` returns the reduced value (the same Tensor,
reduced in place, or a number); ``all_gather`` concatenates tensors along the first axis
(a 0-d tensor counts as shape ``(1,)``), and gives a list for a number, a string or another
JSON-able value; ``broadcast`` returns the source's value, which with ``safe_mode`` the other
ranks need not even know the type of. Numbers, strings and other values travel as JSON
(``collectives.broadcast_object``/``all_gather_object``): exact, never pickled.

Outside any group (or in a group of one) every call is the identity of world size 1, with the
same argument checks, so a wrong call fails in a one-process run too.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import collectives
import tensorlib as tl
from tensorlib import Tensor

from ._config import device, is_distributed

__all__ = [
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "forget_groups",
    "new_group",
    "sync",
]

_OPS = {"SUM": "sum", "PRODUCT": "prod", "PROD": "prod", "MIN": "min", "MAX": "max"}
_OPS["AVG"] = "avg"
# Groups made from rank lists (``group=[1, 2]``), reused by later calls with the same list:
# (id of the default group, ranks) -> (that default group, the group made).
_list_groups: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}


def forget_groups() -> None:
    """Drop the groups made from rank lists in the calling rank's world (it is going away).

    Only this world's: rank threads of a threads job share this module, and one rank leaving
    must not make another remake its groups (a collective only that rank would call).
    """
    if not collectives.is_initialized():
        return
    mine = collectives.get_default_group()
    for key in [k for k, (world, _) in _list_groups.items() if world is mine]:
        del _list_groups[key]


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, complex)


def _group(group: Any, where: str) -> Any:
    """None for world size 1 (nothing to do), a ProcessGroup, or a NonMemberGroup."""
    if group is None:
        if not collectives.is_initialized():
            return None
        pg = collectives.get_default_group()
        return pg if pg.size > 1 else None
    if isinstance(group, list | tuple):
        ranks = _ranks(group, where)
        if not is_distributed():
            return None
        world = collectives.get_default_group()
        key = (id(world), tuple(sorted(ranks)))
        known = _list_groups.get(key)
        if known is None or known[0] is not world:
            # Collective: every rank of the job makes the call with this list (members get
            # the result, the others their input back).
            known = _list_groups[key] = (world, collectives.new_group(ranks))
        return known[1]
    if _is_group(group):
        return group
    raise ValueError(
        f"{where}: group must be a list of int ranks or what idist.new_group returned, got "
        f"{group!r}"
    )


def _is_group(x: Any) -> bool:
    return isinstance(x, collectives.ProcessGroup | collectives.NonMemberGroup)


def _is_group_like(x: Any) -> bool:
    """A group or a list of ranks (what ``group=`` takes), told apart from an op or a flag."""
    return _is_group(x) or isinstance(x, list | tuple)


def _check_json(where: str, value: Any) -> None:
    """Refuse alone what the object collectives refuse among ranks: a value that is not
    JSON (a dict holding a tensor...), so a script fails in a one-process run too."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{where}: the value must be JSON-serializable (dict/list/str/int/float/bool/None; "
            f"no pickle): {exc}"
        ) from None


def _ranks(ranks: Any, where: str) -> list[int]:
    """``ranks`` checked against the world as ``collectives.new_group`` checks them, at
    every world size (at world size 1 no group is made, so nothing else would)."""
    if not isinstance(ranks, list | tuple) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in ranks
    ):
        raise ValueError(f"{where}: ranks must be a list of int, got {ranks!r}")
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"{where}: ranks must be unique and non-empty, got {list(ranks)}")
    size = collectives.get_world_size()
    bad = sorted(r for r in ranks if not 0 <= r < size)
    if bad:
        raise ValueError(f"{where}: ranks {bad} are out of range for world size {size}")
    return list(ranks)


def _op(op: Any) -> str:
    name = op.upper() if isinstance(op, str) else None
    if name not in _OPS:
        raise ValueError(
            f"idist.all_reduce: unsupported reduction operation {op!r}; expected one of "
            "'SUM', 'PRODUCT', 'MIN', 'MAX' (or 'AVG')"
        )
    return _OPS[name]


def _in_place(pg: Any, t: Any, fn: str, *args: Any) -> Any:
    """Run ``pg.<fn>(array, *args)`` in place on a Tensor's or array's data; a tensor whose
    array the collective cannot write (a view that is not contiguous) gets a new array."""
    arr = t.data if isinstance(t, Tensor) else t
    if arr.flags.c_contiguous and arr.flags.writeable:
        getattr(pg, fn)(arr, *args)
        return t
    tmp = np.ascontiguousarray(arr) if isinstance(arr, np.ndarray) else arr.copy(order="C")
    getattr(pg, fn)(tmp, *args)
    return tl.from_array(tmp) if isinstance(t, Tensor) else tmp


def all_reduce(tensor: Any, op: Any = "SUM", group: Any = None) -> Any:
    """Reduce ``tensor`` across the ranks and return the result.

    Ignite's order ``all_reduce(tensor, "MAX", group)`` and the seed's
    ``all_reduce(tensor, group, "MAX")`` (or ``all_reduce(tensor, group)``) both work: a
    string is the op, a group or a list of ranks is the group.

    Args:
        tensor: a tensorlib Tensor or NumPy array (reduced in place and returned), or a
            Python number (the reduced number is returned: an int stays an int).
        op: ``"SUM"``, ``"PRODUCT"``, ``"MIN"``, ``"MAX"`` (or ``"AVG"``), any case (None:
            ``"SUM"``); or, in the seed's order, the group.
        group: None (every rank), a list of global ranks (every rank makes the call; the
            ranks outside it get ``tensor`` back), or what :func:`new_group` returned; or, in
            the seed's order, the op.

    Raises:
        TypeError: for another input type (a string, a list...).
        ValueError: for an unknown ``op`` or ``group``.
    """
    if isinstance(group, str) or (group is None and _is_group_like(op)):
        op, group = group, op  # the seed's order: (tensor, group, op)
    rop = _op("SUM" if op is None else op)
    if not isinstance(tensor, Tensor | np.ndarray) and not _is_number(tensor):
        raise TypeError(
            f"idist.all_reduce: unhandled input type {type(tensor).__name__}; expected a "
            "tensorlib Tensor, a NumPy array or a number"
        )
    pg = _group(group, "idist.all_reduce")
    if pg is None or not pg.is_member():
        return tensor
    if _is_number(tensor):
        is_int = isinstance(tensor, numbers.Integral)
        arr = np.array([tensor], dtype=np.int64 if is_int else np.float64)
        if is_int and rop == "avg":
            arr = arr.astype(np.float64)
        pg.all_reduce(arr, rop)
        return arr.item()
    return _in_place(pg, tensor, "all_reduce", rop)


def all_gather(tensor: Any, group: Any = None) -> Any:
    """Gather ``tensor`` from every rank (in rank order).

    Returns:
        For a Tensor (or array) of shape ``(n, ...)``: shape ``(world_size * n, ...)``, the
        ranks' tensors one after another; a 0-d tensor counts as shape ``(1,)`` (at every
        world size). For a number, a string or another JSON-able value: a list with one item
        per rank. A rank outside ``group`` gets ``tensor`` back.

    Raises:
        TypeError: for a value that is not JSON-able (objects travel as JSON, never pickled),
            at world size 1 too.
        ValueError: for an unknown ``group``.
    """
    pg = _group(group, "idist.all_gather")
    is_tensor = isinstance(tensor, Tensor | np.ndarray)
    if pg is not None and not pg.is_member():
        return tensor
    if not is_tensor:
        if pg is None:
            _check_json("idist.all_gather", tensor)
            return [tensor]
        return pg.all_gather_object(tensor)
    arr = tensor.data if isinstance(tensor, Tensor) else tensor
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if pg is None:
        if arr is (tensor.data if isinstance(tensor, Tensor) else tensor):
            return tensor
        return tl.from_array(arr) if isinstance(tensor, Tensor) else arr
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    out = pg.all_gather(arr)  # (size, n, ...)
    out = out.reshape(pg.size * arr.shape[0], *arr.shape[1:])
    return tl.from_array(out) if isinstance(tensor, Tensor) else out


def broadcast(tensor: Any, src: int = 0, safe_mode: Any = False, group: Any = None) -> Any:
    """Send global rank ``src``'s value to every rank (of ``group``) and return it.

    Ignite's ``broadcast(tensor, src, safe_mode)`` and the seed's
    ``broadcast(tensor, src, group)`` both work: a bool is ``safe_mode``, a group or a list
    of ranks is the group.

    Args:
        tensor: a Tensor (or array), a number, a string or a ``pathlib.Path``. Without
            ``safe_mode`` every rank passes a value of the same kind (a Tensor of the same
            shape and dtype, filled in place); with it the other ranks may pass anything,
            None included, and receive a new value of the source's type (a Tensor of its
            shape and dtype, on this rank's :func:`device`).
        src: the source's global rank (a member of ``group``).
        safe_mode: let the ranks other than ``src`` not know what they receive (one more,
            small broadcast first); or, in the seed's order, the group.
        group: None (every rank), a list of global ranks (every rank makes the call; the
            ranks outside it get ``tensor`` back), or what :func:`new_group` returned.

    Raises:
        TypeError: for another input type.
        ValueError: for None on ``src``, None elsewhere without ``safe_mode``, a ``src``
            that is not a rank (of ``group``), or an unknown ``group``.
    """
    if group is None and _is_group_like(safe_mode):
        safe_mode, group = False, safe_mode  # the seed's order: (tensor, src, group)
    if not isinstance(safe_mode, bool | np.bool_):
        raise ValueError(
            f"idist.broadcast: safe_mode must be a bool (or, third, a group), got {safe_mode!r}"
        )
    kinds = (Tensor, np.ndarray, str, Path)
    if tensor is not None and not (isinstance(tensor, kinds) or _is_number(tensor)):
        raise TypeError(
            f"idist.broadcast: unhandled input type {type(tensor).__name__}; expected a "
            "tensorlib Tensor, a NumPy array, a number, a str or a pathlib.Path"
        )
    world, rank = collectives.get_world_size(), collectives.get_rank()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"idist.broadcast: src must be a rank in [0, {world}), got {src!r}")
    if tensor is None:
        if rank == src:
            raise ValueError(f"idist.broadcast: the source data (rank {src}) can not be None")
        if not safe_mode:
            raise ValueError(
                f"idist.broadcast: rank {rank} passed None, which needs safe_mode=True (the "
                f"source rank {src} then tells the others its value's type, shape and dtype)"
            )
    pg = _group(group, "idist.broadcast")
    if pg is None:
        return tensor
    if src not in pg.ranks:
        raise ValueError(f"idist.broadcast: src={src} is not in the group's ranks {list(pg.ranks)}")
    if not pg.is_member():
        return tensor
    if safe_mode:
        return _broadcast_safe(pg, tensor, src, rank == src)
    if isinstance(tensor, Tensor | np.ndarray):
        return _in_place(pg, tensor, "broadcast", src)
    return _decode(pg.broadcast_object(_encode(tensor) if rank == src else None, src))


def _encode(value: Any) -> dict[str, Any]:
    if isinstance(value, Path):
        return {"kind": "path", "value": str(value)}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, numbers.Integral):
        return {"kind": "int", "value": int(value)}
    if isinstance(value, numbers.Real):
        return {"kind": "float", "value": float(value)}
    return {"kind": "str", "value": str(value)}


def _decode(msg: dict[str, Any]) -> Any:
    value = msg["value"]
    if msg["kind"] == "path":
        return Path(value)
    return value


def _broadcast_safe(pg: Any, tensor: Any, src: int, is_src: bool) -> Any:
    head: dict[str, Any] | None = None
    if is_src:
        if isinstance(tensor, Tensor | np.ndarray):
            arr = tensor.data if isinstance(tensor, Tensor) else tensor
            head = {"kind": "tensor", "shape": list(arr.shape), "dtype": str(arr.dtype)}
            head["numpy"] = isinstance(tensor, np.ndarray)
        else:
            head = _encode(tensor)
    msg = pg.broadcast_object(head, src)
    if msg["kind"] != "tensor":
        return tensor if is_src else _decode(msg)
    if is_src:
        return _in_place(pg, tensor, "broadcast", src)
    dtype = np.dtype(msg["dtype"])
    if msg["numpy"]:
        return _in_place(pg, np.empty(msg["shape"], dtype=dtype), "broadcast", src)
    here = tl.zeros(*msg["shape"], dtype=str(dtype), device=device())
    return _in_place(pg, here, "broadcast", src)


def barrier(group: Any = None) -> None:
    """Wait until every rank (of ``group``) arrived; a no-op outside any group.

    Args:
        group: None (every rank), a list of global ranks (every rank makes the call; the
            ranks outside it go on at once), or what :func:`new_group` returned.

    Raises:
        ValueError: for an unknown ``group``.
    """
    pg = _group(group, "idist.barrier")
    if pg is not None and pg.is_member():
        pg.barrier()


def sync(group: Any = None, temporary: bool | None = None) -> None:
    """Synchronize the ranks (of ``group``): the seed's ``sync(group=None)``, a barrier.

    In Ignite, ``sync(temporary=False)`` re-reads a process group made by hand; ``idist``
    caches nothing, so that form (a bool, or ``temporary=``) has nothing to do. The seed's
    form waits for every rank of the group, as :func:`barrier`; an Ignite script calling
    ``sync()`` on every rank after making its group by hand meets there once, harmlessly.

    Args:
        group: None (every rank), a list of global ranks, or what :func:`new_group`
            returned; a bool here is Ignite's ``temporary``.
        temporary: Ignite's flag (accepted; nothing to do).

    Raises:
        ValueError: for an unknown ``group``, or both a group and ``temporary``.
    """
    if isinstance(group, bool | np.bool_):
        group, temporary = None, bool(group)  # Ignite's sync(temporary)
    if temporary is not None:
        if group is not None:
            raise ValueError(
                "idist.sync: give a group (the seed's sync(group), a barrier) or Ignite's "
                "temporary flag, not both"
            )
        return  # Ignite's form: nothing is cached, so nothing to refresh
    barrier(group)


def new_group(ranks: Sequence[int], **kwargs: Any) -> Any:
    """A group of some global ranks; every rank of the job makes the call.

    Args:
        ranks: the members' global ranks.
        **kwargs: ``backend`` and ``timeout``, as ``collectives.new_group`` takes them.

    Returns:
        The group (a ``NonMemberGroup`` on the other ranks); outside any group or in a group
        of one, ``ranks`` itself (Ignite's serial model), which the collectives here accept
        as ``group``.

    Raises:
        ValueError: when ``ranks`` is not a list of int.
        TypeError: for another keyword argument.
    """
    checked = _ranks(ranks, "idist.new_group")
    unknown = sorted(set(kwargs) - {"backend", "timeout"})
    if unknown:
        raise TypeError(
            f"idist.new_group: unexpected arguments {unknown}; accepted: backend, timeout"
        )
    if not is_distributed():
        return ranks
    return collectives.new_group(checked, **kwargs)
