"""Pairing a saved optimizer state dict's parameters with an optimizer's, as
``Optimizer.load_state_dict`` pairs them (group by group, in order)."""

from __future__ import annotations

from typing import Any

__all__ = ["match_param_groups"]


def match_param_groups(saved: Any, own: list[dict[str, Any]]) -> dict[int, int]:
    """Saved parameter index -> this optimizer's (index over all its groups), as
    ``Optimizer.load_state_dict`` pairs them.

    Raises:
        ValueError: when the group or parameter counts differ.
    """
    if not isinstance(saved, list) or len(saved) != len(own):
        count = len(saved) if isinstance(saved, list) else saved
        raise ValueError(f"the checkpoint has {count} parameter groups, this optimizer {len(own)}")
    by_index: dict[int, int] = {}
    at = 0
    for k, (g_saved, g_own) in enumerate(zip(saved, own, strict=True)):
        if len(g_saved["params"]) != len(g_own["params"]):
            raise ValueError(
                f"parameter group {k} has {len(g_saved['params'])} parameters in the checkpoint, "
                f"{len(g_own['params'])} in this optimizer"
            )
        for j, i in enumerate(g_saved["params"]):
            by_index[int(i)] = at + j
        at += len(g_own["params"])
    return by_index
