"""The threads backend's engine for remote devices: collectives reduced on the server.

``spawn(train, nprocs=2, backend="threads", devices=remote.devices(addr, token=T))`` runs one
rank thread per remote device; every rank's arrays live in its own session (its device's
connection). A collective on remote arrays never brings data to the client:

1. the ranks meet in this process (:meth:`~collectives.backends.threads.ThreadEngine.meet`:
   the signatures are compared, so a mismatched call fails on every rank before anything is
   sent), and check that every member passed an array of its own session;
2. each rank queues one COLLECTIVE record on its own session, naming only its own tensor ids,
   the group's random 128-bit key, the call's number and its member index
   (``remote.server._collective``), and flushes it; the call returns at once, like any remote op;
3. the server's session workers meet on (key, number), reduce in member order and write each
   member's result into its own tensor; the ops that follow in each session run after it.

A failure on the server (a member that never arrives, inconsistent tensors) poisons the
outputs and is raised at the next read of that session, as any failed remote op is. Host
(NumPy) arrays, such as DDP's control vector and the object collectives, are reduced in this
process by the NumPy engine. All members must be distinct devices of one server; a lost
connection to it fails every rank with :class:`~remote.RemoteConnectionError`.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any

from collectives import CollectiveError, CollectiveMismatchError
from collectives.backends.threads import NumpyEngine, ThreadJob, register_engine

from .._errors import RemoteConnectionError
from .._wire import KINDS, OP_CODES, REDUCE_OPS
from ._array import RemoteArray
from ._client import session_of

__all__ = ["RemoteEngine"]

_COLLECTIVE = OP_CODES["collective"]
# The collectives of KINDS that write a separate output (``req.out``), not their input.
_SEPARATE_OUT = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
_keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_keys_lock = threading.Lock()


def _server_of(device: Any) -> str:
    return str(device)[len("remote://") :].rsplit("/", 1)[0]


class RemoteEngine(NumpyEngine):
    """The engine of one group on one rank thread whose devices are remote (module doc).

    Args:
        info: the group.
        job: the threads job.

    Raises:
        ValueError: members on devices of several servers, or two members on one device.
    """

    array_types = (RemoteArray,)

    def __init__(self, info: Any, job: ThreadJob) -> None:
        super().__init__(info, job)
        members = [job.devices[g] for g in info.ranks]
        servers = sorted({_server_of(d) for d in members})
        if len(servers) > 1:
            raise ValueError(
                f"threads backend: the remote devices of one group must be hosted by one server "
                f"(the reduction runs on it, among its sessions), got devices of {servers} "
                f"({', '.join(str(d) for d in members)}); make one group per server, or copy "
                "the data through the host yourself (the Learner does: ExecutionStrategy."
                "multi_device trains over devices of several servers)"
            )
        if len({str(d) for d in members}) != len(members):
            raise ValueError(
                "threads backend: every rank of a group needs its own remote device (one "
                f"session each), got {[str(d) for d in members]}; start the server with one "
                "--device per rank (a device may be listed twice: --device cpu --device cpu)"
            )
        self.sessions = [session_of(d) for d in members]
        with _keys_lock:  # one key per group meeting, shared by its members only
            key = _keys.get(self.meeting)
            if key is None:
                key = _keys[self.meeting] = secrets.randbits(128)
        self._key = (key >> 64) - (1 << 63), (key & ((1 << 64) - 1)) - (1 << 63)  # two i64

    def new_array(self, like: RemoteArray, shape: tuple[int, ...]) -> RemoteArray:
        """A new output like ``like`` (same device and dtype), for ops with a separate out."""
        result: RemoteArray = like._sess.xp.empty(shape, dtype=like.dtype)
        return result

    # ------------------------------------------------------------------ dispatch
    def run(self, req: Any) -> None:
        """Run ``req``; a failure caused by a lost server is raised as that loss."""
        try:
            super().run(req)
        except CollectiveError as exc:
            dead = next((s._dead for s in self.sessions if s._dead is not None), None)
            if dead is None:
                raise
            raise RemoteConnectionError(f"{self.info.where(req.op, req.seq)}: {dead}") from exc

    def handler(self, op: str) -> Callable[[Any], None]:
        """The NumPy engine's ``_do_<op>`` for host arrays; for remote arrays, a collective
        of ``KINDS`` runs on the server (:meth:`_on_server`, writing its output or, for the
        ops without one, its input) and send/recv is refused."""
        host = super().handler(op)
        if op in KINDS:
            separate_out = op in _SEPARATE_OUT

            def on_server(req: Any) -> None:
                if type(req.array) is not RemoteArray:
                    return host(req)
                return self._on_server(req, req.out if separate_out else req.array)

            return on_server
        if op in ("send", "recv"):

            def host_only(req: Any) -> None:
                self._host_only(req)
                host(req)

            return host_only
        return host

    def _host_only(self, req: Any) -> None:
        if type(req.array) is RemoteArray:
            raise self.info.error(
                CollectiveError,
                req.op,
                req.seq,
                "send/recv of remote arrays is not supported by the remote engine; use a "
                "collective (broadcast, all_gather) or copy through the host (.numpy())",
            )

    # ------------------------------------------------------------------ the server's part
    def _on_server(self, req: Any, dst: Any) -> None:
        src = req.array
        items = self.meet(req, src)
        kinds = {type(x) is RemoteArray for x in items}
        if kinds != {True}:
            raise self.info.error(
                CollectiveMismatchError,
                req.op,
                req.seq,
                "some ranks passed remote arrays and others host arrays; every rank of a "
                "remote group passes an array of its own device",
            )
        mine = self.sessions[self.rank]
        owners = [x._sess for x in items]
        if any(o is not s for o, s in zip(owners, self.sessions, strict=True)) or (
            type(dst) is not RemoteArray or dst._sess is not mine
        ):
            wrong = [
                f"rank {self.info.ranks[q]}: {o.device} (bound to {s.device})"
                for q, (o, s) in enumerate(zip(owners, self.sessions, strict=True))
                if o is not s
            ]
            raise self.info.error(
                CollectiveError,
                req.op,
                req.seq,
                "every rank passes arrays of the remote device it is bound to "
                f"(get_device()); {', '.join(wrong) or 'the output is on another device'}",
            )
        rop = 0 if req.reduce_op is None else REDUCE_OPS.index(req.reduce_op.value)
        args = (
            src._id, dst._id, *self._key, req.seq, self.rank, self.size,
            KINDS.index(req.op), rop, req.root, float(self.info.timeout),
        )  # fmt: skip
        mine.issue(_COLLECTIVE, 0, dst._id, args)
        mine.flush()  # a peer's worker waits for this record on the server: never hold it


def _make(info: Any, job: ThreadJob) -> RemoteEngine:
    return RemoteEngine(info, job)


register_engine(
    "remote",
    _make,
    description="remote arrays reduced on their server among its sessions (data never comes "
    "to the client); host arrays in process memory",
)
