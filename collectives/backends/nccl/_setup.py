"""The nccl backend's setup: a communicator from a unique id, or split from the parent group's.

Every rank starts a *non-blocking* ``ncclCommInitRankConfig`` and polls
``ncclCommGetAsyncError`` until it is ready, so init honours the group's timeout and fails fast
(:class:`~._setup_wait.SetupWatch`) when a peer dies meanwhile. ``new_group`` splits the parent
group's communicator (``ncclCommSplit``, NCCL 2.18+), every rank of the parent taking part.

NCCL's non-blocking init and split write the new handle into the caller's ``ncclComm_t*``
*after* returning (a split: only once it completed, which the *parent* reports by leaving
``ncclInProgress``; NVIDIA/nccl#1472, and PyTorch's ProcessGroupNCCL waits on the parent the
same way since pytorch/pytorch#137741). The binding's :class:`~._nccl_lib.PendingComm` owns that
storage; it is kept until the call completed and, when setup is abandoned (timeout, a dead
peer), for good in :data:`_ABANDONED`, so that NCCL's late write never lands in freed memory.

``NCCL_COMM_BLOCKING=1`` in the environment makes NCCL ignore the non-blocking config (NCCL's
``envConfigOverride``): init then blocks inside NCCL and cannot honour the group's timeout, so
the backend warns once (see docs/nccl.md).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._backend import GroupInfo
from ..._errors import CollectiveError, CollectiveTimeoutError
from ..._setup_wait import SetupWatch, setup_op
from . import _lib as nccl_lib
from ._lib import NcclError, PendingComm
from ._ops import error_from
from ._peers import PeerBoard

if TYPE_CHECKING:
    from ._backend import NcclBackend

__all__ = ["NcclSetup", "blocking_env_warning"]

_WATCH_EVERY = 0.25  # how often a pending init or split looks at the peers (see SetupWatch)

# Storage of inits and splits given up on: NCCL may still write a handle there.
_ABANDONED: list[PendingComm] = []
_warned = threading.Event()


def blocking_env_warning() -> str | None:
    """What to tell the user when ``NCCL_COMM_BLOCKING=1`` overrides non-blocking init."""
    if os.environ.get("NCCL_COMM_BLOCKING", "").strip() != "1":
        return None
    return (
        "NCCL_COMM_BLOCKING=1 is set: NCCL makes every communicator blocking whatever the "
        "backend asks, so ncclCommInitRankConfig and ncclCommSplit block inside NCCL and "
        "cannot honour the group's timeout (a rank that never joins hangs the others instead "
        "of raising CollectiveTimeoutError); unset it to get the timeout back"
    )


class NcclSetup:
    """The setup half of :class:`~collectives.backends.nccl.NcclBackend` (a mixin)."""

    # Set by the backend.
    info: GroupInfo
    lib: Any
    board: PeerBoard
    size: int
    rank: int
    device: int
    comm: int
    _lock: Any
    _issued: int

    if TYPE_CHECKING:

        def check_usable(self, op: str, seq: int | None) -> None: ...

    def _make_comm(self, parent: NcclBackend | None) -> int:
        deadline = time.monotonic() + self.info.timeout
        # Setup waits fail fast, naming the rank, when a peer dies or leaves meanwhile.
        watch = SetupWatch(self.info, setup_op(self.info))
        text = blocking_env_warning()
        if text is not None and not _warned.is_set():
            _warned.set()
            warnings.warn(text, RuntimeWarning, stacklevel=4)
        if parent is not None:
            comm = self._split_child(parent, deadline, watch)
        else:
            uid = self.board.share_unique_id(self.lib.get_unique_id, deadline, watch)
            pending = self._call_init(
                lambda: self.lib.comm_init_rank(self.size, uid, self.rank, blocking=False),
            )
            comm = pending.handle
            try:
                self._settle_init(comm, "ncclCommInitRankConfig", deadline, watch)
            except BaseException:
                _ABANDONED.append(pending)
                raise
        try:
            count = self.lib.comm_count(comm)
            rank = self.lib.comm_user_rank(comm)
            dev = self.lib.comm_cu_device(comm)
        except NcclError as exc:
            self.lib.comm_abort(comm)
            raise error_from(self.info, exc, "init") from exc
        if (count, rank) != (self.size, self.rank) or dev != self.device:
            self.lib.comm_abort(comm)
            raise self.info.error(
                CollectiveError,
                "init",
                None,
                f"NCCL made a communicator of {count} ranks with this rank as {rank} on "
                f"cuda:{dev}; expected {self.size} ranks, rank {self.rank}, cuda:{self.device}",
            )
        return comm

    def _split_child(self, parent: NcclBackend, deadline: float, watch: SetupWatch) -> int:
        """This rank's communicator of the new group, split from ``parent``'s."""
        with parent._lock:
            parent.check_usable("new_group", parent._issued)
            pending = self._call_init(
                lambda: self.lib.comm_split(parent.comm, 0, self.rank, blocking=False),
            )
            try:
                # The split completes on the parent; only then is the child's handle written.
                parent._settle_init(parent.comm, "ncclCommSplit", deadline, watch, abort=False)
                comm = pending.handle
                if not comm:
                    raise self.info.error(
                        CollectiveError,
                        "init",
                        None,
                        "ncclCommSplit completed without a communicator for this member",
                    )
                self._settle_init(comm, "ncclCommSplit", deadline, watch)
            except BaseException:
                _ABANDONED.append(pending)
                raise
        return comm

    def _split_out(self) -> None:
        """Take part in a split of this group as a rank that is not a member (NOCOLOR)."""
        deadline = time.monotonic() + self.info.timeout
        watch = SetupWatch(self.info, "new_group")  # see _make_comm
        with self._lock:
            self.check_usable("new_group", self._issued)
            pending = self._call_init(
                lambda: self.lib.comm_split(
                    self.comm, nccl_lib.SPLIT_NOCOLOR, self.rank, blocking=False
                ),
            )
            try:
                self._settle_init(
                    self.comm, "ncclCommSplit (not a member)", deadline, watch, abort=False
                )
            except BaseException:
                _ABANDONED.append(pending)
                raise
            if pending.handle:  # NCCL makes none for NOCOLOR; never leak one if it did
                self.lib.comm_abort(pending.handle)

    def _call_init(self, start: Callable[[], PendingComm]) -> PendingComm:
        try:
            return start()
        except NcclError as exc:
            raise error_from(self.info, exc, "init") from exc

    def _settle_init(
        self, comm: int, call: str, deadline: float, watch: SetupWatch, abort: bool = True
    ) -> None:
        """Poll a communicator that is initializing (or splitting) until it is ready; fail
        fast (``watch``) when a peer dies meanwhile, as NCCL would wait for it forever."""
        pause = 0.0002
        next_check = time.monotonic() + _WATCH_EVERY
        while True:
            try:
                state = self.lib.comm_get_async_error(comm)
            except NcclError as exc:
                raise error_from(self.info, exc, "init") from exc
            if state == nccl_lib.SUCCESS:
                return
            if state != nccl_lib.IN_PROGRESS:
                err = self.lib.error(state, call, comm)
                if abort:
                    self.lib.comm_abort(comm)
                raise error_from(self.info, err, "init") from err
            if time.monotonic() >= deadline:
                if abort:
                    self.lib.comm_abort(comm)
                missing = self.board.not_joined()
                detail = f"; ranks {missing} never joined" if missing else ""
                raise self.info.error(
                    CollectiveTimeoutError,
                    "init",
                    None,
                    f"{call} did not complete within {self.info.timeout:g} s{detail}",
                )
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _WATCH_EVERY
                try:
                    watch.check(f"finish {call}")
                except CollectiveError:
                    if abort:
                        self.lib.comm_abort(comm)
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
