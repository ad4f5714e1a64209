"""``ddp.join``: uneven inputs, as PyTorch DDP's ``Join``.

Ranks that ran out of data shadow the collectives of the ranks that still have some, until
every rank is done; the gradients stay averages over the ranks that had data in each step.

How it works (every rank sees the same numbers, so every rank decides alike):

* Inside the block every DDP forward first all-reduces a tiny "notify" vector: a one-hot of
  this rank (it has data this step), a one-hot of whether this forward synchronizes gradients
  (not under ``no_sync``/``no_grad``), and this rank's ``throw_on_early_termination``. From the
  sum every rank knows the set of active ranks and their number ``k``.
* A rank whose loop ended enters a shadow loop in ``__exit__``: it all-reduces the vector with
  zeros; a sum of zeros means every rank is done. Otherwise it issues what the active ranks
  issue in that step: the buffer broadcast (from the lowest active rank), and, for a
  synchronizing step, the reducer's :meth:`~ddp._reducer.Reducer.shadow_backward` (each
  bucket's comm hook on a zeroed bucket, then the control all-reduce with zeros: no missing
  parameter, none used).
* After the buckets are reduced, a step with ``k < N`` ranks scales them by ``N / k`` (the
  hook averaged over ``N``; the join sets the reducer's ``grad_scale``), for any averaging
  hook; with ``k == N`` nothing changes.
* Once every rank is done, if any step was uneven, the parameters, buffers and the given
  optimizers' state are copied from the lowest rank of the last non-empty step, so that every
  rank continues (next epoch) from identical state.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import numpy as np

import collectives
from collectives import ReduceOp, where

from ._ddp import DistributedDataParallel
from ._sync import broadcast_module_buffers, broadcast_module_state

__all__ = ["Join", "join"]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if ranks else "none"


class Join:
    """The context manager :func:`join` returns; see there."""

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizers: Any = (),
        throw_on_early_termination: bool = False,
        enable: bool = True,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"ddp.join takes a DistributedDataParallel model, got {type(model).__name__}"
            )
        if hasattr(optimizers, "state_dict"):
            optimizers = [optimizers]
        if not isinstance(optimizers, Iterable):
            raise TypeError(
                "ddp.join: optimizers must be a list of optimizers, got "
                f"{type(optimizers).__name__}"
            )
        self.optimizers = list(optimizers)
        for opt in self.optimizers:
            if not (
                callable(getattr(opt, "state_dict", None))
                and callable(getattr(opt, "load_state_dict", None))
            ):
                raise TypeError(
                    "ddp.join: every entry of optimizers needs state_dict() and "
                    f"load_state_dict(), got {type(opt).__name__}"
                )
        self.model = model
        self.group = model.process_group
        self.throw_on_early_termination = bool(throw_on_early_termination)
        self.enabled = bool(enable) and self.group.size > 1
        self._step = 0  # notify rounds so far: DDP forwards under this join, on every rank
        self._uneven = False
        self._last_active: list[int] = []

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Join:
        if not self.enabled:
            return self
        reducer = self.model.reducer
        if reducer.join is not None:
            raise RuntimeError(
                f"{where(collectives.get_rank(), 'ddp.join')}: this model is already inside a "
                "ddp.join block; nest none"
            )
        self._step, self._uneven, self._last_active = 0, False, []
        reducer.join = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        self.model.reducer.join = None
        if exc_type is not None:
            # The body raised: shadowing now would pair this rank's collectives with the
            # others' next step. The others fail through the group (peer failure, timeout).
            return
        while (found := self._round(active=False, sync=False)) is not None:
            src, syncing = found
            if self.model.broadcast_buffers:
                broadcast_module_buffers(self.group, self.model.module, src)
            if syncing:
                self.model.reducer.shadow_backward()
        if self._uneven:
            self._final_sync()

    # ------------------------------------------------------------------ rounds
    def notify(self, sync: bool) -> int:
        """Called by every DDP forward inside the block: one notify round for a rank that has
        data. Returns the global rank to broadcast buffers from.

        Raises:
            RuntimeError: with ``throw_on_early_termination`` once a rank ran out; when the
                ranks with data disagree on synchronizing this step; when ranks disagree on
                ``throw_on_early_termination``. Every rank raises alike.
        """
        found = self._round(active=True, sync=sync)
        assert found is not None  # this rank is active, so the set is not empty
        return found[0]

    def _round(self, active: bool, sync: bool) -> tuple[int, bool] | None:
        """All-reduce the notify vector; return (buffer source, whether this step syncs), or
        None once every rank is done."""
        group, n, me = self.group, self.group.size, self.group.rank
        vec = np.zeros(2 * n + 1, dtype=np.int64)
        if active:
            vec[me] = 1
            vec[n + me] = int(sync)
        vec[2 * n] = int(self.throw_on_early_termination)
        group.all_reduce(vec, ReduceOp.SUM)
        step = self._step
        self._step += 1
        head = f"{where(collectives.get_rank(), 'ddp.join')}, step {step}"
        if vec[2 * n] not in (0, n):
            raise RuntimeError(
                f"{head}: {int(vec[2 * n])} of {n} ranks passed throw_on_early_termination=True, "
                "the others False; pass the same value on every rank"
            )
        have = [r for r in range(n) if vec[r]]
        if not have:
            return None
        syncing = [r for r in have if vec[n + r]]
        glob = [group.ranks[r] for r in have]
        if syncing and len(syncing) != len(have):
            local = [group.ranks[r] for r in have if not vec[n + r]]
            raise RuntimeError(
                f"{head}: rank(s) {_ranks([group.ranks[r] for r in syncing])} ran a forward "
                f"that synchronizes gradients, rank(s) {_ranks(local)} one under no_sync (or "
                "no_grad); in each step every rank with data must do the same"
            )
        if len(have) < n:
            self._uneven = True
            if self.throw_on_early_termination:
                out = [group.ranks[r] for r in range(n) if not vec[r]]
                raise RuntimeError(
                    f"{head}: rank(s) {_ranks(out)} ran out of data while rank(s) "
                    f"{_ranks(glob)} still had data (step {step} is forward #{step + 1} "
                    "under join); throw_on_early_termination=True stops every rank here"
                )
        self._last_active = glob
        if syncing:
            # The hook averages over all n ranks; the average over those with data is n/k
            # times that (exactly 1 when every rank has data: nothing changes).
            self.model.reducer.grad_scale = n / len(have) if len(have) < n else 1.0
        return glob[0], bool(syncing)

    # ------------------------------------------------------------------ the end
    def _final_sync(self) -> None:
        """Copy the model and the optimizers' state from the last rank(s) to run out."""
        src = self._last_active[0]
        broadcast_module_state(self.group, self.model.module, src)
        for opt in self.optimizers:
            _copy_state(self.group, opt, src, self.model)


# ---------------------------------------------------------------------------- state copy
def _encode(value: Any, arrays: list[Any], path: str) -> Any:
    """``value`` as JSON, arrays replaced by their index in ``arrays``; types kept exactly
    (int dict keys, tuples, NumPy scalars), so the copy equals the original."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return {"s": [value.dtype.str, value.item()]}
    if hasattr(value, "__array_interface__") or hasattr(value, "__cuda_array_interface__"):
        arrays.append(value)
        return {"a": len(arrays) - 1}
    if isinstance(value, dict):
        return {
            "d": [
                [_encode(k, arrays, path), _encode(v, arrays, f"{path}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    if isinstance(value, list | tuple):
        items = [_encode(v, arrays, f"{path}[{i}]") for i, v in enumerate(value)]
        return {"t": items} if isinstance(value, tuple) else items
    raise TypeError(f"{path} is a {type(value).__name__}, which ddp.join cannot copy")


def _decode(value: Any, arrays: list[Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "s" in value:
        dtype, item = value["s"]
        return np.dtype(dtype).type(item)
    if "a" in value:
        return arrays[value["a"]]
    if "t" in value:
        return tuple(_decode(v, arrays) for v in value["t"])
    return {_decode(k, arrays): _decode(v, arrays) for k, v in value["d"]}


def _copy_state(group: Any, obj: Any, src: int, model: DistributedDataParallel) -> None:
    """Broadcast ``obj.state_dict()`` from global rank ``src`` and load it on the others:
    the structure as JSON, then one broadcast per (dtype, host or device)."""
    is_src = group.ranks[group.rank] == src
    arrays: list[Any] = []
    meta: Any = None
    if is_src:
        try:
            tree = _encode(obj.state_dict(), arrays, type(obj).__name__)
            specs = [[a.dtype.str, list(a.shape), isinstance(a, np.ndarray)] for a in arrays]
            meta = {"tree": tree, "arrays": specs}
        except TypeError as exc:
            meta = {"error": str(exc)}
    meta = group.broadcast_object(meta, src)
    if "error" in meta:
        raise TypeError(
            f"{where(collectives.get_rank(), 'ddp.join')}: rank {src}'s {type(obj).__name__} "
            f"state cannot be copied to the other ranks: {meta['error']}"
        )
    specs = meta["arrays"]
    device = next((p.device for p in model.reducer.params if p.device.type != "cpu"), None)
    received: list[Any] = [None] * len(specs)
    kinds: dict[tuple[str, bool], list[int]] = {}
    for i, (dtype, _shape, host) in enumerate(specs):
        kinds.setdefault((dtype, host), []).append(i)
    for (dtype, host), idx in kinds.items():
        xp = np if host or device is None else device.xp
        if is_src:
            flat = xp.concatenate([xp.asarray(arrays[i]).reshape(-1) for i in idx])
        elif host or device is None:
            flat = np.empty(sum(int(np.prod(specs[i][1])) for i in idx), dtype=dtype)
        else:
            with device:
                flat = xp.empty(sum(int(np.prod(specs[i][1])) for i in idx), dtype=dtype)
        if flat.size:
            group.broadcast(flat, src=src)
        start = 0
        for i in idx:
            size = int(np.prod(specs[i][1]))
            if not is_src:
                received[i] = flat[start : start + size].reshape(specs[i][1])
            start += size
    if not is_src:
        obj.load_state_dict(_decode(meta["tree"], received))


def join(
    model: DistributedDataParallel,
    *,
    optimizers: Any = (),
    throw_on_early_termination: bool = False,
    enable: bool = True,
) -> Join:
    """Let ranks with fewer batches finish together with the others (PyTorch's ``Join``).

    Wrap the training loop: a rank whose loop ended shadows the collectives of the ranks that
    still have data until every rank is done. At each synchronized step the gradient is the
    mean, over the ranks that had a batch in that step, of their per-rank mean gradients; a
    rank without data contributes nothing. When the block ends the model's parameters and
    buffers, and the state of ``optimizers``, are copied from the last rank(s) to run out, so
    every rank continues identical (bitwise).

    Every DDP forward inside the block must be followed by a synchronized backward, or run
    under ``model.no_sync()`` or ``tensorlib.no_grad()``; other collectives inside the loop
    (metrics) are not shadowed: issue them after the block.

    Args:
        model: the DistributedDataParallel model.
        optimizers: one or a list of optimizers (or anything with ``state_dict`` and
            ``load_state_dict``: a scheduler, a GradScaler) whose state to copy at the end;
            a rank that ran out missed steps, so its moments and step counts differ.
        throw_on_early_termination: instead, raise on every rank at the first step in which
            some rank has no data (a RuntimeError naming the ranks and the step).
        enable: False makes the block a no-op (as at world size 1).

    Returns:
        The context manager.

    Raises:
        TypeError: ``model`` is not a DistributedDataParallel, or an optimizer lacks
            ``state_dict``/``load_state_dict``.
    """
    return Join(model, optimizers, throw_on_early_termination, enable)
