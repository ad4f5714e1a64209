"""``save``/``load`` of (nested) state dicts as ``.npz`` files, atomically and without pickle.

A file holds one array entry per tensor or array (``a0``, ``a1``, ...) plus ``__manifest__``,
a JSON document (stored as bytes) describing the nesting: dicts, lists, tuples, numbers,
strings, booleans and None. Loading never enables pickle, so a file cannot run code, and
refuses what saving refuses (:func:`_refusal`: dtypes a Tensor cannot hold), so a damaged or
crafted file fails by name instead of loading text or complex numbers as weights.

:func:`state_cast_error` is the dtype rule for copying a loaded state into existing tensors
(``Module.load_state_dict``, ``Optimizer.load_state_dict``): a cast that keeps the kind of
number (float to float, integer to integer when the values fit, bool to bool) or nothing.

Saving writes ``.tmp-{name}-{path hash}-{pid}-{origin}-{random}.npz`` next to the target,
fsyncs it, renames it over the target and fsyncs the directory. A writer killed on the way
leaves its temporary file; the next save to the same path removes those whose writer is
dead: the name says which path, which process, and on which host and pid namespace
(:func:`_origin`) that pid means that process, so a live writer's file is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import secrets
import threading
from typing import Any

import numpy as np

from ._device import Device
from ._device_kinds import kind_of_array
from ._dtype import _NAMES, SUPPORTED
from ._tensor import Tensor

__all__ = ["load", "save", "state_cast_error"]

_FORMAT = "tensorlib.npz/1"
_MANIFEST = "__manifest__"


def _encode(obj: Any, arrays: dict[str, np.ndarray[Any, Any]], path: str) -> Any:
    if isinstance(obj, Tensor):
        obj = obj.numpy()
    if type(obj).__module__.startswith("cupy") or kind_of_array(obj) is not None:
        obj = obj.get()
    if isinstance(obj, np.ndarray):
        reason = _refusal(obj.dtype)
        if reason is not None:
            # load() returns arrays as Tensors, which cannot hold this dtype: refuse it now
            # rather than hand back a Tensor that breaks later.
            raise TypeError(f"save: {path} {reason}; convert it with .astype() first")
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


def _refusal(dtype: np.dtype[Any]) -> str | None:
    """Why an array of ``dtype`` can be neither saved nor loaded, or None when it can: the one
    rule both directions apply (a Tensor holds only the dtypes of ``tensorlib._dtype``)."""
    if dtype.hasobject:
        return "is an object array, which cannot be stored without pickle"
    if dtype not in SUPPORTED:
        return f"has dtype {dtype}, which a Tensor cannot hold (supported: {_NAMES})"
    return None


def _stored_dtype(files: Any, key: str) -> np.dtype[Any] | None:
    """The dtype in the ``.npy`` header of member ``key``, read before its data (an object
    array is never unpickled, a huge refused one never read); None for a header version that
    NumPy has no public reader for (3.0: UTF-8 field names), checked after reading instead."""
    try:
        member = files.zip.open(f"{key}.npy")  # np.savez's name for key; np.load strips .npy
    except KeyError:
        member = files.zip.open(key)
    with member as fp:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(fp)[2]
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(fp)[2]
    return None


def _array(files: Any, key: Any, path: str) -> np.ndarray[Any, Any]:
    """Member ``key`` of the archive, refused (naming ``path``) when save would refuse it."""
    if not isinstance(key, str) or key not in files.files:
        raise ValueError(f"malformed manifest: {path} names array {key!r}, not in the file")
    dtype = _stored_dtype(files, key)
    reason = _refusal(dtype) if dtype is not None else None
    arr: np.ndarray[Any, Any] | None = None
    if reason is None:
        arr = files[key]
        reason = _refusal(arr.dtype)
    if reason is not None or arr is None:
        raise ValueError(
            f"{path} {reason}; tensorlib.save never writes one (the file is damaged or was "
            "not written by tensorlib.save)"
        )
    return arr


def _decode(node: Any, files: Any, device: Device | None, path: str) -> Any:
    if isinstance(node, list):
        return [_decode(v, files, device, f"{path}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, dict):
        if "$array" in node:
            arr = _array(files, node["$array"], path)
            return Tensor(arr, device=device) if device is not None else Tensor._wrap(arr)
        if "$dict" in node:
            return {k: _decode(v, files, device, f"{path}[{k!r}]") for k, v in node["$dict"]}
        if "$tuple" in node:
            return tuple(
                _decode(v, files, device, f"{path}[{i}]") for i, v in enumerate(node["$tuple"])
            )
        if "$float" in node:
            return float(node["$float"])
        raise ValueError(f"malformed manifest node {sorted(node)} at {path}")
    return node


# ---------------------------------------------------------------------------- loading into tensors
def _value_dtype(value: Any) -> np.dtype[Any]:
    dtype = getattr(value, "dtype", None)
    return dtype if isinstance(dtype, np.dtype) else np.asarray(value).dtype


def _int_range(value: Any) -> tuple[int, int]:
    if isinstance(value, Tensor):
        value = value.detach()
        return int(value.min().item()), int(value.max().item())
    arr = value if hasattr(value, "min") else np.asarray(value)
    return int(arr.min()), int(arr.max())


def state_cast_error(value: Any, expected: np.dtype[Any]) -> str | None:
    """Why ``value`` (a state dict's Tensor, array or number) may not be copied into a tensor
    of dtype ``expected``; None when it may. The rule of ``load_state_dict``:

    - float16, float32 and float64 cast among themselves (rounded to the nearest, as
      ``astype`` and PyTorch's ``copy_`` do; beyond float16's range a value becomes inf);
    - integers load into int32/int64 when every value fits (no wrap-around);
    - bool loads into bool only;
    - anything else is refused: an integer or bool array into a float tensor, a float one
      into an integer or bool tensor, and text, complex, object or other dtypes anywhere.
      PyTorch's ``copy_`` would convert the numbers; here such a checkpoint belongs to
      another model or is damaged, so the caller converts explicitly (``.astype``) if meant.

    Returns:
        ``"checkpoint <dtype> vs model <dtype> (why)"``, for the caller to prefix with the key.
    """
    got = _value_dtype(value)
    if got == expected:
        return None
    kinds = {"f": "float", "i": "integer", "u": "integer", "b": "bool"}
    src, dst = kinds.get(got.kind), kinds.get(expected.kind)
    head = f"checkpoint {got} vs model {expected}"
    if src is None or (src == "float" and got not in SUPPORTED):
        return f"{head} (a Tensor cannot hold {got})"
    if src != dst:
        return (
            f"{head} ({src} values do not load into {dst} tensors; only float16/32/64 cast "
            "among themselves, and integers among themselves)"
        )
    empty = getattr(value, "size", None) == 0
    if src == "integer" and not empty and not np.can_cast(got, expected):
        lo, hi = _int_range(value)
        info = np.iinfo(expected)
        if lo < info.min or hi > info.max:
            return f"{head} (values {lo}..{hi} do not fit in {expected})"
    return None


# ---------------------------------------------------------------------------- temp files
@functools.cache  # a process never changes pid namespace (unshare/setns apply to children)
def _origin() -> str:
    """8 hex digits naming this host, boot and pid namespace: where a recorded pid is ours."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        # Cannot tell: a random origin, so no other process ever sweeps this one's files.
        return secrets.token_hex(4)
    return hashlib.sha256(f"{os.uname().nodename}/{boot}/{pidns}".encode()).hexdigest()[:8]


def _path_key(name: str) -> str:
    """A readable cut of a target's file name and a hash of all of it: which temporary files
    belong to which target (a file name of up to 255 bytes leaves no room for more)."""
    cut = re.sub(r"[^A-Za-z0-9_.]", "_", name)[:48]
    return f"{cut}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _temp_name(name: str, pid: int) -> str:
    return f".tmp-{_path_key(name)}-{pid}-{_origin()}-{secrets.token_hex(4)}.npz"


def _pid_gone(pid: int) -> bool:
    """True only when process ``pid`` (of our namespace) has positively exited or is a zombie;
    a pid we may not signal, or reused by another process, counts as alive (conservative)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _sweep_temps(directory: str, name: str) -> None:
    """Remove the temporary files of saves to ``directory/name`` whose writer is dead."""
    stale = re.compile(
        rf"\.tmp-{re.escape(_path_key(name))}-([1-9][0-9]*)-{_origin()}-[0-9a-f]{{8}}\.npz"
    )
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            m = stale.fullmatch(entry.name)
            if m is not None and _pid_gone(int(m.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (where the platform can sync directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # e.g. Windows: directories cannot be opened, renames are journaled
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise  # EIO and the like: the checkpoint may not be on disk
    finally:
        os.close(fd)


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Save a state dict (or any nesting of dicts/lists of tensors, arrays and scalars).

    The file is written to a temporary name in the same directory and fsynced, renamed over
    ``path``, then the directory is fsynced: a crash, even a power loss, leaves under that
    name either the previous file or the complete new one, never a half-written or empty
    one. Temporary files that earlier saves to ``path`` left when their process was killed
    are removed first (never those of a writer still running).

    Raises:
        TypeError: for values that cannot be stored without pickle.
        OSError: when the file cannot be written (the previous file is kept).
    """
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    manifest = {"format": _FORMAT, "root": _encode(obj, arrays, "state")}
    blob = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
    target = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(target))
    _sweep_temps(directory, name)  # frees their space before this save needs it
    while True:
        tmp = os.path.join(directory, _temp_name(name, os.getpid()))
        try:
            # Mode 0o666 less the umask: what a plain open() gives the file.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{_MANIFEST: blob}, **arrays)  # type: ignore[arg-type]
            f.flush()
            # Data on disk before the rename makes it visible under the target's name.
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


# NumPy parses every .npy header with ast.literal_eval, and CPython 3.11's AST constructor is not
# safe in several threads at once ("SystemError: AST constructor recursion depth mismatch",
# CPython gh-106905): rank threads of the threads backend that load a checkpoint together hit
# it. Every parse of a saved array's header in this process holds this lock (re-entrant: a
# load reads several members).
npy_header_lock = threading.RLock()


def load(path: str | os.PathLike[str], device: str | Device | None = None) -> Any:
    """Load what :func:`save` wrote; arrays come back as Tensors (on ``device`` if given).

    An array that :func:`save` would have refused (text, complex, object, unsigned and other
    dtypes a Tensor cannot hold) is refused here too, naming where it sits in the state
    (``state['model']['fc.weight']``) and its dtype, before its data is read.

    Raises:
        ValueError: if the file is not a tensorlib state file, or holds such an array.
    """
    dev = Device(device) if device is not None else None
    with npy_header_lock, np.load(os.fspath(path), allow_pickle=False) as files:
        if _MANIFEST not in files.files:
            raise ValueError(f"load: {os.fspath(path)} is not a tensorlib state file (no manifest)")
        manifest = json.loads(files[_MANIFEST].tobytes().decode())
        if manifest.get("format") != _FORMAT:
            raise ValueError(
                f"load: {os.fspath(path)} has format {manifest.get('format')!r}, "
                f"expected {_FORMAT!r}"
            )
        try:
            return _decode(manifest["root"], files, dev, "state")
        except ValueError as exc:
            raise ValueError(f"load: {os.fspath(path)}: {exc}") from exc
