"""What each request does to the store's keys: one small handler per opcode, in a table.

A handler reads its request's fields, acts on the key-value ``data`` and returns either a
``Reply`` to send at once or a ``Parked`` request (a GET or WAIT whose keys do not exist yet)
for the server to answer later with ``answer_parked``. Handlers do no I/O; a malformed request
raises ``ProtocolError`` and costs the sender its connection (see ``_wire`` for the format).
A request that would take the store over its key or byte limit (``_limits``) does nothing and
gets a ``LIMIT`` error.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import NamedTuple

from ._limits import MAX_BYTES_ENV, MAX_KEYS_ENV
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


class Data:
    """The keys and values, with their count and size held under the server's limits."""

    __slots__ = ("_items", "max_bytes", "max_keys", "nbytes")

    def __init__(self, max_keys: int, max_bytes: int) -> None:
        self._items: dict[str, bytes] = {}
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self.nbytes = 0  # UTF-8 bytes of every key + bytes of every value

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __getitem__(self, key: str) -> bytes:
        return self._items[key]

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> bytes | None:
        return self._items.get(key)

    def put(self, key: str, value: bytes) -> bytes | None:
        """Store ``value`` at ``key``; None, or the ``LIMIT`` error to reply (nothing stored)."""
        old = self._items.get(key)
        if old is None:
            if len(self._items) >= self.max_keys:
                return error_payload(
                    ErrorKind.LIMIT,
                    f"the store is full: it holds {len(self._items)} keys, its limit "
                    f"({MAX_KEYS_ENV}); delete keys or raise the limit on rank 0",
                )
            grow = len(key.encode()) + len(value)
        else:
            grow = len(value) - len(old)
        if grow > 0 and self.nbytes + grow > self.max_bytes:
            return error_payload(
                ErrorKind.LIMIT,
                f"the store is full: {self.nbytes} bytes of keys and values held, {grow} "
                f"more would pass its limit of {self.max_bytes} ({MAX_BYTES_ENV}); delete "
                "keys or raise the limit on rank 0",
            )
        self._items[key] = value
        self.nbytes += grow
        return None

    def pop(self, key: str) -> bytes | None:
        value = self._items.pop(key, None)
        if value is not None:
            self.nbytes -= len(key.encode()) + len(value)
        return value


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
    full = data.put(key, value)
    if full is not None:
        return Reply(full)
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
    old = data.get(key) or b"0"
    if not _INT_VALUE.fullmatch(old):
        message = f"the value {old[:40]!r} of key {key!r} is not an integer"
        return Reply(error_payload(ErrorKind.VALUE, message))
    new = int(old) + amount
    if not I64_MIN <= new <= I64_MAX:
        message = f"{int(old)} + {amount} overflows int64 (key {key!r})"
        return Reply(error_payload(ErrorKind.VALUE, message))
    full = data.put(key, str(new).encode())
    if full is not None:
        return Reply(full)
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
    existed = data.pop(key) is not None
    return Reply(Writer(Status.OK).u8(existed).payload())


def _compare_set(data: Data, r: Reader) -> Reply:
    key, expected, desired = r.key(), r.blob(MAX_VALUE_BYTES), r.blob(MAX_VALUE_BYTES)
    r.end()
    current = data.get(key)
    created = None
    # A missing key counts as holding b"".
    if (current is None and expected == b"") or current == expected:
        full = data.put(key, desired)
        if full is not None:
            return Reply(full)
        current = desired
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
