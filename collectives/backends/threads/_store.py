"""An in-process key-value store with the TCP store's interface, for the ranks of a threads job.

The ranks of a ``threads`` job are threads of one process, so they meet in its memory: the
setup steps written against the rendezvous store (``new_group``'s member check, the nccl
engine's unique id and peer board, :class:`~._setup_wait.SetupWatch`) run unchanged on this
dict behind a condition variable. Collective *data* never goes through it (the engines
exchange array references in memory).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..._store import StoreError, StoreTimeoutError

__all__ = ["LocalStore"]


def _bytes(value: bytes | str) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class LocalStore:
    """``set``/``get``/``add``/``wait``/``check``/``delete``/``compare_set`` of
    :class:`~collectives._store.TCPStore`, in this process (see the module docstring).

    Args:
        timeout: the default wait of ``get`` and ``wait``, in seconds.
        job: what the store belongs to (the threads job; backends find it here).
    """

    is_server = True
    server_address = None
    host = "in-process"
    port = 0

    def __init__(self, timeout: float, job: Any = None) -> None:
        self.timeout = timeout
        self.connect_timeout = timeout
        self.job = job
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False

    def __repr__(self) -> str:
        return f"<LocalStore {len(self._data)} keys>"

    def _open(self, what: str) -> None:
        if self._closed:
            raise StoreError(f"in-process store: {what} after the store was closed")

    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key``, waking waiters."""
        with self._cond:
            self._open(f"set({key!r})")
            self._data[key] = _bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until it is set (at most ``timeout`` seconds)."""
        self.wait([key], timeout)
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (created at 0); return the sum."""
        with self._cond:
            self._open(f"add({key!r})")
            value = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Block until every key of ``keys`` exists.

        Raises:
            StoreTimeoutError: some were not set within ``timeout`` (the message names them).
        """
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                self._open("wait")
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreTimeoutError(
                        f"in-process store: keys {missing[:5]} not set within {wait:g} s"
                    )
                self._cond.wait(left)

    def check(self, keys: list[str]) -> bool:
        """Whether every key of ``keys`` exists (does not wait)."""
        with self._cond:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        with self._cond:
            return self._data.pop(key, None) is not None

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (missing counts as ``b""``);
        the value after the call (``b""`` for a key that does not exist)."""
        with self._cond:
            self._open(f"compare_set({key!r})")
            current = self._data.get(key, b"")
            if current == _bytes(expected):
                self._data[key] = current = _bytes(desired)
                self._cond.notify_all()
            return current

    def num_keys(self) -> int:
        """The number of keys."""
        with self._cond:
            return len(self._data)

    def close(self) -> None:
        """Refuse further calls and wake every waiter (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
