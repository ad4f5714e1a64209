"""``ZeroRedundancyOptimizer``: ZeRO-1, each rank keeps the optimizer state of 1/N of the elements.

How it works (the layout is nanotron's ``optim/zero.py``, the API torch's
``torch.distributed.optim.ZeroRedundancyOptimizer``):

* The parameters are partitioned flat and evenly (``_layout.py``): rank ``r`` owns elements
  ``[r*S, (r+1)*S)`` of each group's parameters of one dtype and device laid end to end.
* The owned part of each parameter is a *piece*: a 1-D tensor whose array is a view of that
  slice of the parameter, and whose gradient is the same slice of the parameter's gradient.
  An inner ``optimizer_class`` steps only this rank's pieces, so its state (momentum, Adam's
  moments) exists only for them, and the update lands in the parameters in place.
* After the step each rank's updated elements reach every rank through all-gathers, bucketed
  by the package's one bucketing (``_layout.plan_gather``, up to ``bucket_cap_mb`` a rank).
  Two buckets are in flight at a time, so unpacking one overlaps the next one's transfer and
  the transient buffers stay at two buckets.
* Gradients are not this class's business: DDP (or anything else) must have averaged them
  before :meth:`step`. Elementwise updates on slices give the same bits as on whole
  parameters, so ZeRO-1 after DDP reproduces DDP with the plain optimizer exactly.
* :meth:`consolidate_state_dict` sends every rank's state to one rank, which assembles it in
  the inner optimizer's own format (each parameter's state in its full shape), so
  :meth:`state_dict` loads into a plain optimizer, and :meth:`load_state_dict` takes such a
  dict at any world size: each rank cuts out its pieces.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

import collectives
import tensorlib as tl
from collectives import NonMemberGroup, ProcessGroup, where
from tensorlib import Tensor
from tensorlib.optim import Optimizer

from .._param_groups import match_param_groups
from ._layout import GatherBucket, Piece, Space, flat, make_spaces, on_device, plan_gather

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(Optimizer):
    """Shard ``optimizer_class``'s state over ``group``: each rank steps 1/N of the elements.

    Use it on the parameters of a :class:`ddp.DistributedDataParallel` model (whose backward
    averages the gradients); every rank ends each :meth:`step` with the same parameters as
    ``optimizer_class`` over all of them would give.

    Args:
        params: the parameters, or parameter groups (dicts with ``"params"``).
        optimizer_class: any tensorlib optimizer (``optim.SGD``, ``optim.Adam``,
            ``optim.AdamW``...), built on this rank's pieces with ``**defaults``.
        group: the group to shard over (default: the default group).
        bucket_cap_mb: the most each all-gather of updated parameters carries per rank, MiB.
        **defaults: the optimizer's hyper-parameters (``lr=...``).

    Attributes:
        optim: the inner optimizer over this rank's pieces (its ``state`` is this rank's).

    Raises:
        ValueError: on every rank, when the ranks pass different parameters (count, shapes,
            dtypes, groups), a different optimizer or different options; or when a parameter's
            array is not contiguous (a piece must be a view of it).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer],
        group: ProcessGroup | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        **defaults: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                f"ZeroRedundancyOptimizer: optimizer_class must be a tensorlib Optimizer class, "
                f"got {optimizer_class!r}"
            )
        pg = group if group is not None else collectives.get_default_group()
        if isinstance(pg, NonMemberGroup) or not isinstance(pg, ProcessGroup):
            raise ValueError("ZeroRedundancyOptimizer: this rank is not a member of the group")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.process_group = pg
        self.optimizer_class = optimizer_class
        self._cap = max(1, int(bucket_cap_mb * (1 << 20)))
        self._spaces: list[Space] = []
        self._buckets: list[GatherBucket] = []
        self._consolidated: dict[str, Any] | None = None
        self._steps = 0
        self._consolidated_at = -1
        self._defaults_sig = {k: repr(v) for k, v in sorted(defaults.items())}
        self.optim: Optimizer | None = None
        self._mine: list[Piece] = []  # this rank's pieces, in the inner optimizer's order
        # The base class validates the groups (add_param_group for each, only appending while
        # building); they are compared across ranks before any is partitioned, so that an
        # error that one rank could see alone (a non-contiguous parameter) is every rank's.
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        self._check_same(self.param_groups)
        for k in range(len(self.param_groups)):
            self._partition(k)
        inner = [self._inner_group(k) for k in range(len(self.param_groups))]
        self.optim = optimizer_class(inner, **defaults)
        self.defaults = dict(self.optim.defaults)
        for k in range(len(self.param_groups)):
            self._fill_options(k)
        self._plan_gather()

    # ------------------------------------------------------------------ partition
    @property
    def rank(self) -> int:
        """This rank's index in the group (the shard it owns)."""
        return int(self.process_group.rank)

    @property
    def world_size(self) -> int:
        """Ranks the state is sharded over."""
        return int(self.process_group.size)

    @property
    def state(self) -> dict[Tensor, dict[str, Any]]:
        """This rank's optimizer state, keyed by its piece tensors (1-D slices)."""
        return self.optim.state if self.optim is not None else {}

    @state.setter
    def state(self, value: dict[Tensor, dict[str, Any]]) -> None:
        if value:  # only the base class's empty initial dict comes here
            raise AttributeError(
                "ZeroRedundancyOptimizer.state is the inner optimizer's; use load_state_dict"
            )

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a parameter group (on every rank, the same): it is partitioned on its own, so
        the existing groups' partitions and state stay as they are.

        Raises:
            ValueError: on every rank when the ranks add different groups; or what the base
                class raises for a malformed group.
        """
        super().add_param_group(group)
        if self._building:
            return
        k = len(self.param_groups) - 1
        try:
            self._check_same(self.param_groups[k:], first=k)
            self._partition(k)
        except ValueError:
            del self.param_groups[k]  # as if never added
            raise
        assert self.optim is not None
        self.optim.add_param_group(self._inner_group(k))
        self._fill_options(k)
        self._plan_gather()

    def _fill_options(self, k: int) -> None:
        """Give outer group ``k`` the options the inner optimizer filled in from its defaults,
        so that ``param_groups`` and the state dict read as the plain optimizer's."""
        assert self.optim is not None
        for key, value in self.optim.param_groups[k].items():
            if key != "params":
                self.param_groups[k].setdefault(key, value)

    def _partition(self, k: int) -> None:
        base = sum(len(g["params"]) for g in self.param_groups[:k])
        self._spaces += make_spaces(k, self.param_groups[k]["params"], base, self.world_size)

    def _inner_group(self, k: int) -> dict[str, Any]:
        """Group ``k`` for the inner optimizer: this rank's pieces and the group's options."""
        pieces: list[Tensor] = []
        for space in self._spaces:
            if space.group != k:
                continue
            for piece in space.pieces(self.rank):
                view = flat(piece.param.data)[piece.lo : piece.hi]
                t = tl.from_array(view, piece.param.device)
                t.requires_grad = True
                piece.tensor = t
                pieces.append(t)
                self._mine.append(piece)
        out = {key: v for key, v in self.param_groups[k].items() if key != "params"}
        out["params"] = pieces
        return out

    def _plan_gather(self) -> None:
        self._buckets = plan_gather(self._spaces, self.world_size, self._cap)

    # ------------------------------------------------------------------ checks
    def _check_same(self, groups: list[dict[str, Any]], first: int = 0) -> None:
        """Every rank must pass the same groups and options: compare a digest, and on a
        difference gather the descriptions and raise on every rank, naming them."""
        pg = self.process_group
        if pg.size == 1:
            return
        desc: list[Any] = [["optimizer", self.optimizer_class.__name__, self._defaults_sig]]
        for k, g in enumerate(groups, start=first):
            opts = {key: repr(v) for key, v in sorted(g.items()) if key != "params"}
            desc.append(["group", k, len(g["params"]), opts])
            desc += [
                [
                    "param",
                    k,
                    j,
                    list(p.shape),
                    str(p.dtype),
                    p.device.type,
                    bool(p.data.flags.c_contiguous),
                ]
                for j, p in enumerate(g["params"])
            ]
        text = json.dumps(desc)
        digests = pg.all_gather_object([zlib.crc32(text.encode()), len(desc)])
        if all(d == digests[0] for d in digests):
            return
        every = pg.all_gather_object(desc)
        problems: list[str] = []
        for r, theirs in enumerate(every[1:], start=1):
            if len(theirs) != len(every[0]):
                np0 = sum(1 for e in every[0] if e[0] == "param")
                npr = sum(1 for e in theirs if e[0] == "param")
                problems.append(
                    f"rank {pg.ranks[r]} passes {npr} parameters, rank {pg.ranks[0]} {np0}"
                )
            for mine, ref in zip(theirs, every[0], strict=False):
                if mine != ref:
                    problems.append(
                        f"rank {pg.ranks[0]} has {_describe(ref)}, "
                        f"rank {pg.ranks[r]} has {_describe(mine)}"
                    )
                    break
        raise ValueError(
            f"{where(collectives.get_rank(), 'ZeroRedundancyOptimizer')}: the parameters or "
            f"options differ across ranks (every rank must pass the same model's parameters): "
            + "; ".join(problems[:6])
        )

    # ------------------------------------------------------------------ per step
    def step(self) -> None:
        """Update this rank's pieces with the inner optimizer, then all-gather the updated
        elements so that every rank holds every parameter's new value.

        Raises:
            ValueError: when a parameter's array was replaced by a non-contiguous one.
        """
        assert self.optim is not None
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            # Schedulers and users change the outer groups' options.
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value
        for piece in self._mine:
            p, t = piece.param, piece.tensor
            assert t is not None
            # Rebind every step: a loaded state dict or zero_grad may have replaced arrays.
            t.data = flat(p.data)[piece.lo : piece.hi]
            g = p.grad
            # A gradient that is not contiguous is read through a copy: it is only read.
            t.grad = (
                None
                if g is None
                else tl.from_array(g.data.reshape(-1)[piece.lo : piece.hi], p.device)
            )
        self.optim.step()
        for piece in self._mine:
            assert piece.tensor is not None
            piece.tensor.grad = None  # no reference to a gradient the user may free
        self._gather()
        self._steps += 1

    def _gather(self) -> None:
        buckets = self._buckets
        works: list[Any] = [None] * len(buckets)
        for i in range(min(2, len(buckets))):
            works[i] = self._launch(buckets[i])
        for i, bucket in enumerate(buckets):
            out = works[i].wait()
            works[i] = None
            if i + 2 < len(buckets):
                works[i + 2] = self._launch(buckets[i + 2])
            rows = out if bucket.space.device.type == "cpu" else bucket.space.device.xp.asarray(out)
            for r, row in enumerate(bucket.copies):
                if r == self.rank:
                    continue  # this rank's own elements are already in place
                for col, p, start, count in row:
                    flat(p.data)[start : start + count] = rows[r, col : col + count]

    def _launch(self, bucket: GatherBucket) -> Any:
        space = bucket.space
        xp = space.device.xp
        with on_device(space.device):
            send = xp.zeros(bucket.b - bucket.a, dtype=space.dtype)
        for col, p, start, count in bucket.copies[self.rank]:
            send[col : col + count] = flat(p.data)[start : start + count]
        return self.process_group.all_gather(send, async_op=True)

    # ------------------------------------------------------------------ state
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Send every rank's state to global rank ``to``, which keeps the full state for
        :meth:`state_dict` (a collective: every rank of the group calls it).

        Raises:
            ValueError: when ``to`` is not a rank of the group.
        """
        pg = self.process_group
        assert self.optim is not None
        if to not in list(pg.ranks):
            raise ValueError(
                f"{where(collectives.get_rank(), 'ZeroRedundancyOptimizer.consolidate_state_dict')}"
                f": to={to} is not a rank of the group {list(pg.ranks)}"
            )
        dst = list(pg.ranks).index(to)
        meta, arrays = self._local_state()
        every = pg.all_gather_object(meta) if pg.size > 1 else [meta]
        received: list[dict[str, Any]] = [arrays if r == self.rank else {} for r in range(pg.size)]
        for r in range(pg.size):
            if r == dst:
                continue
            for key, count, dtype in every[r]["messages"]:
                if self.rank == r:
                    pg.send(arrays[key], pg.ranks[dst])
                elif self.rank == dst:
                    device = self._device_of_message(every[r], key)
                    with on_device(device):
                        buf = device.xp.empty(count, dtype=np.dtype(dtype))
                    pg.recv(buf, pg.ranks[r])
                    received[r][key] = buf
        self._consolidated = None
        if self.rank == dst:
            self._consolidated = self._assemble(every, received)
            self._consolidated_at = self._steps

    def _local_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's state: JSON metadata (per piece: its scalars and array names) and, per
        (name, dtype), its pieces' arrays of that name packed end to end."""
        assert self.optim is not None
        pieces: list[list[Any]] = []
        packs: dict[str, list[Any]] = {}
        xps: dict[str, Any] = {}
        for piece in self._mine:
            assert piece.tensor is not None
            entry = self.optim.state.get(piece.tensor, {})
            scalars: dict[str, Any] = {}
            names: list[list[str]] = []
            for name, value in entry.items():
                if hasattr(value, "shape") and hasattr(value, "dtype") and value.ndim > 0:
                    # One message per state name, dtype and device.
                    dev = piece.param.device
                    key = f"{name}|{np.dtype(value.dtype).str}|{dev}"
                    packs.setdefault(key, []).append(value.reshape(-1))
                    xps[key] = dev.xp
                    names.append([name, key])
                else:
                    scalars[name] = value.item() if hasattr(value, "item") else value
            pieces.append([piece.index, piece.lo, piece.hi, scalars, names])
        arrays = {
            key: (parts[0] if len(parts) == 1 else xps[key].concatenate(parts))
            for key, parts in packs.items()
        }
        messages = [[key, int(a.size), key.split("|")[1]] for key, a in sorted(arrays.items())]
        return {"pieces": pieces, "messages": messages}, arrays

    def _device_of_message(self, meta: dict[str, Any], key: str) -> Any:
        params = self._params()
        for index, _lo, _hi, _scalars, names in meta["pieces"]:
            if any(k == key for _n, k in names):
                return params[index].device
        raise AssertionError("unreachable: a message always has a piece")  # pragma: no cover

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _assemble(self, every: list[dict[str, Any]], received: list[dict[str, Any]]) -> Any:
        params = self._params()
        state: dict[int, dict[str, Any]] = {}
        for r, meta in enumerate(every):
            used: dict[str, int] = {}
            for index, lo, hi, scalars, names in meta["pieces"]:
                if not names and not scalars:
                    continue
                p = params[index]
                entry = state.setdefault(index, {})
                entry.update(scalars)
                for name, key in names:
                    if name not in entry:
                        with on_device(p.device):
                            dt = np.dtype(key.split("|")[1])
                            entry[name] = p.device.xp.zeros(p.shape, dtype=dt)
                    at = used.get(key, 0)
                    flat(entry[name])[lo:hi] = received[r][key][at : at + hi - lo]
                    used[key] = at + hi - lo
        groups = []
        at = 0
        for g in self.param_groups:
            entry2 = {k: v for k, v in g.items() if k != "params"}
            entry2["params"] = list(range(at, at + len(g["params"])))
            at += len(g["params"])
            groups.append(entry2)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def state_dict(self) -> dict[str, Any]:
        """The full state in the inner optimizer's format (loads into a plain optimizer),
        on the rank that :meth:`consolidate_state_dict` sent it to.

        Raises:
            RuntimeError: on any other rank, before any consolidation, or when steps were
                taken since the last one (the dict would be stale).
        """
        head = where(collectives.get_rank(), "ZeroRedundancyOptimizer.state_dict")
        if self._consolidated is None:
            raise RuntimeError(
                f"{head}: no consolidated state on this rank; call consolidate_state_dict(to=r) "
                "on every rank first, then state_dict() on rank r"
            )
        if self._consolidated_at != self._steps:
            raise RuntimeError(
                f"{head}: the consolidated state is {self._steps - self._consolidated_at} "
                "step(s) old; call consolidate_state_dict again"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from :meth:`state_dict` at any world size, or from a plain
        optimizer of the same class): each rank keeps the slices of its pieces.

        Raises:
            ValueError: when the groups, parameter counts or a state array's shape do not
                match these parameters (checked before anything changes).
        """
        assert self.optim is not None
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("optimizer state_dict must have 'state' and 'param_groups'")
        by_index = match_param_groups(groups, self.param_groups)  # saved -> our index
        params = self._params()
        full: dict[int, dict[str, Any]] = {}
        for raw, entry in state_dict["state"].items():
            if int(raw) not in by_index:
                raise ValueError(f"optimizer state_dict has state for unknown parameter {raw}")
            index = by_index[int(raw)]
            p = params[index]
            for name, value in entry.items():
                arr = value.data if isinstance(value, Tensor) else value
                if hasattr(arr, "shape") and len(arr.shape) > 0 and tuple(arr.shape) != p.shape:
                    raise ValueError(
                        f"optimizer state {name!r} of parameter {raw} has shape "
                        f"{tuple(arr.shape)}, the parameter has {p.shape}"
                    )
            full[index] = entry
        per_piece: list[dict[str, Any] | None] = []
        for piece in self._mine:
            entry = full.get(piece.index)
            if entry is None:
                per_piece.append(None)
                continue
            sliced: dict[str, Any] = {}
            for name, value in entry.items():
                arr = value.data if isinstance(value, Tensor) else value
                if hasattr(arr, "shape") and len(arr.shape) > 0:
                    flat = arr.reshape(-1)  # a copy only where arr is not contiguous
                    sliced[name] = flat[piece.lo : piece.hi]
                else:
                    # A 0-d array (tensorlib.load gives tensors) back to the number it was.
                    sliced[name] = arr.item() if hasattr(arr, "item") else arr
            per_piece.append(sliced)
        self.load_local_state(per_piece, groups)

    def local_pieces(self) -> list[tuple[int, int, int, tuple[int, ...], dict[str, Any]]]:
        """This rank's pieces, for a checkpoint that stores each rank's part: per piece
        ``(parameter index over all groups, lo, hi, parameter shape, inner state)``, where
        ``[lo, hi)`` is the flat element range of the parameter the piece covers and the
        state's arrays are that range of the parameter's state (what ``step`` steps)."""
        assert self.optim is not None
        return [
            (piece.index, piece.lo, piece.hi, tuple(piece.param.shape), state)
            for piece in self._mine
            for state in [
                self.optim.state.get(piece.tensor, {}) if piece.tensor is not None else {}
            ]
        ]

    def load_local_state(
        self, per_piece: list[dict[str, Any] | None], groups: list[dict[str, Any]]
    ) -> None:
        """Load this rank's pieces' state (in :meth:`local_pieces`' order; None: no state)
        and the groups' options (``param_groups`` of a state dict, whose ``params`` are
        ignored); the shapes were checked by the caller.

        Raises:
            ValueError: when ``per_piece`` or ``groups`` do not match this optimizer's.
        """
        assert self.optim is not None
        if len(per_piece) != len(self._mine) or len(groups) != len(self.param_groups):
            raise ValueError(
                f"ZeroRedundancyOptimizer.load_local_state: {len(per_piece)} pieces and "
                f"{len(groups)} groups given, this rank has {len(self._mine)} and "
                f"{len(self.param_groups)}"
            )
        inner_state = {k: st for k, st in enumerate(per_piece) if st is not None}
        inner_groups = []
        at = 0
        for saved, inner in zip(groups, self.optim.param_groups, strict=True):
            entry = {k: v for k, v in saved.items() if k != "params"}
            entry["params"] = list(range(at, at + len(inner["params"])))
            at += len(inner["params"])
            inner_groups.append(entry)
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for saved, own in zip(groups, self.param_groups, strict=True):
            for k, v in saved.items():
                if k != "params":
                    own[k] = tuple(v) if isinstance(v, list) else v
        self._consolidated = None


def _describe(entry: list[Any]) -> str:
    """One entry of :meth:`ZeroRedundancyOptimizer._check_same`'s description, in words."""
    if entry[0] == "optimizer":
        return f"optimizer {entry[1]} with {entry[2]}"
    if entry[0] == "group":
        return f"parameter group {entry[1]} of {entry[2]} parameters, options {entry[3]}"
    layout = "" if entry[6] else " (not contiguous)"
    return f"parameter {entry[2]} of group {entry[1]} of shape {tuple(entry[3])} {entry[4]}{layout}"
