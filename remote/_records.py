"""A session's frames: RECORDS from the client, REPLY and HEARTBEAT from the server.

The client encodes (:func:`record`, :func:`records_frame`) and decodes replies
(:func:`parse_reply`); the server decodes records against its table (:func:`records`) and
encodes replies (:func:`reply`). The values inside are ``_wire``'s.

Records
-------
A session's client sends RECORDS frames (``0x03 u16 waits u32 count`` + records; ``waits``
counts its READ and SYNC records), each record
``u16 op u8 flags u32 out u8 nargs`` + ``nargs`` values. ``out`` is the id the client gave the
result (ids are the client's; the server keeps one table per session); with ``FLAG_OUT`` it
is an existing array written in place (``out=``). DROP frees ``out``; READ (``out`` = request
id, one REF) and SYNC (``out`` = request id) are answered by REPLY ``0x12 u32 request u8
status u32 n`` + ``n`` u64 seqs of the ops that failed since the last reply (``seq`` counts
the session's records from 0), then for ``OK`` a READ's ARRAY value, for ``OP_ERROR`` ``u64
seq u16 op str message``: the first op that failed since the last reply, or the one that
poisoned the array read (UPLOAD puts its ARRAY argument in the table). HEARTBEAT (0x13)
frames come once a second while a reply is due or a frame has run for over a second (a read
may wait behind it, not yet received), so a client tells a busy server from a dead one.
A REPLY to request 0 (the client numbers its requests from 1), status ``BAD_REQUEST``, ends
the session: its message says why (a frame too long for the session's memory limit:
``_wire``), and the server closes the connection after it.

An array larger than ``PIECE_BYTES`` goes up in pieces: UPLOAD with two values, its shape
(a TUPLE of INT) and DTYPE, makes an array of zeros, and SETITEM records (``FLAG_OUT``) of at
most ``PIECE_BYTES`` each fill it, so no frame of records carries much more, and a session's
memory limit refuses the array (at its UPLOAD) before any of it is held.

DROP with no values frees ``out``; with one IDS value it frees those ids (``out`` unused): a
frame's frees go as one record.

ADAM (``out`` unused, ``flags`` 0) is one fused Adam/AdamW update of ``n`` parameters:
values ``lr, beta1, beta2, eps, weight_decay`` (INT or FLOAT: the client's Python numbers,
unchanged), ``decoupled, maximize`` (booleans), then IDS of the ``n`` data, of their grads,
exp_avgs, exp_avg_sqs, of their max_exp_avg_sqs (empty without amsgrad), and a TUPLE of
``n`` INT steps; the server runs ``tensorlib.optim.adam_update`` on each parameter in order,
the very function a local step runs.

An op makes one result, ``out``, except those ``OUTPUTS`` says make ``n``: ids ``out``
to ``out + n - 1`` (the client takes consecutive ids for them; a failure poisons them all).
The other fused ops run the functions tensorlib's own ops run, on the same arrays: LINEAR
(``x, w, b or NONE``: ``tensorlib.functional.linear_forward``), LINEAR_GRAD (``g, x, w``
and three booleans: which of ``gx, gw, gb`` to make, as three results; one not made is not
stored), CROSS_ENTROPY (``logits,
target, INT reduction`` (0 none, 1 sum, 2 mean) ``, INT ignore_index, FLOAT smoothing``;
two results, the loss and the probabilities ``e / sum_e``), CROSS_ENTROPY_GRAD (``probs,
target, g, INT ignore_index, FLOAT smoothing, INT reduction``: the logits' gradient),
RELU_GRAD (``g, out``: ``tensorlib.functional.relu_backward``, ReLU's input gradient).

COLLECTIVE (``out`` = the tensor written) is one member's part of a collective among
sessions of one server (``remote.server._collective``), as plain numbers: ``INT src id,
INT dst id, INT key_hi, INT key_lo, INT seq, INT member, INT members, INT kind`` (an index
of ``KINDS``) ``, INT reduce op`` (of ``REDUCE_OPS``) ``, INT root, FLOAT timeout``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from ._wire import (
    DROP,
    F64,
    HEARTBEAT,
    I64,
    OPS,
    READ,
    RECORDS,
    REPLY,
    SMALL,
    SYNC,
    T_ARRAY,
    T_FLOAT,
    T_IDS,
    T_INT,
    T_REF,
    T_TRUE,
    TAG_FLOAT,
    TAG_REF,
    U8,
    U32,
    U64,
    Handle,
    ProtocolError,
    Reader,
    Ref,
    array_parts,
    ids_value,
    put,
)

FLAG_OUT = 0x01
# REPLY status.
OK, OP_ERROR, BAD_REQUEST = 0, 1, 2
CLOSING = 0  # the request of a REPLY that ends the session (no request of the client's)

RECORDS_HEAD = struct.Struct("<BHI")  # kind, how many READ/SYNC records, records
RECORD_HEAD = struct.Struct("<HBIB")
REPLY_HEAD = struct.Struct("<BIB")
_ERROR_HEAD = struct.Struct("<QH")
HEARTBEAT_FRAME = U8.pack(HEARTBEAT)
_HEAD, _PACK_REF, _PACK_FLOAT = RECORD_HEAD.pack, TAG_REF.pack, TAG_FLOAT.pack
_U32_AT, _F64_AT, _I64_AT = U32.unpack_from, F64.unpack_from, I64.unpack_from


# ---------------------------------------------------------------------------- records out (client)
def record_head(op: int, flags: int, out: int, nargs: int) -> bytes:
    return RECORD_HEAD.pack(op, flags, out, nargs)


def record(op: int, flags: int, out: int, args: tuple[Any, ...]) -> list[bytes]:
    """One record's parts: its head and its values (an array's data, if any, comes last).

    Every op the client issues runs this, so handles and floats, the common values, are
    encoded here rather than through :func:`put`.
    """
    parts = [_HEAD(op, flags, out, len(args))]
    for a in args:
        if isinstance(a, Handle):
            parts.append(_PACK_REF(T_REF, a._id))
        elif type(a) is float:
            parts.append(_PACK_FLOAT(T_FLOAT, a))
        else:
            put(parts, a)
    return parts


def drop_record(ids: list[int]) -> list[bytes]:
    """The parts of one DROP record that frees every id of ``ids``."""
    return [_HEAD(DROP, 0, 0, 1), ids_value(ids)]


def records_frame(waits: int, count: int, parts: list[bytes]) -> bytes:
    """A RECORDS payload of ``count`` records (``parts``), ``waits`` of them READ or SYNC."""
    return RECORDS_HEAD.pack(RECORDS, waits, count) + b"".join(parts)


def frame_waits(payload: memoryview) -> int:
    """The replies a RECORDS payload will be due (its READ and SYNC records)."""
    if len(payload) < RECORDS_HEAD.size:
        raise ProtocolError("a frame too short for records")
    return int(RECORDS_HEAD.unpack_from(payload)[1])


# ---------------------------------------------------------------------------- records in (server)
# One decoded record: (op, flags, out, values, bad, start, end); see ``records``.
Decoded = tuple[int, int, int, list[Any], Any, int, int]


def records(payload: memoryview, table: dict[int, Any], poison: type) -> Iterator[Decoded]:
    """The records of a RECORDS payload, decoded one by one as the caller runs them.

    Each record's values are decoded against ``table`` as it is when the record is reached
    (so a record sees what the ones before it made): a REF becomes ``table``'s entry, an IDS
    a tuple of entries, REFs inside a TUPLE too. ``bad`` is the first REF whose entry is
    missing (its id) or a ``poison`` (that entry), else None; missing entries decode as None.
    DROP, READ and SYNC keep their REFs as :class:`Ref` ids (not operands); a DROP's IDS
    decodes as a tuple of ints. ``start`` and ``end`` are the record's offsets in ``payload``
    (for :func:`raw_values` and :func:`read_target`).

    This runs for every record of every op, so the common values (REF, FLOAT, INT, NONE,
    booleans, IDS) are read inline with the structs, the rest through :meth:`Reader.value`.

    Raises:
        ProtocolError: a malformed frame (the records before it have run).
    """
    r = Reader(payload)
    kind, _, count = r.unpack(RECORDS_HEAD)
    if kind != RECORDS:
        raise ProtocolError(f"a session may only send records, got frame kind {kind}")
    buf, pos, end = r.buf, r.pos, len(r.buf)
    head, u32, f64, i64 = RECORD_HEAD.unpack_from, _U32_AT, _F64_AT, _I64_AT
    get, nops, n = table.get, len(OPS), 0
    while pos < end:
        if pos + 8 > end:
            raise ProtocolError(f"truncated record at offset {pos}")
        start = pos
        op, flags, oid, nargs = head(buf, pos)
        pos += 8
        n += 1
        if op >= nops:
            raise ProtocolError(f"unknown op code {op}")
        args: list[Any] = []
        bad: Any = None
        if op <= SYNC:  # DROP, READ, SYNC: their REFs are ids, not operands
            if op == DROP and nargs == 1 and pos + 5 <= end and buf[pos] == T_IDS:
                ids, pos = _ids_at(buf, pos, end)  # a frame's frees: the common DROP
                args.append(ids)
            else:
                r.pos = pos
                for _ in range(nargs):
                    args.append(r.value())
                pos = r.pos
            yield op, flags, oid, args, None, start, pos
            continue
        for _ in range(nargs):
            if pos >= end:
                raise ProtocolError(f"truncated record at offset {pos}")
            tag = buf[pos]
            if tag == T_REF and pos + 5 <= end:
                i = u32(buf, pos + 1)[0]
                x = get(i)
                if (x is None or type(x) is poison) and bad is None:
                    bad = i if x is None else x
                args.append(x)
                pos += 5
            elif tag == T_FLOAT and pos + 9 <= end:
                args.append(f64(buf, pos + 1)[0])
                pos += 9
            elif tag == T_INT and pos + 9 <= end:
                args.append(i64(buf, pos + 1)[0])
                pos += 9
            elif tag <= T_TRUE:
                args.append(SMALL[tag])
                pos += 1
            elif tag == T_IDS and pos + 5 <= end:  # packed REFs (ADAM's), resolved here
                ids, pos = _ids_at(buf, pos, end)
                xs = tuple(map(get, ids))
                if bad is None:
                    for i, x in zip(ids, xs, strict=True):
                        if x is None or type(x) is poison:
                            bad = i if x is None else x
                            break
                args.append(xs)
            else:
                r.pos = pos
                v = r.value()
                pos = r.pos
                if type(v) is tuple:
                    try:
                        v = _resolved(v, get, poison)
                    except _UnresolvedError as exc:
                        bad = bad if bad is not None else exc.bad
                args.append(v)
        yield op, flags, oid, args, bad, start, pos
    if n != count:
        raise ProtocolError(f"a frame announced {count} records and held {n}")


def _ids_at(buf: memoryview, pos: int, end: int) -> tuple[tuple[int, ...], int]:
    """The ids of the IDS value at ``pos`` (plain ints), and the offset after it."""
    k = _U32_AT(buf, pos + 1)[0]
    stop = pos + 5 + 4 * k
    if stop > end:
        raise ProtocolError(f"truncated frame: {k} ids at offset {pos}")
    return struct.unpack_from(f"<{k}I", buf, pos + 5), stop


class _UnresolvedError(Exception):
    def __init__(self, bad: Any) -> None:
        self.bad = bad


def _resolved(v: Any, get: Any, poison: type) -> Any:
    """``v`` with every :class:`Ref` in it replaced by its table entry (``get``)."""
    t = type(v)
    if t is Ref:
        x = get(v)
        if x is None or type(x) is poison:
            raise _UnresolvedError(int(v) if x is None else x)
        return x
    if t is tuple:
        return tuple(_resolved(x, get, poison) for x in v)
    return v


def raw_values(payload: memoryview, start: int) -> tuple[Any, ...]:
    """The values of the record at offset ``start``, REFs as :class:`Ref` ids (for a record
    :func:`records` decoded once already: what a failed one was to write)."""
    r = Reader(payload, start)
    nargs = r.unpack(RECORD_HEAD)[3]
    return tuple(r.value() for _ in range(nargs))


def read_target(payload: memoryview, pos: int) -> int | None:
    """The id the record at offset ``pos`` reads, if it is a READ of one REF (else None)."""
    if pos + 13 > len(payload):
        return None
    op, _, _, nargs = RECORD_HEAD.unpack_from(payload, pos)
    if op == READ and nargs == 1 and payload[pos + 8] == T_REF:
        return int(_U32_AT(payload, pos + 9)[0])  # after the record's head and the REF's tag
    return None


# ---------------------------------------------------------------------------- replies
class Reply(NamedTuple):
    """A decoded REPLY: ``error`` is ``(seq, op, message)`` unless ``status`` is OK, and
    ``rest`` reads what follows (a READ's ARRAY: :func:`reply_array`)."""

    request: int
    status: int
    failed: list[int]
    error: tuple[int, int, str] | None
    rest: Reader


def reply(
    request: int,
    failed: list[int],
    error: tuple[int, int, str] | None = None,
    array: np.ndarray[Any, Any] | None = None,
) -> list[bytes | memoryview]:
    """A REPLY's parts: the seqs of the ops that failed since the last one, then (status
    OP_ERROR) the error to raise, or (OK) a READ's ``array`` (its data a view of it: the
    reply is sent at once)."""
    head = REPLY_HEAD.pack(REPLY, request, OK if error is None else OP_ERROR)
    body = U32.pack(len(failed)) + b"".join(U64.pack(s) for s in failed)
    if error is not None:
        return [head + body + _error(*error)]
    parts: list[bytes | memoryview] = [head + body]  # a large array is sent part by part
    if array is not None:
        array_head, data = array_parts(array)
        parts += [array_head, data.data]
    return parts


def closing(message: str) -> bytes:
    """The REPLY that ends a session (to request ``CLOSING``): ``message`` says why."""
    return REPLY_HEAD.pack(REPLY, CLOSING, BAD_REQUEST) + U32.pack(0) + _error(0, 0, message)


def _error(seq: int, op: int, message: str) -> bytes:
    data = message.encode("utf-8", "replace")[:4096]
    return _ERROR_HEAD.pack(seq, op) + U32.pack(len(data)) + data


def parse_reply(payload: memoryview) -> Reply:
    """Decode a REPLY payload (a HEARTBEAT is the caller's to skip)."""
    if payload[0] != REPLY:
        raise ProtocolError(f"unexpected frame kind {payload[0]}")
    r = Reader(payload)
    _, request, status = r.unpack(REPLY_HEAD)
    failed = [int(r.unpack(U64)[0]) for _ in range(r.u32())]
    error = None
    if status != OK:
        seq, op = r.unpack(_ERROR_HEAD)
        error = (int(seq), int(op), r.str())
    return Reply(int(request), int(status), failed, error, r)


def reply_array(r: Reader) -> np.ndarray[Any, Any]:
    """The ARRAY that ends an OK reply to a READ."""
    if r.u8() != T_ARRAY:
        raise ProtocolError("a READ reply without an array")
    out = r.array()
    r.done()
    return out
