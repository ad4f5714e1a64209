"""The device-list engine of ``collectives.distributed`` for remote devices of one server.

``with DistributedContext(remote.RemoteHost(addr).with_credential(t).devices()): ...`` reduces
on the server, never bringing data to the client, with the same server machinery as the
threads backend's remote engine (``_engine``): when the last device submitted call ``seq``,
the submitting thread queues, on every device's own session in device order, one COLLECTIVE
record naming only that session's input and a fresh output (member ``i`` of ``n``, the
context's random 128-bit key, ``seq``), flushing each at once. One thread can issue them all
because each session has its own worker on the server: worker 0 waits in the meeting while
the records of the others arrive (``remote.server._collective``); the reduction runs there in
device order with ``reduce_in_order``, so the bits are the NumPy engine's.

The call returns at once, like any remote op: the outputs are usable immediately (every later
op or read of a session runs after its record), so the completion is done from the start and a
failure on the server (a member's tensor inconsistent, a lost member) poisons the outputs and
is raised at their next read, as any failed remote op is.
"""

from __future__ import annotations

import secrets
from typing import Any

from collectives import ReduceOp
from collectives.distributed import Completed, DistributedConfig, register_context_engine

from .._wire import KINDS, OP_CODES, REDUCE_OPS
from ._array import RemoteArray
from ._client import session_of

__all__ = ["RemoteContextEngine", "make_remote_context_engine"]

_COLLECTIVE = OP_CODES["collective"]
_ALL_REDUCE = KINDS.index("all_reduce")
# The server names its reductions by REDUCE_OPS' index; ReduceOp's values are those names.
_OPS = frozenset(op for op in ReduceOp if op.value in REDUCE_OPS)


def _server_of(device: Any) -> str:
    return str(device)[len("remote://") :].rsplit("/", 1)[0]


class RemoteContextEngine:
    """Reduces the remote arrays of a device list on their one server (module docstring).

    Args:
        devices: remote devices of one server, each once.
        config: the context's settings (its ``timeout`` bounds the server-side meeting).

    Raises:
        ValueError: a device that is not remote, devices of two servers, or one listed twice.
    """

    ops = _OPS

    def __init__(self, devices: list[Any], config: DistributedConfig) -> None:
        if not devices:
            raise ValueError("remote context engine: give at least one device")
        not_remote = [str(d) for d in devices if getattr(d, "type", None) != "remote"]
        if not_remote:
            raise ValueError(
                f"remote context engine: {not_remote} are not remote devices "
                "(remote://HOST:PORT/INDEX)"
            )
        servers = list(dict.fromkeys(_server_of(d) for d in devices))
        if len(servers) > 1:
            raise ValueError(
                "DistributedContext: remote devices of one server only (the reduction runs on "
                f"it, among its sessions), got devices of {' and '.join(servers)} "
                f"({', '.join(str(d) for d in devices)}); use one context per server, or "
                "ExecutionStrategy.multi_device for devices without collectives among them"
            )
        shown = [str(d) for d in devices]
        if len(set(shown)) != len(shown):
            raise ValueError(
                f"DistributedContext: every remote device once (one session each), got {shown}"
            )
        self.devices = list(devices)
        self.size = len(devices)
        self._sessions = [session_of(d) for d in devices]
        self._timeout = float(config.timeout)
        # A fresh key per context: only these sessions' records can join its meetings.
        key = secrets.randbits(128)
        self._key = (key >> 64) - (1 << 63), (key & ((1 << 64) - 1)) - (1 << 63)  # two i64
        self._closed = False

    def all_reduce(self, arrays: list[Any], op: ReduceOp, seq: int) -> Completed:
        """Queue call ``seq``'s COLLECTIVE record on every device's session; the outputs are
        new arrays, one on each input's device.

        Raises:
            ValueError: an array that is not a remote array of its device's session, or an
                op the server has no reduction for.
            RuntimeError: the engine was closed.
        """
        if self._closed:
            raise RuntimeError("the remote context engine was closed")
        if op.value not in REDUCE_OPS:
            raise ValueError(f"the server has no {op.value!r} reduction; it has {REDUCE_OPS}")
        for i, (a, sess) in enumerate(zip(arrays, self._sessions, strict=True)):
            if type(a) is not RemoteArray or a._sess is not sess:
                where = a._sess.device if type(a) is RemoteArray else type(a).__name__
                raise ValueError(
                    f"device {self.devices[i]}'s tensor must be an array of that remote "
                    f"device, got {where}"
                )
        rop = REDUCE_OPS.index(op.value)
        outputs: list[RemoteArray] = []
        for i, (a, sess) in enumerate(zip(arrays, self._sessions, strict=True)):
            out: RemoteArray = sess.xp.empty(tuple(a.shape), dtype=a.dtype)
            args = (
                a._id, out._id, *self._key, seq, i, self.size,
                _ALL_REDUCE, rop, 0, self._timeout,
            )  # fmt: skip
            sess.issue(_COLLECTIVE, 0, out._id, args)
            # Member 0's worker waits on the server for the others: never hold a record back.
            sess.flush()
            outputs.append(out)
        return Completed(list(outputs))

    def close(self) -> None:
        """Forget the sessions (idempotent; they stay open for the devices' other use)."""
        self._closed = True


def make_remote_context_engine(
    devices: list[Any], config: DistributedConfig
) -> RemoteContextEngine:
    """The factory registered for devices of type ``remote``."""
    return RemoteContextEngine(devices, config)


register_context_engine(
    "remote",
    make_remote_context_engine,
    "remote devices of one server: reduced on the server",
)
