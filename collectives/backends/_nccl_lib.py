"""A thin ctypes binding of ``libnccl.so.2``: loading, one declaration per function, errors.

Loading (:func:`load`) tries, in order, and remembers the first that works:

1. ``NCCL_LIB_PATH`` when set (a file, or a folder holding ``libnccl.so.2``): an explicit
   choice wins over anything installed;
2. the ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheels (``site-packages/nvidia/nccl/lib``);
3. the system's loader search path (``libnccl.so.2``).

A failure raises :class:`NcclUnavailableError` naming every path tried, why each failed, and
the extra to install. Every function is declared once with its ``argtypes``/``restype``; those
newer than the library (per ``ncclGetVersion``) are left unbound and :meth:`Nccl.has` says so.

:class:`Nccl` wraps a *raw* function table (the bound library, or a fake with the same function
names and C calling convention, see tests/fakes/fake_nccl.py) and turns every non-zero result
into an :class:`NcclError` carrying the code's name, ``ncclGetErrorString`` and
``ncclGetLastError``. Out-parameters are passed as ctypes instances; ctypes adds the pointer
(``byref``) itself for ``POINTER(...)`` argtypes, and a fake receives the instance.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from .._types import ReduceOp

__all__ = [
    "API_MAGIC",
    "IN_PROGRESS",
    "SPLIT_NOCOLOR",
    "SUCCESS",
    "Config",
    "Nccl",
    "NcclError",
    "NcclUnavailableError",
    "UniqueId",
    "candidate_paths",
    "load",
    "nccl_dtype",
    "nccl_op",
    "open_library",
    "result_name",
    "version_code",
    "version_tuple",
]

LIB_NAME = "libnccl.so.2"
INSTALL_HINT = (
    "install the NCCL wheel that matches your CUDA driver: `pip install 'dpt[cuda12]'` (or "
    "`pip install nvidia-nccl-cu12`; `[cuda13]` / nvidia-nccl-cu13 for CUDA 13), or point "
    "NCCL_LIB_PATH at a libnccl.so.2"
)

UNIQUE_ID_BYTES = 128
API_MAGIC = 0xCAFEBEEF
CONFIG_UNDEF_INT = -(2**31)
SPLIT_NOCOLOR = -1

SUCCESS = 0
IN_PROGRESS = 7
RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}

# ncclDataType_t. bool travels as uint8; bfloat16 only where the array type has it.
DTYPES: dict[str, int] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
    "bool": 1,
}
DTYPE_SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
UINT8 = DTYPES["uint8"]

# ncclRedOp_t.
OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: 0,
    ReduceOp.PROD: 1,
    ReduceOp.MAX: 2,
    ReduceOp.MIN: 3,
    ReduceOp.AVG: 4,
}


def version_code(major: int, minor: int, patch: int) -> int:
    """``NCCL_VERSION(major, minor, patch)`` as nccl.h computes it."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def version_tuple(code: int) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version code from ``ncclGetVersion``."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def result_name(code: int) -> str:
    """The ``ncclResult_t`` name of ``code`` (``ncclResult(42)`` for unknown ones)."""
    return RESULT_NAMES.get(code, f"ncclResult({code})")


def nccl_dtype(dtype: Any) -> int:
    """The ``ncclDataType_t`` of a NumPy/CuPy dtype (bool moves as uint8).

    Raises:
        TypeError: for dtypes NCCL cannot move, naming the dtype and the supported ones.
    """
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    code = DTYPES.get(name)
    if code is None:
        raise TypeError(
            f"NCCL cannot move dtype {name}; supported: {', '.join(sorted(DTYPES))} "
            "(bool moves as uint8)"
        )
    return code


def nccl_op(op: ReduceOp) -> int:
    """The ``ncclRedOp_t`` of a :class:`ReduceOp`."""
    return OPS[op]


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, passed by value to ``ncclCommInitRank*``."""

    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        """The 128 raw bytes."""
        return bytes(self)

    @classmethod
    def from_bytes(cls, raw: bytes) -> UniqueId:
        """A unique id holding ``raw`` (exactly 128 bytes).

        Raises:
            ValueError: for any other length.
        """
        if len(raw) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        return cls.from_buffer_copy(raw)


class Config(ctypes.Structure):
    """The leading fields of ``ncclConfig_t`` (2.14+) that this binding sets.

    NCCL copies ``size`` bytes of the caller's struct over its defaults (``NCCL_CONFIG_
    INITIALIZER``) and checks ``magic``; ``version`` tells it which fields the caller knows.
    ``size`` stops right after ``blocking`` (the struct's padding would otherwise overwrite
    ``cgaClusterSize`` with zero).
    """

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
    ]

    @classmethod
    def make(cls, version: int, blocking: bool) -> Config:
        """A config for a library of ``version``, blocking or not."""
        return cls(
            size=cls.blocking.offset + ctypes.sizeof(ctypes.c_int),
            magic=API_MAGIC,
            version=version,
            blocking=1 if blocking else 0,
        )


class NcclError(RuntimeError):
    """An NCCL call returned an error. Picklable, so it survives a process boundary.

    Attributes:
        code: the ``ncclResult_t`` value.
        name: its name (``ncclInvalidUsage``...).
        call: the function that failed.
        error_string: ``ncclGetErrorString(code)``.
        last_error: ``ncclGetLastError`` (NCCL's own detail; may be empty).
    """

    def __init__(self, code: int, call: str, error_string: str = "", last_error: str = "") -> None:
        self.code = code
        self.name = result_name(code)
        self.call = call
        self.error_string = error_string
        self.last_error = last_error
        text = f"{call} failed: {self.name} ({code})"
        if error_string:
            text += f": {error_string}"
        if last_error:
            text += f"; NCCL says: {last_error}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (NcclError, (self.code, self.call, self.error_string, self.last_error))


class NcclUnavailableError(RuntimeError):
    """libnccl.so.2 could not be loaded (the message names every path tried and why)."""


# ---------------------------------------------------------------------------- declarations
_P = ctypes.POINTER
_comm = ctypes.c_void_p
_ptr = ctypes.c_void_p
_int = ctypes.c_int
_size = ctypes.c_size_t
_stream = ctypes.c_void_p

# name: (restype, argtypes, first version that has it)
SIGNATURES: dict[str, tuple[Any, list[Any], int]] = {
    "ncclGetVersion": (_int, [_P(_int)], 0),
    "ncclGetErrorString": (ctypes.c_char_p, [_int], 0),
    "ncclGetLastError": (ctypes.c_char_p, [_comm], version_code(2, 13, 0)),
    "ncclGetUniqueId": (_int, [_P(UniqueId)], 0),
    "ncclCommInitRank": (_int, [_P(_comm), _int, UniqueId, _int], 0),
    "ncclCommInitRankConfig": (
        _int,
        [_P(_comm), _int, UniqueId, _int, _P(Config)],
        version_code(2, 14, 0),
    ),
    "ncclCommSplit": (_int, [_comm, _int, _int, _P(_comm), _P(Config)], version_code(2, 18, 0)),
    "ncclCommFinalize": (_int, [_comm], version_code(2, 14, 0)),
    "ncclCommDestroy": (_int, [_comm], 0),
    "ncclCommAbort": (_int, [_comm], 0),
    "ncclCommGetAsyncError": (_int, [_comm, _P(_int)], 0),
    "ncclCommCount": (_int, [_comm, _P(_int)], 0),
    "ncclCommCuDevice": (_int, [_comm, _P(_int)], 0),
    "ncclCommUserRank": (_int, [_comm, _P(_int)], 0),
    "ncclAllReduce": (_int, [_ptr, _ptr, _size, _int, _int, _comm, _stream], 0),
    "ncclBroadcast": (_int, [_ptr, _ptr, _size, _int, _int, _comm, _stream], 0),
    "ncclReduce": (_int, [_ptr, _ptr, _size, _int, _int, _int, _comm, _stream], 0),
    "ncclAllGather": (_int, [_ptr, _ptr, _size, _int, _comm, _stream], 0),
    "ncclReduceScatter": (_int, [_ptr, _ptr, _size, _int, _int, _comm, _stream], 0),
    "ncclSend": (_int, [_ptr, _size, _int, _int, _comm, _stream], 0),
    "ncclRecv": (_int, [_ptr, _size, _int, _int, _comm, _stream], 0),
    "ncclGroupStart": (_int, [], 0),
    "ncclGroupEnd": (_int, [], 0),
}
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
    get_version.restype, get_version.argtypes = _int, [_P(_int)]
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


# ---------------------------------------------------------------------------- the wrapper
class Nccl:
    """NCCL's API over a raw function table, raising :class:`NcclError` on every failure.

    Args:
        raw: an object whose attributes are NCCL's functions (ctypes-bound or fake).
        version: the library's version code.
        path: where it came from (for messages).
    """

    def __init__(self, raw: Any, version: int, path: str) -> None:
        self.raw = raw
        self.version = version
        self.path = path

    @property
    def version_string(self) -> str:
        """``"2.21.5"``."""
        return ".".join(map(str, version_tuple(self.version)))

    def has(self, name: str) -> bool:
        """Whether the library provides (and this binding declared) function ``name``."""
        return getattr(self.raw, name, None) is not None

    @property
    def can_split(self) -> bool:
        """ncclCommSplit is there (NCCL 2.18+)."""
        return self.version >= version_code(2, 18, 0) and self.has("ncclCommSplit")

    # ------------------------------------------------------------------ errors
    def error_string(self, code: int) -> str:
        """``ncclGetErrorString(code)``."""
        try:
            s = self.raw.ncclGetErrorString(code)
        except Exception:  # a fake without it, or a broken library: the code name still helps
            return ""
        return s.decode("utf-8", "replace") if isinstance(s, bytes) else str(s or "")

    def last_error(self, comm: int | None = None) -> str:
        """``ncclGetLastError(comm)`` (empty when the library predates it)."""
        fn = getattr(self.raw, "ncclGetLastError", None)
        if fn is None:
            return ""
        try:
            s = fn(comm)
        except Exception:
            return ""
        return s.decode("utf-8", "replace") if isinstance(s, bytes) else str(s or "")

    def error(self, code: int, call: str, comm: int | None = None) -> NcclError:
        """The exception for result ``code`` of ``call``."""
        return NcclError(code, call, self.error_string(code), self.last_error(comm))

    def check(self, code: int, call: str, comm: int | None = None) -> int:
        """Raise :class:`NcclError` unless ``code`` is success or in-progress; return it."""
        if code != SUCCESS and code != IN_PROGRESS:
            raise self.error(code, call, comm)
        return code

    # ------------------------------------------------------------------ library-wide
    def get_unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (rank 0 makes it; every rank passes it to init)."""
        uid = UniqueId()
        rc = self.raw.ncclGetUniqueId(uid)
        if rc != SUCCESS:
            raise self.error(rc, "ncclGetUniqueId")
        return uid.to_bytes()

    def group_start(self) -> None:
        """``ncclGroupStart()``."""
        rc = self.raw.ncclGroupStart()
        if rc != SUCCESS:
            raise self.error(rc, "ncclGroupStart")

    def group_end(self) -> int:
        """``ncclGroupEnd()``; returns success or in-progress (non-blocking communicators)."""
        return self.check(self.raw.ncclGroupEnd(), "ncclGroupEnd")

    # ------------------------------------------------------------------ communicators
    def comm_init_rank(self, nranks: int, uid: bytes, rank: int, *, blocking: bool) -> int:
        """Start ``ncclCommInitRankConfig``; the handle may still be initializing.

        With ``blocking=False`` poll :meth:`comm_get_async_error` until it is not
        in-progress. On failure the half-made communicator is aborted before raising.
        """
        comm = ctypes.c_void_p()
        config = Config.make(self.version, blocking)
        rc = self.raw.ncclCommInitRankConfig(
            comm, int(nranks), UniqueId.from_bytes(uid), int(rank), config
        )
        if rc != SUCCESS and rc != IN_PROGRESS:
            err = self.error(rc, "ncclCommInitRankConfig", comm.value)
            if comm.value:
                self.raw.ncclCommAbort(comm.value)
            raise err
        return int(comm.value or 0)

    def comm_split(self, comm: int, color: int, key: int, *, blocking: bool) -> int:
        """Start ``ncclCommSplit``: every rank of ``comm`` calls it; ``color`` -1 (NOCOLOR)
        takes no part in a new communicator and gets 0 back."""
        new = ctypes.c_void_p()
        config = Config.make(self.version, blocking)
        rc = self.raw.ncclCommSplit(comm, int(color), int(key), new, config)
        if rc != SUCCESS and rc != IN_PROGRESS:
            err = self.error(rc, "ncclCommSplit", comm)
            if new.value:
                self.raw.ncclCommAbort(new.value)
            raise err
        return int(new.value or 0)

    def comm_get_async_error(self, comm: int) -> int:
        """The communicator's state: success, in-progress, or the error it hit."""
        state = ctypes.c_int()
        rc = self.raw.ncclCommGetAsyncError(comm, state)
        if rc != SUCCESS:
            raise self.error(rc, "ncclCommGetAsyncError", comm)
        return int(state.value)

    def comm_finalize(self, comm: int) -> int:
        """``ncclCommFinalize``: flush; success or in-progress (then poll)."""
        return self.check(self.raw.ncclCommFinalize(comm), "ncclCommFinalize", comm)

    def comm_destroy(self, comm: int) -> None:
        """``ncclCommDestroy`` (after a completed finalize it does not block)."""
        self.check(self.raw.ncclCommDestroy(comm), "ncclCommDestroy", comm)

    def comm_abort(self, comm: int) -> None:
        """``ncclCommAbort``: stop everything in flight and free the communicator."""
        self.check(self.raw.ncclCommAbort(comm), "ncclCommAbort", comm)

    def _int_query(self, name: str, comm: int) -> int:
        out = ctypes.c_int()
        rc = getattr(self.raw, name)(comm, out)
        if rc != SUCCESS:
            raise self.error(rc, name, comm)
        return int(out.value)

    def comm_count(self, comm: int) -> int:
        """``ncclCommCount``."""
        return self._int_query("ncclCommCount", comm)

    def comm_cu_device(self, comm: int) -> int:
        """``ncclCommCuDevice``."""
        return self._int_query("ncclCommCuDevice", comm)

    def comm_user_rank(self, comm: int) -> int:
        """``ncclCommUserRank``."""
        return self._int_query("ncclCommUserRank", comm)

    # ------------------------------------------------------------------ operations
    # Each returns NCCL's result (success or in-progress) and raises on errors. Pointers are
    # ints (device addresses); ``stream`` is a cudaStream_t as an int.
    def all_reduce(
        self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int
    ) -> int:
        """``ncclAllReduce``."""
        rc = self.raw.ncclAllReduce(send, recv, count, dtype, op, comm, stream)
        return rc if rc == SUCCESS else self.check(rc, "ncclAllReduce", comm)

    def broadcast(
        self, send: int, recv: int, count: int, dtype: int, root: int, comm: int, stream: int
    ) -> int:
        """``ncclBroadcast``."""
        rc = self.raw.ncclBroadcast(send, recv, count, dtype, root, comm, stream)
        return rc if rc == SUCCESS else self.check(rc, "ncclBroadcast", comm)

    def reduce(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: int,
        op: int,
        root: int,
        comm: int,
        stream: int,
    ) -> int:
        """``ncclReduce``."""
        rc = self.raw.ncclReduce(send, recv, count, dtype, op, root, comm, stream)
        return rc if rc == SUCCESS else self.check(rc, "ncclReduce", comm)

    def all_gather(
        self, send: int, recv: int, sendcount: int, dtype: int, comm: int, stream: int
    ) -> int:
        """``ncclAllGather``."""
        rc = self.raw.ncclAllGather(send, recv, sendcount, dtype, comm, stream)
        return rc if rc == SUCCESS else self.check(rc, "ncclAllGather", comm)

    def reduce_scatter(
        self, send: int, recv: int, recvcount: int, dtype: int, op: int, comm: int, stream: int
    ) -> int:
        """``ncclReduceScatter``."""
        rc = self.raw.ncclReduceScatter(send, recv, recvcount, dtype, op, comm, stream)
        return rc if rc == SUCCESS else self.check(rc, "ncclReduceScatter", comm)

    def send(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> int:
        """``ncclSend``."""
        rc = self.raw.ncclSend(buf, count, dtype, peer, comm, stream)
        return rc if rc == SUCCESS else self.check(rc, "ncclSend", comm)

    def recv(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> int:
        """``ncclRecv``."""
        rc = self.raw.ncclRecv(buf, count, dtype, peer, comm, stream)
        return rc if rc == SUCCESS else self.check(rc, "ncclRecv", comm)


def describe_environment(lib: Nccl | None = None) -> dict[str, Any]:
    """Version and origin of the loaded library (for ``show_config`` and the GPU check)."""
    try:
        n = lib or load()
    except NcclUnavailableError as exc:
        return {"nccl": None, "reason": str(exc)}
    return {"nccl": n.version_string, "version_code": n.version, "path": n.path}
