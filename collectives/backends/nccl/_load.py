"""Finding and loading ``libnccl.so.2``, once per process.

:func:`load` tries, in order, and remembers the first that works:

1. ``NCCL_LIB_PATH`` when set (a file, or a folder holding ``libnccl.so.2``): an explicit
   choice wins over anything installed;
2. the ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheels (``site-packages/nvidia/nccl/lib``);
3. the system's loader search path (``libnccl.so.2``).

A failure raises :class:`~._nccl_lib.NcclUnavailableError` naming every path tried, why each
failed, and the extra to install. Tests put a fake library in place with :func:`install`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from ._lib import (
    INSTALL_HINT,
    LIB_NAME,
    SIGNATURES,
    SUCCESS,
    Nccl,
    NcclUnavailableError,
    result_name,
    version_code,
    version_tuple,
)

__all__ = ["candidate_paths", "install", "load", "open_library", "unavailable_reason"]

MIN_VERSION = version_code(2, 14, 0)  # ncclCommInitRankConfig: non-blocking init


def candidate_paths(environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """Where :func:`load` looks, in order: ``(path or soname, where it comes from)``."""
    env = os.environ if environ is None else environ
    out: list[tuple[str, str]] = []
    explicit = env.get("NCCL_LIB_PATH", "").strip()
    if explicit:
        p = Path(explicit)
        out.append((str(p / LIB_NAME) if p.is_dir() else str(p), "NCCL_LIB_PATH"))
    seen: set[str] = set()
    for base in _nvidia_dirs():
        cand = str(Path(base) / "nccl" / "lib" / LIB_NAME)
        if cand not in seen:
            seen.add(cand)
            out.append((cand, "nvidia-nccl wheel"))
    out.append((LIB_NAME, "system loader path"))
    return out


def _nvidia_dirs() -> list[str]:
    """The ``nvidia`` namespace package's folders (where NVIDIA's wheels install)."""
    dirs: list[str] = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        dirs.extend(str(p) for p in getattr(nvidia, "__path__", []))
    except ImportError:
        pass
    for entry in sys.path:
        cand = Path(entry or ".") / "nvidia"
        if cand.is_dir() and str(cand) not in dirs:
            dirs.append(str(cand))
    return dirs


def _bind(lib: ctypes.CDLL) -> tuple[SimpleNamespace, int]:
    """Declare every function the library has, once; skip those newer than it."""
    get_version = lib.ncclGetVersion
    get_version.restype, get_version.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]
    v = ctypes.c_int()
    rc = get_version(v)
    if rc != SUCCESS:
        raise NcclUnavailableError(f"ncclGetVersion failed with {result_name(rc)}")
    raw = SimpleNamespace()
    for name, (restype, argtypes, since) in SIGNATURES.items():
        if v.value < since:
            continue
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype = restype
        fn.argtypes = argtypes
        setattr(raw, name, fn)
    return raw, v.value


_lock = threading.Lock()
_loaded: Nccl | None = None
_failure: NcclUnavailableError | None = None


def load() -> Nccl:
    """The process's NCCL, loaded on first use (or the one :func:`install` put in place).

    Raises:
        NcclUnavailableError: no libnccl.so.2 could be loaded, or it is older than 2.14.
    """
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failure is not None:
            raise _failure
        try:
            _loaded = open_library()
        except NcclUnavailableError as exc:
            _failure = exc
            raise
        return _loaded


def open_library(candidates: list[tuple[str, str]] | None = None) -> Nccl:
    """Load and bind the first usable library among ``candidates`` (default:
    :func:`candidate_paths`), without touching the process's cached one.

    Raises:
        NcclUnavailableError: none could be loaded; the message names each path and why.
    """
    tried: list[str] = []
    for path, origin in candidate_paths() if candidates is None else candidates:
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} ({origin}): not found")
            continue
        try:
            # RTLD_LOCAL: another libnccl.so.2 in the process (CuPy's) keeps its own symbols.
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            raw, version = _bind(lib)
        except (OSError, AttributeError, NcclUnavailableError) as exc:
            tried.append(f"{path} ({origin}): {exc}")
            continue
        if version < MIN_VERSION:
            tried.append(
                f"{path} ({origin}): NCCL {'.'.join(map(str, version_tuple(version)))} is "
                "older than 2.14 (non-blocking communicator init)"
            )
            continue
        return Nccl(raw, version, path)
    raise NcclUnavailableError(
        "could not load libnccl.so.2; tried:\n  " + "\n  ".join(tried) + "\nTo fix: "
        f"{INSTALL_HINT}."
    )


def install(nccl: Nccl | None) -> Nccl | None:
    """Replace the process's NCCL (tests install a fake); None forgets it. Returns the old one."""
    global _loaded, _failure
    with _lock:
        old = _loaded
        _loaded = nccl
        _failure = None
        return old


def unavailable_reason() -> str | None:
    """Why NCCL cannot be loaded here, or None when it can."""
    try:
        load()
    except NcclUnavailableError as exc:
        return str(exc)
    return None
