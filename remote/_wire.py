"""The remote wire protocol: its specification, the fixed op table, and the values' codec.

Both ends build and parse every message with the protocol modules at the top of ``remote``
(``client`` and ``server`` never write or read a byte of the format themselves): this one
(frames, the op and dtype tables, values), ``_handshake`` (a connection's first frames) and
``_records`` (a session's records and replies). Nothing from the wire is unpickled,
evaluated or looked up by name: an op is a number that indexes :data:`OPS`, a dtype a number
that indexes :data:`DTYPES`. A reviewer auditing the format needs these three files.

Frames
------
Every message is a frame of ``collectives.framing`` (the rendezvous store's too): a 4-byte
big-endian payload length ``n`` (``1 <= n <= MAX_FRAME_BYTES``; ``MAX_HELLO_FRAME`` before
the handshake is done) and ``n`` bytes. With a token, every frame after the handshake ends in
a 32-byte tag ``HMAC-SHA256(session key, direction + big-endian u64 seq + payload)``
(direction ``b"C"`` from the client, ``b"S"`` from the server, ``seq`` counting that
direction's frames from 0), counted by the length: a frame altered, dropped, replayed or
reordered fails its tag and the connection is closed. Inside a frame everything is
little-endian, and the first payload byte is the frame's kind (the table below).

A session with a memory limit (``max_session_bytes``) reads a frame of up to
``SMALL_FRAME_BYTES`` whatever it holds, and a longer one only while it could hold that frame
twice over (the frame, and the arrays decoded from it). A longer frame is refused from its
header, before its body is read: the server answers a REPLY to request 0 (``_records``) that
says why, reads the rest of the frame without keeping it, and closes the connection. The
client keeps its frames below ``SMALL_FRAME_BYTES`` (a large array goes up in pieces:
``_records``).

Values
------
A u8 tag and its body: NONE, FALSE, TRUE, INT (i64), FLOAT (f64), REF (u32 id), TUPLE (u16 n
+ n values), SLICE (3 INT or NONE), ELLIPSIS, DTYPE (u8 code), IDS (u32 n + n u32 ids: a
tuple of REFs, packed), ARRAY (u8 dtype, u8 ndim, ndim x u64 dims, the C-order little-endian
bytes). No strings: an op's arguments are numbers, ids, dtypes and arrays only. A ``str``
elsewhere is ``u32 n`` + UTF-8.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

PROTOCOL_VERSION = 3
MAX_FRAME_BYTES = 1 << 30
# A session's frame this long is read whatever the session holds (its memory limit's slack);
# the client sends an array larger than PIECE_BYTES in pieces of at most that, so that its
# frames stay below it.
SMALL_FRAME_BYTES = 1 << 22
PIECE_BYTES = 1 << 20
MAX_HELLO_FRAME = 256
MAX_NDIM = 32
MAX_NEST = 8

# Frame kinds (the first payload byte): the handshake's (``_handshake``), then a session's.
HELLO, LIST, RECORDS = 0x01, 0x02, 0x03
WELCOME, DEVICES, REPLY, HEARTBEAT, REFUSED = 0x10, 0x11, 0x12, 0x13, 0x14

# The fixed op table: a record's op code is an index here, on both ends.
OPS: tuple[str, ...] = (
    # session
    "drop", "read", "sync", "upload",
    # creation
    "full", "arange",
    # binary ufuncs
    "add", "subtract", "multiply", "true_divide", "floor_divide", "remainder", "power",
    "maximum", "minimum", "equal", "not_equal", "less", "less_equal", "greater",
    "greater_equal", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_xor", "arctan2",
    # unary ufuncs
    "negative", "positive", "absolute", "exp", "log", "sqrt", "tanh", "sign", "isfinite",
    "isnan", "isinf", "logical_not", "invert", "square", "sin", "cos", "log1p", "expm1",
    "floor", "ceil", "reciprocal",
    # reductions
    "sum", "mean", "max", "min", "any", "all", "argmax", "argmin", "prod",
    # linear algebra
    "matmul",
    # movement and the rest
    "reshape", "transpose", "broadcast_to", "expand_dims", "squeeze", "swapaxes", "getitem",
    "setitem", "concatenate", "stack", "copy", "astype", "fill", "where", "clip", "add_at",
    # fused ops (one record for what tensorlib would issue as many ops)
    "adam", "linear", "linear_grad", "cross_entropy", "cross_entropy_grad", "relu_grad",
    # collectives among sessions of one server (remote.server._collective)
    "collective",
)  # fmt: skip
OP_CODES: dict[str, int] = {name: i for i, name in enumerate(OPS)}
BINARY_UFUNCS = OPS[OP_CODES["add"] : OP_CODES["arctan2"] + 1]
UNARY_UFUNCS = OPS[OP_CODES["negative"] : OP_CODES["reciprocal"] + 1]
REDUCTIONS = OPS[OP_CODES["sum"] : OP_CODES["prod"] + 1]
DROP, READ, SYNC, UPLOAD = 0, 1, 2, 3
ADAM = OP_CODES["adam"]
# ADAM's leading values, in record order: tensorlib.optim.adam_update's keyword arguments
# (numbers, then booleans), by which both ends build and read them.
ADAM_NUMBERS = ("lr", "beta1", "beta2", "eps", "weight_decay")
ADAM_FLAGS = ("decoupled", "maximize")
ADAM_HYPER = ADAM_NUMBERS + ADAM_FLAGS
# A loss's reduction, as CROSS_ENTROPY's INT code indexes it.
LOSS_REDUCTIONS = ("none", "sum", "mean")
# The collectives and reductions a COLLECTIVE record names, by its INT kind and reduce op.
KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all")
REDUCE_OPS = ("sum", "avg", "prod", "min", "max")
# Results an op makes, by op code: ids ``out`` .. ``out + n - 1`` (1 for all but these).
OUTPUTS: tuple[int, ...] = tuple(
    {"linear_grad": 3, "cross_entropy": 2}.get(name, 1) for name in OPS
)

DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(n)
    for n in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64",
    )
)  # fmt: skip
DTYPE_CODES: dict[np.dtype[Any], int] = {dt: i for i, dt in enumerate(DTYPES)}

# Value tags.
T_NONE, T_FALSE, T_TRUE, T_INT, T_FLOAT, T_REF, T_TUPLE, T_SLICE = range(8)
T_ELLIPSIS, T_DTYPE, T_IDS, T_ARRAY = range(8, 12)

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
F64 = struct.Struct("<d")
TAG_REF = struct.Struct("<BI")  # a REF value (the IDS value's head too)
TAG_FLOAT = struct.Struct("<Bd")
_TAG_INT = struct.Struct("<Bq")
_TAG_U16 = struct.Struct("<BH")
_ARRAY_HEAD = struct.Struct("<BBB")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_I64_AT, _F64_AT, _U32_AT = I64.unpack_from, F64.unpack_from, U32.unpack_from
SMALL = (None, False, True)  # NONE, FALSE, TRUE by tag


class ProtocolError(Exception):
    """A malformed frame or value (the receiving end closes the connection)."""


class Handle:
    """Base of the client's array handles: the codec sends one as a REF to its ``_id``."""

    __slots__ = ("_id",)
    _id: int


class Ref(int):
    """A REF decoded on the server: the id of an array in the session's table."""

    __slots__ = ()


# ---------------------------------------------------------------------------- values
def put(parts: list[bytes], v: Any, depth: int = 0) -> None:
    """Append the encoding of ``v`` to ``parts``.

    Raises:
        TypeError: for a value the protocol cannot carry.
    """
    t = type(v)
    if isinstance(v, Handle):
        parts.append(TAG_REF.pack(T_REF, v._id))
    elif t is float:
        parts.append(TAG_FLOAT.pack(T_FLOAT, v))
    elif t is bool:
        parts.append(U8.pack(T_TRUE if v else T_FALSE))
    elif t is int:
        if not _I64_MIN <= v <= _I64_MAX:
            raise TypeError(f"integer {v} does not fit in 64 bits")
        parts.append(_TAG_INT.pack(T_INT, v))
    elif v is None:
        parts.append(U8.pack(T_NONE))
    elif t is tuple or t is list:
        if depth >= MAX_NEST or len(v) > 0xFFFF:
            raise TypeError("sequence nested too deep or too long for the remote protocol")
        parts.append(_TAG_U16.pack(T_TUPLE, len(v)))
        for x in v:
            put(parts, x, depth + 1)
    elif t is slice:
        parts.append(U8.pack(T_SLICE))
        for x in (v.start, v.stop, v.step):
            put(parts, _plain_int(x), depth + 1)
    elif v is Ellipsis:
        parts.append(U8.pack(T_ELLIPSIS))
    elif t is Ids:
        if len(v.handles) > 0xFFFF:
            raise TypeError("too many ids for one IDS value")
        parts.append(ids_value([h._id for h in v.handles]))
    elif isinstance(v, np.dtype):
        parts.append(U8.pack(T_DTYPE))
        parts.append(U8.pack(dtype_code(v)))
    elif isinstance(v, np.ndarray | np.generic):
        put_array(parts, np.asarray(v))
    elif isinstance(v, np.integer | np.floating | np.bool_):  # pragma: no cover - np.generic
        put(parts, v.item(), depth)
    else:
        raise TypeError(f"a {type(v).__name__} cannot be sent to a remote device")


def _plain_int(x: Any) -> Any:
    if x is None or type(x) is int or isinstance(x, Handle):
        return x
    if isinstance(x, np.integer):
        return int(x)
    if hasattr(x, "__index__"):
        return x.__index__()
    raise TypeError(f"slice indices must be integers or None, got {type(x).__name__}")


def dtype_code(dt: np.dtype[Any]) -> int:
    """The wire code of ``dt``.

    Raises:
        TypeError: for a dtype the protocol does not carry.
    """
    code = DTYPE_CODES.get(dt)
    if code is None:
        raise TypeError(f"dtype {dt} cannot be sent to a remote device")
    return code


def put_array(parts: list[bytes], a: np.ndarray[Any, Any]) -> None:
    """Append an ARRAY value (C order, little-endian)."""
    head, data = array_parts(a)
    parts.append(head)
    parts.append(data.tobytes())


def array_parts(a: np.ndarray[Any, Any]) -> tuple[bytes, np.ndarray[Any, Any]]:
    """An ARRAY value as its head and its data: a view of ``a`` where ``a`` is already C
    order and little-endian (no copy; for a frame sent at once, before ``a`` may change),
    else a converted copy."""
    if a.ndim > MAX_NDIM:
        raise TypeError(f"arrays of more than {MAX_NDIM} dimensions cannot be sent")
    code = dtype_code(a.dtype.newbyteorder("=") if a.dtype.byteorder == ">" else a.dtype)
    a = np.asarray(a, dtype=DTYPES[code].newbyteorder("<"))
    if not a.flags.c_contiguous:  # (not ascontiguousarray: it makes 0-d arrays 1-d)
        a = a.copy(order="C")
    head = _ARRAY_HEAD.pack(T_ARRAY, code, a.ndim)
    if a.ndim:
        head += struct.pack(f"<{a.ndim}Q", *a.shape)
    return head, a.reshape(-1).view(np.uint8)


class Reader:
    """Parses one payload; every violation raises :class:`ProtocolError`."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int = 0) -> None:
        self.buf = memoryview(buf)
        self.pos = pos

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise ProtocolError(f"truncated frame: wanted {n} bytes at offset {self.pos}")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        end = self.pos + st.size
        if end > len(self.buf):
            raise ProtocolError(f"truncated frame: wanted {st.size} bytes at offset {self.pos}")
        out = st.unpack_from(self.buf, self.pos)
        self.pos = end
        return out

    def u8(self) -> int:
        return int(self.unpack(U8)[0])

    def u16(self) -> int:
        return int(self.unpack(U16)[0])

    def u32(self) -> int:
        return int(self.unpack(U32)[0])

    def str(self) -> str:
        n = self.u32()
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError("a string that is not UTF-8") from exc

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise ProtocolError(f"{len(self.buf) - self.pos} trailing bytes in a frame")

    def value(self, depth: int = 0) -> Any:
        """The next value (REF as :class:`Ref`, ARRAY as a fresh NumPy array)."""
        buf, pos = self.buf, self.pos
        if pos >= len(buf):
            raise ProtocolError(f"truncated frame: wanted a value at offset {pos}")
        tag = buf[pos]
        if tag <= T_TRUE:
            self.pos = pos + 1
            return SMALL[tag]
        if tag in (T_INT, T_FLOAT, T_REF):
            size = 5 if tag == T_REF else 9
            if pos + size > len(buf):
                raise ProtocolError(f"truncated frame: wanted {size} bytes at offset {pos}")
            self.pos = pos + size
            if tag == T_INT:
                return _I64_AT(buf, pos + 1)[0]
            if tag == T_FLOAT:
                return _F64_AT(buf, pos + 1)[0]
            return Ref(_U32_AT(buf, pos + 1)[0])
        self.pos = pos + 1
        if tag == T_TUPLE:
            if depth >= MAX_NEST:
                raise ProtocolError("values nested too deep")
            return tuple([self.value(depth + 1) for _ in range(self.u16())])
        if tag == T_SLICE:
            parts = [self.value(depth + 1) for _ in range(3)]
            if any(p is not None and type(p) is not int for p in parts):
                raise ProtocolError("a slice whose bounds are not integers")
            return slice(*parts)
        if tag == T_ELLIPSIS:
            return Ellipsis
        if tag == T_DTYPE:
            return self.dtype()
        if tag == T_IDS:
            n = self.u32()
            return tuple(map(Ref, struct.unpack_from(f"<{n}I", self.take(4 * n))))
        if tag == T_ARRAY:
            return self.array()
        raise ProtocolError(f"unknown value tag {tag}")

    def dtype(self) -> np.dtype[Any]:
        code = self.u8()
        if code >= len(DTYPES):
            raise ProtocolError(f"unknown dtype code {code}")
        return DTYPES[code]

    def array(self) -> np.ndarray[Any, Any]:
        dt = self.dtype()
        ndim = self.u8()
        if ndim > MAX_NDIM:
            raise ProtocolError(f"an array of {ndim} dimensions (at most {MAX_NDIM})")
        shape = struct.unpack_from(f"<{ndim}Q", self.take(8 * ndim)) if ndim else ()
        count = math.prod(shape)
        nbytes = count * dt.itemsize
        if nbytes > len(self.buf) - self.pos:
            raise ProtocolError(f"an array of shape {shape} is longer than its frame")
        data = self.take(nbytes)
        # A copy: the frame's buffer is read-only, and an array may be written in place.
        return np.frombuffer(data, dtype=dt.newbyteorder("<"), count=count).reshape(shape).copy()


def ids_value(ids: list[int]) -> bytes:
    """An IDS value: the ids as one packed run (a tuple of REFs on the server)."""
    return TAG_REF.pack(T_IDS, len(ids)) + struct.pack(f"<{len(ids)}I", *ids)


class Ids:
    """Handles to send as one IDS value (``put`` packs them)."""

    __slots__ = ("handles",)

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles
