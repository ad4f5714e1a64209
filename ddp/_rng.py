"""The random generators' states of one process, as JSON-able data (for checkpoints).

What a training script draws from: tensorlib's default generator (initialization, dropout),
NumPy's legacy global generator (``np.random.rand`` and friends), Python's ``random`` module,
and any ``numpy.random.Generator`` objects the script passes along explicitly. Each state is
turned into dicts, lists, strings and ints (NumPy arrays become tagged lists), so it can travel
through ``collectives.all_gather_object`` (JSON, no pickle) and into a ``tensorlib.save`` file.

tensorlib's CUDA generators (CuPy, one per GPU, seeded from the host stream on first use) keep
their state on the device and are not captured; :func:`capture` records how many there were so
that a restore can say so.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np

import tensorlib as tl

__all__ = ["capture", "check_generators", "restore"]

_ARRAY = "$ndarray"  # tag of an encoded NumPy array: {"$ndarray": dtype, "values": [...]}


def check_generators(where: str, generators: Any) -> list[np.random.BitGenerator]:
    """The bit generators behind ``generators`` (NumPy ``Generator`` or ``BitGenerator`` objects).

    Raises:
        TypeError: when ``generators`` is not a list/tuple of them.
    """
    if not isinstance(generators, list | tuple):
        raise TypeError(
            f"{where}: generators must be a list or tuple of numpy.random.Generator objects, "
            f"got {type(generators).__name__}"
        )
    out = []
    for i, g in enumerate(generators):
        if isinstance(g, np.random.Generator):
            out.append(g.bit_generator)
        elif isinstance(g, np.random.BitGenerator):
            out.append(g)
        else:
            raise TypeError(
                f"{where}: generators[{i}] is {type(g).__name__}, expected a "
                "numpy.random.Generator (np.random.default_rng(...)) or a BitGenerator"
            )
    return out


def _to_json(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {_ARRAY: value.dtype.str, "values": value.tolist()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_ARRAY, "values"}:
            return np.array(value["values"], dtype=np.dtype(value[_ARRAY]))
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def capture(generators: Sequence[np.random.BitGenerator] = ()) -> dict[str, Any]:
    """This process's generator states as JSON-able data (see the module docstring)."""
    version, internal, gauss = random.getstate()
    return {
        "tensorlib": _to_json(tl.default_generator.get_state()),
        "numpy": _to_json(np.random.get_state(legacy=False)),
        "python": [version, list(internal), gauss],
        "generators": [_to_json(g.state) for g in generators],
        # Device-side states are not captured; a restore reports that they were in use.
        "cuda_generators": len(getattr(tl.default_generator, "_cuda", {})),
    }


def restore(
    where: str, state: dict[str, Any], generators: Sequence[np.random.BitGenerator] = ()
) -> None:
    """Set this process's generators to a :func:`capture` state (``generators`` in order).

    Raises:
        ValueError: when the state is malformed or holds another number of generators.
    """
    saved = state.get("generators", []) if isinstance(state, dict) else None
    if not isinstance(saved, list) or not all(k in state for k in ("tensorlib", "numpy", "python")):
        raise ValueError(f"{where}: the random generator state is malformed: {state!r:.200}")
    if len(saved) != len(generators):
        raise ValueError(
            f"{where}: the checkpoint holds {len(saved)} numpy generator state(s) but "
            f"generators= has {len(generators)}; pass the same generators, in the same order, "
            "as to save_checkpoint"
        )
    decoded = [_from_json(s) for s in saved]
    for g, s in zip(generators, decoded, strict=True):
        if s.get("bit_generator") != type(g).__name__:
            raise ValueError(
                f"{where}: a saved numpy generator is {s.get('bit_generator')!r}, the one given "
                f"in its place is {type(g).__name__}"
            )
    tl.default_generator.set_state(_from_json(state["tensorlib"]))
    np.random.set_state(_from_json(state["numpy"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    for g, s in zip(generators, decoded, strict=True):
        g.state = s
