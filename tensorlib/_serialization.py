"""``save``/``load`` of (nested) state dicts as ``.npz`` files, atomically and without pickle.

A file holds one array entry per tensor or array (``a0``, ``a1``, ...) plus ``__manifest__``,
a JSON document (stored as bytes) describing the nesting: dicts, lists, tuples, numbers,
strings, booleans and None. Loading never enables pickle, so a file cannot run code.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import numpy as np

from ._device import Device
from ._dtype import SUPPORTED
from ._tensor import Tensor

__all__ = ["load", "save"]

_FORMAT = "tensorlib.npz/1"
_MANIFEST = "__manifest__"


def _encode(obj: Any, arrays: dict[str, np.ndarray[Any, Any]], path: str) -> Any:
    if isinstance(obj, Tensor):
        obj = obj.numpy()
    if type(obj).__module__.startswith("cupy"):
        obj = obj.get()
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(
                f"save: {path} is an object array, which cannot be saved without pickle"
            )
        if obj.dtype not in SUPPORTED:
            # load() returns arrays as Tensors, which cannot hold this dtype: refuse it now
            # rather than hand back a Tensor that breaks later.
            raise TypeError(
                f"save: {path} has dtype {obj.dtype}, which a Tensor cannot hold (supported: "
                "float16, float32, float64, int32, int64, bool); convert it with .astype() first"
            )
        key = f"a{len(arrays)}"
        arrays[key] = obj
        return {"$array": key}
    if isinstance(obj, np.generic):
        obj = obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        if isinstance(obj, float) and not np.isfinite(obj):
            return {"$float": repr(obj)}
        return obj
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, str | int) or isinstance(k, bool):
                raise TypeError(f"save: dict keys must be str or int, got {k!r} at {path}")
            items.append([k, _encode(v, arrays, f"{path}[{k!r}]")])
        return {"$dict": items}
    if isinstance(obj, list | tuple):
        enc = [_encode(v, arrays, f"{path}[{i}]") for i, v in enumerate(obj)]
        return {"$tuple": enc} if isinstance(obj, tuple) else enc
    raise TypeError(f"save: cannot save {type(obj).__name__} at {path} (no pickle)")


def _decode(node: Any, files: Any, device: Device | None) -> Any:
    if isinstance(node, list):
        return [_decode(v, files, device) for v in node]
    if isinstance(node, dict):
        if "$array" in node:
            arr = files[node["$array"]]
            return Tensor(arr, device=device) if device is not None else Tensor._wrap(arr)
        if "$dict" in node:
            return {k: _decode(v, files, device) for k, v in node["$dict"]}
        if "$tuple" in node:
            return tuple(_decode(v, files, device) for v in node["$tuple"])
        if "$float" in node:
            return float(node["$float"])
        raise ValueError(f"load: malformed manifest node {sorted(node)}")
    return node


def _umask() -> int:
    # Read the umask without changing it (os.umask would, for a moment, for every thread).
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Save a state dict (or any nesting of dicts/lists of tensors, arrays and scalars).

    The file is written to a temporary name in the same directory, flushed to disk, then
    renamed over ``path``, so a crash never leaves a half-written file under that name.

    Raises:
        TypeError: for values that cannot be stored without pickle.
    """
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    manifest = {"format": _FORMAT, "root": _encode(obj, arrays, "state")}
    blob = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{_MANIFEST: blob}, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file 0600; give it the mode a plain open() would (umask applies).
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load(path: str | os.PathLike[str], device: str | Device | None = None) -> Any:
    """Load what :func:`save` wrote; arrays come back as Tensors (on ``device`` if given).

    Raises:
        ValueError: if the file is not a tensorlib state file.
    """
    dev = Device(device) if device is not None else None
    with np.load(os.fspath(path), allow_pickle=False) as files:
        if _MANIFEST not in files.files:
            raise ValueError(f"load: {os.fspath(path)} is not a tensorlib state file (no manifest)")
        manifest = json.loads(files[_MANIFEST].tobytes().decode())
        if manifest.get("format") != _FORMAT:
            raise ValueError(
                f"load: {os.fspath(path)} has format {manifest.get('format')!r}, "
                f"expected {_FORMAT!r}"
            )
        return _decode(manifest["root"], files, dev)
