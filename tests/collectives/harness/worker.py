"""One rank of a :class:`~tests.collectives.harness.RankPool`.

Run as ``python -m tests.collectives.harness.worker``. It joins the process group named by
``DPT_TEST_BACKEND`` (group timeout ``DPT_TEST_TIMEOUT`` seconds) through the usual ``env://``
variables, answers one JSON line on its protocol channel (the original stdout), then runs
commands, one JSON line each, read from stdin:

* ``{"fn": "tests.collectives.bodies:name", "kwargs": {...}}`` answers
  ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "<traceback>"}``;
* with ``"uncaught": true`` an exception ends the process the ordinary way (sys.excepthook);
* ``{"fn": "__exit__"}`` destroys the group and exits 0.

With ``DPT_TEST_FAKE_CUPY=1`` it installs tests/fakes' CuPy first. Nothing is pickled.
Anything the bodies print goes to stderr, which the pool keeps in a file.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO


def _resolve(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    # tests/ddp reuses this harness for its multi-rank bodies.
    if not module.startswith(("tests.collectives.", "tests.ddp.")) or not name:
        raise ValueError(
            f"refusing to call {spec!r}: only tests.collectives.<module>:<fn> or "
            "tests.ddp.<module>:<fn>"
        )
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{spec} is not callable")
    return fn


def _reply(channel: TextIO, message: dict[str, Any]) -> None:
    try:
        line = json.dumps(message)
    except (TypeError, ValueError) as exc:
        line = json.dumps({"ok": False, "error": f"worker: result is not JSON-able: {exc}"})
    channel.write(line + "\n")
    channel.flush()


def main() -> int:
    parent = os.environ.get("DPT_TEST_PARENT_PID")
    if parent:
        # Die with the test process, even when it is killed (a timed-out CI job, the GPU
        # check's step limit) while this rank is stuck in a collective: a rank left behind
        # would hold its GPU, its shared memory and its ports.
        import signal

        from collectives.launch._launcher import set_parent_death_signal

        set_parent_death_signal(signal.SIGKILL, int(parent))
    commands: TextIO = sys.stdin
    if os.environ.get("DPT_TEST_CHANNEL"):
        # Started by mpiexec (tests/collectives/harness/mpipool.py): the protocol runs over
        # the pool's Unix socket, and this rank's stderr goes to its own file.
        channel, commands = _socket_channel(os.environ["DPT_TEST_CHANNEL"])
    else:
        # The protocol owns the real stdout.
        channel = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    # Prints from library code or bodies go to stderr.
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    if os.environ.get("DPT_TEST_FAKE_CUPY") == "1":
        # CuPy arrays over host memory (tests/fakes): exercises the staging through the host.
        from tests.fakes import fake_cupy

        fake_cupy.install()

    import collectives

    if os.environ.get("DPT_TEST_DIE_IN_INIT") == "1":
        # Die (SIGKILL, no cleanup) in the middle of the cpu backend's segment exchange: after
        # this rank created and published its segment, while it maps the peers'.
        import signal

        from collectives.backends.cpu import _shm

        def die(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        _shm.Segment.attach = die  # type: ignore[method-assign]

    backend = os.environ["DPT_TEST_BACKEND"]
    timeout = float(os.environ.get("DPT_TEST_TIMEOUT", "30"))
    try:
        group = collectives.init_process_group(backend, timeout=timeout)
    except BaseException as exc:
        _reply(channel, {"ok": False, "error": _format(exc)})
        return 3
    _reply(
        channel,
        {"ok": True, "result": {"rank": group.rank, "size": group.size, "pid": os.getpid()}},
    )
    for line in commands:
        if not line.strip():
            continue
        cmd = json.loads(line)
        spec = cmd["fn"]
        if spec == "__exit__":
            break
        if cmd.get("uncaught"):
            # Let the exception leave the interpreter the ordinary way (sys.excepthook, exit 1).
            result = _resolve(spec)(**cmd.get("kwargs", {}))
            _reply(channel, {"ok": True, "result": result})
            continue
        try:
            result = _resolve(spec)(**cmd.get("kwargs", {}))
        except BaseException as exc:
            _reply(channel, {"ok": False, "error": _format(exc)})
        else:
            _reply(channel, {"ok": True, "result": result})
    collectives.destroy_process_group()
    _reply(channel, {"ok": True, "result": "bye"})
    return 0


def _socket_channel(path: str) -> tuple[TextIO, TextIO]:
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or 0)
    err = os.open(
        os.path.join(os.environ["DPT_TEST_STDERR_DIR"], f"r{rank}.err"),
        os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
        0o600,
    )
    os.dup2(err, 2)
    os.close(err)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    channel = sock.makefile("w", encoding="utf-8", buffering=1)
    channel.write(json.dumps({"rank": rank, "pid": os.getpid()}) + "\n")
    channel.flush()
    return channel, sock.makefile("r", encoding="utf-8")


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


if __name__ == "__main__":
    sys.exit(main())
