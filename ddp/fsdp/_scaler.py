"""``GradScaler`` over ``fully_shard`` shards: every rank of a shard group skips together.

An inf/NaN in a gradient reaches, after the reduce-scatter, only the ranks whose rows hold it;
the others' shards look finite. The plain ``tensorlib.amp.GradScaler`` asks this module's
reducer (registered when ``ddp.fsdp`` is imported) whether the optimizer steps shards, and if
so ORs its finding over each shard group with one all-reduce, so that every rank skips (and
backs off) alike, as PyTorch's scaler does over FSDP2's sharded gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from collectives import ProcessGroup, ReduceOp
from tensorlib import Tensor
from tensorlib.amp import register_found_inf_reducer

from ._param import layout_of_shard
from ._unit import shard_of

__all__: list[str] = []


def shard_groups(params: list[Tensor]) -> list[ProcessGroup]:
    """The groups the shards among ``params`` are split over, each once, in the order of their
    first shard (the same on every rank that holds the same model)."""
    groups: dict[int, ProcessGroup] = {}
    for t in params:
        sp = layout_of_shard(t)
        entry = None if sp is None else shard_of(*sp.places[0])
        if entry is not None:
            groups.setdefault(id(entry[0].group), entry[0].group)
    return list(groups.values())


def _agree_over_shards(params: list[Tensor]) -> Callable[[bool], bool] | None:
    groups = [g for g in shard_groups(params) if g.size > 1]
    if not groups:
        return None

    def agree(found: bool) -> bool:
        flag = np.array([1.0 if found else 0.0])
        for g in groups:
            g.all_reduce(flag, op=ReduceOp.MAX)
        return bool(flag[0] > 0)

    return agree


register_found_inf_reducer(_agree_over_shards)
