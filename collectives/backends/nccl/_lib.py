"""A thin ctypes binding of ``libnccl.so.2``: its constants, one declaration per function, errors.

Every function is declared once (:data:`SIGNATURES`) with its ``argtypes``/``restype``; those
newer than the library (per ``ncclGetVersion``) are left unbound and :meth:`Nccl.has` says so.
Finding and loading the library is ``_load``.

:class:`Nccl` wraps a *raw* function table (the bound library, or a fake with the same function
names and C calling convention, see tests/fakes/fake_nccl.py) and turns every non-zero result
into an :class:`NcclError` carrying the code's name, ``ncclGetErrorString`` and
``ncclGetLastError``. Out-parameters are passed as ctypes instances; ctypes adds the pointer
(``byref``) itself for ``POINTER(...)`` argtypes, and a fake receives the instance.

A non-blocking init or split may write the ``ncclComm_t`` *after* it returned: ``ncclCommSplit``
leaves ``*newcomm`` NULL and writes the child's handle from its own thread once the split
completed (NCCL's ``src/init.cc``; NVIDIA/nccl#1472), and NCCL 2.14-2.17 use the caller's
pointer from their init thread. So :meth:`Nccl.comm_init_rank` and :meth:`Nccl.comm_split`
return a :class:`PendingComm` that owns that storage: keep it until the call completed, and
read :attr:`PendingComm.handle` only then (a split: once the *parent* is no longer in progress).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..._types import ReduceOp

__all__ = [
    "API_MAGIC",
    "FLOAT32",
    "INT32",
    "IN_PROGRESS",
    "REMOTE_ERROR",
    "SPLIT_NOCOLOR",
    "SUCCESS",
    "TIMEOUT",
    "UINT8",
    "Config",
    "Nccl",
    "NcclError",
    "NcclUnavailableError",
    "PendingComm",
    "UniqueId",
    "nccl_dtype",
    "nccl_op",
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

# ncclResult_t values the backend acts on (names of all: RESULT_NAMES).
SUCCESS, REMOTE_ERROR, IN_PROGRESS, TIMEOUT = 0, 6, 7, 8
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
INT32 = DTYPES["int32"]
FLOAT32 = DTYPES["float32"]

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


class PendingComm:
    """The ``ncclComm_t`` storage an init or split was given, alive as long as this object.

    NCCL may write the handle into it after the call returned (see the module docstring), so
    whoever started the call keeps this until the call completed (or forever, when it was
    abandoned: 8 bytes, against NCCL writing into freed memory).

    Attributes:
        call: the NCCL function that was given the storage.
        slot: the storage itself (a ``ncclComm_t``).
    """

    __slots__ = ("call", "slot")

    def __init__(self, call: str) -> None:
        self.call = call
        self.slot = ctypes.c_void_p()

    @property
    def handle(self) -> int:
        """The communicator NCCL wrote (0: none yet, or none for this rank)."""
        return int(self.slot.value or 0)

    def __repr__(self) -> str:
        return f"<PendingComm {self.call} {self.handle:#x}>"


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
    def comm_init_rank(self, nranks: int, uid: bytes, rank: int, *, blocking: bool) -> PendingComm:
        """Start ``ncclCommInitRankConfig``; the handle may still be initializing.

        With ``blocking=False`` poll :meth:`comm_get_async_error` on ``result.handle`` until
        it is not in-progress, keeping the result alive meanwhile (NCCL before 2.18 uses its
        storage from the init thread). On failure the half-made communicator is aborted
        before raising.
        """
        pending = PendingComm("ncclCommInitRankConfig")
        config = Config.make(self.version, blocking)
        rc = self.raw.ncclCommInitRankConfig(
            pending.slot, int(nranks), UniqueId.from_bytes(uid), int(rank), config
        )
        if rc != SUCCESS and rc != IN_PROGRESS:
            err = self.error(rc, "ncclCommInitRankConfig", pending.handle)
            if pending.handle:
                self.raw.ncclCommAbort(pending.handle)
            raise err
        return pending

    def comm_split(self, comm: int, color: int, key: int, *, blocking: bool) -> PendingComm:
        """Start ``ncclCommSplit``: every rank of ``comm`` calls it; ``color`` -1 (NOCOLOR)
        takes no part in a new communicator.

        ``blocking`` is the *child's* mode; whether this call blocks is the parent's. With a
        non-blocking parent NCCL returns in-progress and writes the child's handle into the
        result later: poll :meth:`comm_get_async_error` on the *parent* until it is not
        in-progress, keeping the result alive, then read ``result.handle`` (0 for NOCOLOR).
        """
        pending = PendingComm("ncclCommSplit")
        config = Config.make(self.version, blocking)
        rc = self.raw.ncclCommSplit(comm, int(color), int(key), pending.slot, config)
        if rc != SUCCESS and rc != IN_PROGRESS:
            err = self.error(rc, "ncclCommSplit", comm)
            if pending.handle:
                self.raw.ncclCommAbort(pending.handle)
            raise err
        return pending

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
