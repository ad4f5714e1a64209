"""Every public entry point of remote checks its arguments first: a wrong call raises a
TypeError or ValueError naming the argument, its value (a token's type only: it may be the
secret) and what was expected, before anything listens or connects. And a token is the same
on both ends: surrounding whitespace (a file's trailing newline) is stripped by the server and
the client alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import remote
import tensorlib as tl

from .conftest import TOKEN, ServerProcess

pytestmark = pytest.mark.timeout(30)

# Nobody listens there: a call that got past its checks would fail to connect, not hang.
NOWHERE = "127.0.0.1:1"
UNRESOLVABLE = "no-such-host.invalid"  # RFC 2606: never resolves


def _raises(call: Callable[[], Any], error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as info:
        result = call()
        if hasattr(result, "close"):  # a server that should not have started
            result.close()
    assert fragment in str(info.value), str(info.value)


CPU = ["cpu"]
ANY_DEVICES = "'cpu', 'cuda:N' or tensorlib Devices"


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"token": 123}, TypeError, "serve: token must be a str or bytes, got int"),
        ({"token": ["a"]}, TypeError, "serve: token must be a str or bytes, got list"),
        ({"token": ""}, ValueError, "serve: token must not be empty"),
        ({"token": " \n"}, ValueError, "serve: token must not be empty"),
        ({"max_session_bytes": -5}, ValueError, "max_session_bytes must be positive, got -5"),
        (
            {"max_session_bytes": "x"},
            TypeError,
            "max_session_bytes must be an int (bytes) or None, got 'x'",
        ),
        (
            {"max_session_bytes": True},
            TypeError,
            "max_session_bytes must be an int (bytes) or None, got True",
        ),
        ({"port": "x"}, TypeError, "serve: port must be an int, got 'x'"),
        ({"port": 70000}, ValueError, "serve: port must be in 0-65535, got 70000"),
        ({"host": 5}, TypeError, "serve: host must be a str, got 5"),
        (
            {"host": UNRESOLVABLE, "token": TOKEN},
            ValueError,
            f"serve: host {UNRESOLVABLE!r} does not resolve",
        ),
        ({"devices": "cpu"}, TypeError, "serve: devices must be a list, e.g. ['cpu'], got 'cpu'"),
        ({"devices": 5}, TypeError, f"serve: devices must be a list of {ANY_DEVICES}, got 5"),
        ({"devices": [5]}, TypeError, f"serve: devices must be {ANY_DEVICES}, got 5 in [5]"),
        (
            {"tls": "yes"},
            TypeError,
            "serve: expected tls=True/False or (certfile, keyfile), got 'yes'",
        ),
    ],
)
def test_serve(kwargs: dict[str, Any], error: type[Exception], fragment: str) -> None:
    _raises(lambda: remote.serve(**{"devices": CPU, **kwargs}), error, fragment)


def _resolve_on_serve() -> Any:
    auth = remote.TokenAuthorizer(TOKEN)
    return remote.RemoteServer(CPU).with_host(UNRESOLVABLE).with_authorizer(auth).serve()


@pytest.mark.parametrize(
    ("build", "error", "fragment"),
    [
        (
            lambda: remote.RemoteServer(5),  # type: ignore[arg-type]
            TypeError,
            f"RemoteServer: devices must be a list of {ANY_DEVICES}, got 5",
        ),
        (
            lambda: remote.RemoteServer([5]),  # type: ignore[list-item]
            TypeError,
            f"RemoteServer: devices must be {ANY_DEVICES}, got 5",
        ),
        (
            lambda: remote.RemoteServer(CPU).with_max_session_bytes("x"),  # type: ignore[arg-type]
            TypeError,
            "max_session_bytes must be an int (bytes) or None, got 'x'",
        ),
        (
            lambda: remote.TokenAuthorizer(" \n"),
            ValueError,
            "TokenAuthorizer: token must not be empty",
        ),
        (_resolve_on_serve, ValueError, f"serve: host {UNRESOLVABLE!r} does not resolve"),
    ],
    ids=["devices=5", "devices=[5]", "max_session_bytes='x'", "blank token", "unresolvable"],
)
def test_remote_server(build: Callable[[], Any], error: type[Exception], fragment: str) -> None:
    _raises(build, error, fragment)


@pytest.mark.parametrize(
    ("address", "kwargs", "error", "fragment"),
    [
        (
            "127.0.0.1:99999",
            {},
            ValueError,
            "address '127.0.0.1:99999' has port 99999; expected 1-65535",
        ),
        (123, {}, TypeError, "address must be a 'HOST:PORT' str, got 123"),
        ("localhost", {}, ValueError, "address must be 'HOST:PORT', got 'localhost'"),
        (
            NOWHERE,
            {"fingerprint": 123},
            TypeError,
            "fingerprint must be a str (SHA-256 hex), got int 123",
        ),
        (
            NOWHERE,
            {"fingerprint": "ab"},
            ValueError,
            "fingerprint must be the server certificate's SHA-256",
        ),
        (NOWHERE, {"token": 123}, TypeError, "token must be a str or bytes, got int"),
        (NOWHERE, {"token": ""}, ValueError, "token must not be empty"),
        (NOWHERE, {"timeout": "x"}, TypeError, "timeout must be a number of seconds, got 'x'"),
        (
            NOWHERE,
            {"timeout": -1},
            ValueError,
            "timeout must be a positive number of seconds, got -1",
        ),
        (
            NOWHERE,
            {"timeout": float("nan")},
            ValueError,
            "timeout must be a positive number of seconds, got nan",
        ),
    ],
)
def test_devices(
    address: Any, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    _raises(lambda: remote.devices(address, **kwargs), error, f"remote.devices: {fragment}")


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (
            lambda h: h.devices(timeout="x"),
            TypeError,
            "devices: timeout must be a number of seconds, got 'x'",
        ),
        (
            lambda h: h.devices(timeout=0),
            ValueError,
            "devices: timeout must be a positive number of seconds, got 0",
        ),
        (
            lambda h: h.with_credential(" \n"),
            ValueError,
            "with_credential: token must not be empty",
        ),
    ],
    ids=["timeout='x'", "timeout=0", "blank token"],
)
def test_remote_host(call: Callable[[Any], Any], error: type[Exception], fragment: str) -> None:
    _raises(lambda: call(remote.RemoteHost(NOWHERE)), error, f"RemoteHost.{fragment}")


@pytest.mark.parametrize("fn", [remote.stats, remote.close])
@pytest.mark.parametrize(
    ("device", "error", "fragment"),
    [
        (
            None,
            TypeError,
            "device must be a remote device (from remote.devices, or 'remote://HOST:PORT/"
            "INDEX'), got None",
        ),
        (123, TypeError, "device must be a remote device"),
        ("cpu", ValueError, "cpu is not a remote device"),
    ],
)
def test_stats_and_close(
    fn: Callable[[Any], Any], device: object, error: type[Exception], fragment: str
) -> None:
    _raises(lambda: fn(device), error, f"remote.{fn.__name__}: {fragment}")


# ---------------------------------------------------------------------- the token's newline
def test_a_token_read_from_a_file_authenticates_on_both_ends(
    server_process: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with open(token_file) as f:
        read = f.read()  # what a user reads: the trailing newline included
    assert read.endswith("\n")
    # The client reads the file the server's --token-file names.
    server = server_process("--device", "cpu")
    devs = remote.devices(server.address, token=read, timeout=10.0)
    x = tl.tensor(np.arange(3.0), device=devs[0])
    np.testing.assert_array_equal((x + 1).numpy(), np.arange(3.0) + 1)
    assert len(remote.RemoteHost(server.address).with_credential(read).devices(10.0)) == 1
    # An in-process server given the file's text, reached with the bare token (and bytes).
    with remote.serve(["cpu"], token=read) as local:
        assert len(remote.devices(local.address, token=TOKEN, timeout=10.0)) == 1
        assert len(remote.devices(local.address, token=b" " + TOKEN.encode() + b"\r\n")) == 1
        with pytest.raises(remote.RemoteAuthError):
            remote.devices(local.address, token=TOKEN + "x", timeout=10.0)


@pytest.mark.timeout(60)
def test_the_command_line_checks_its_arguments_as_serve_does() -> None:
    # `python -m remote serve` runs the same serve: a negative limit is refused, not served.
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "remote", "serve", "--device", "cpu", "--max-session-bytes", "-5"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert p.returncode != 0
    assert "max_session_bytes must be positive, got -5" in p.stderr
