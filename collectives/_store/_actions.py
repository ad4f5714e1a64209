"""What each request does to the store's keys: one small handler per opcode, in a table.

A handler reads its request's fields, acts on the key-value ``data`` and returns either a
``Reply`` to send at once or a ``Parked`` request (a GET or WAIT whose keys do not exist yet)
for the server to answer later with ``answer_parked``. Handlers do no I/O; a malformed request
raises ``ProtocolError`` and costs the sender its connection (see ``_wire`` for the format).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import NamedTuple

from ._wire import (
    I64_MAX,
    I64_MIN,
    MAX_VALUE_BYTES,
    OK_PAYLOAD,
    ErrorKind,
    Op,
    ProtocolError,
    Reader,
    Status,
    Writer,
    error_payload,
)

Data = dict[str, bytes]

# What ADD accepts as an integer value: an optional sign and at most 19 decimal digits.
_INT_VALUE = re.compile(rb"[+-]?[0-9]{1,19}")


class Reply(NamedTuple):
    """A reply to send now, and the key the request created or changed (to wake waiters)."""

    payload: bytes
    created: str | None = None


class Parked(NamedTuple):
    """A GET or WAIT that waits on the server until its keys exist or its deadline passes."""

    op: Op
    keys: list[str]
    deadline: float  # time.monotonic(); inf waits forever


Handler = Callable[[Data, Reader], Reply | Parked]


def _set(data: Data, r: Reader) -> Reply:
    key, value = r.key(), r.blob(MAX_VALUE_BYTES)
    r.end()
    data[key] = value
    return Reply(OK_PAYLOAD, created=key)


def _get(data: Data, r: Reader) -> Reply | Parked:
    key, timeout = r.key(), r.timeout()
    r.end()
    if key in data:
        return Reply(Writer(Status.OK).blob(data[key]).payload())
    return Parked(Op.GET, [key], time.monotonic() + timeout)


def _add(data: Data, r: Reader) -> Reply:
    key, amount = r.key(), r.i64()
    r.end()
    old = data.get(key, b"0")
    if not _INT_VALUE.fullmatch(old):
        message = f"the value {old[:40]!r} of key {key!r} is not an integer"
        return Reply(error_payload(ErrorKind.VALUE, message))
    new = int(old) + amount
    if not I64_MIN <= new <= I64_MAX:
        message = f"{int(old)} + {amount} overflows int64 (key {key!r})"
        return Reply(error_payload(ErrorKind.VALUE, message))
    data[key] = str(new).encode()
    return Reply(Writer(Status.OK).i64(new).payload(), created=key)


def _wait(data: Data, r: Reader) -> Reply | Parked:
    keys, timeout = r.keys(), r.timeout()
    r.end()
    if all(k in data for k in keys):
        return Reply(OK_PAYLOAD)
    return Parked(Op.WAIT, keys, time.monotonic() + timeout)


def _check(data: Data, r: Reader) -> Reply:
    keys = r.keys()
    r.end()
    return Reply(Writer(Status.OK).u8(all(k in data for k in keys)).payload())


def _delete(data: Data, r: Reader) -> Reply:
    key = r.key()
    r.end()
    existed = data.pop(key, None) is not None
    return Reply(Writer(Status.OK).u8(existed).payload())


def _compare_set(data: Data, r: Reader) -> Reply:
    key, expected, desired = r.key(), r.blob(MAX_VALUE_BYTES), r.blob(MAX_VALUE_BYTES)
    r.end()
    current = data.get(key)
    created = None
    # A missing key counts as holding b"".
    if (current is None and expected == b"") or current == expected:
        data[key] = current = desired
        created = key
    return Reply(Writer(Status.OK).blob(current or b"").payload(), created=created)


def _num_keys(data: Data, r: Reader) -> Reply:
    r.end()
    return Reply(Writer(Status.OK).i64(len(data)).payload())


HANDLERS: dict[int, Handler] = {
    Op.SET: _set,
    Op.GET: _get,
    Op.ADD: _add,
    Op.WAIT: _wait,
    Op.CHECK: _check,
    Op.DELETE: _delete,
    Op.COMPARE_SET: _compare_set,
    Op.NUM_KEYS: _num_keys,
}


def execute(data: Data, r: Reader) -> Reply | Parked:
    """Run the request in ``r`` (an authenticated peer's frame) against ``data``.

    Raises:
        ProtocolError: unknown opcode or malformed fields.
    """
    op = r.u8()
    handler = HANDLERS.get(op)
    if handler is None:
        raise ProtocolError(f"unknown opcode 0x{op:02x}")
    return handler(data, r)


def answer_parked(data: Data, parked: Parked, missing: list[str]) -> bytes:
    """The reply to a parked GET/WAIT: TIMEOUT naming ``missing`` keys, or its result."""
    if missing:
        return Writer(Status.TIMEOUT).keys([k.encode() for k in missing]).payload()
    if parked.op == Op.GET:
        return Writer(Status.OK).blob(data[parked.keys[0]]).payload()
    return OK_PAYLOAD
