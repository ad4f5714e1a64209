"""Burn's names for remote's two ends: ``RemoteHost`` (``with_credential``, ``with_fingerprint``,
``devices()``, ``tl.Device.enumerate(host)``, ``tl.Device.remote_options(host).init()``) and
``RemoteServer`` with ``TokenAuthorizer``."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import numpy as np
import pytest

import remote
import tensorlib as tl

from .conftest import TOKEN, ServerProcess

HAS_CRYPTOGRAPHY = importlib.util.find_spec("cryptography") is not None


def test_a_host_with_its_credential_lists_the_servers_devices(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu", "--device", "cpu")
    host = remote.RemoteHost(server.address).with_credential(TOKEN)
    devs = host.devices(timeout=10.0)
    assert [str(d) for d in devs] == [f"remote://{server.address}/{i}" for i in range(2)]
    assert [str(d) for d in tl.Device.enumerate(host)] == [str(d) for d in devs]
    assert tl.DeviceType.Remote(host) is host
    assert tl.Device.enumerate(tl.DeviceType.Remote(host)) == devs
    # The devices work as remote.devices' do.
    x = tl.tensor(np.arange(4.0), device=devs[1])
    np.testing.assert_array_equal((x * 2).numpy(), np.arange(4.0) * 2)


def test_a_wrong_or_missing_token_is_a_clear_auth_error(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu")
    host = remote.RemoteHost(server.address)
    with pytest.raises(remote.RemoteAuthError):
        host.with_credential("not-the-token").devices()
    with pytest.raises(remote.RemoteAuthError):
        host.devices()


def test_an_unreachable_host_is_a_connection_error() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(remote.RemoteConnectionError, match=str(port)):
            remote.RemoteHost(f"127.0.0.1:{port}").with_credential(TOKEN).devices(timeout=2.0)


def test_remote_options_init_connects_one_device_of_the_host(
    local_server: remote.Server,
) -> None:
    host = remote.RemoteHost(local_server.address).with_credential(TOKEN)
    devs = host.devices()
    options = tl.Device.remote_options(host)
    assert isinstance(options, tl.RemoteOptions)
    # Burn's default device is the host's first; .index(i) picks another.
    assert options.init() is devs[0]
    assert options.index(1).init() is devs[1]
    assert options.init() is devs[0]  # options are values: index() made new ones
    assert TOKEN not in repr(options) and repr(options).endswith(".index(0)")
    # The page's lines: ones on the device, a model moved there, run by the server.
    device = options.init()
    tl.manual_seed(0)
    model = tl.nn.Linear(128, 4)
    local = model(tl.ones((32, 128))).numpy()
    out = model.to(device)(tl.ones((32, 128), device=device))
    assert out.device is device
    np.testing.assert_array_equal(out.numpy(), local)


def test_remote_options_init_raises_the_hosts_error(local_server: remote.Server) -> None:
    with pytest.raises(remote.RemoteAuthError):
        tl.Device.remote_options(remote.RemoteHost(local_server.address)).init()
    wrong = remote.RemoteHost(local_server.address).with_credential("not-the-token")
    with pytest.raises(remote.RemoteAuthError):
        tl.Device.remote_options(wrong).init()
    host = remote.RemoteHost(local_server.address).with_credential(TOKEN)
    with pytest.raises(ValueError, match=r"hosts 2 device.*no device at index 2"):
        tl.Device.remote_options(host).index(2).init()
    import socket

    with socket.socket() as s:  # bound, never listening: nobody answers
        s.bind(("127.0.0.1", 0))
        gone = remote.RemoteHost(f"127.0.0.1:{s.getsockname()[1]}").with_credential(TOKEN)
        with pytest.raises(remote.RemoteConnectionError):
            tl.Device.remote_options(gone).init()


def test_remote_options_check_their_arguments() -> None:
    with pytest.raises(TypeError, match=r"not a host.*devices\(\) method"):
        tl.Device.remote_options("127.0.0.1:9000")
    options = tl.Device.remote_options(remote.RemoteHost("127.0.0.1:9000"))
    with pytest.raises(ValueError, match="index must be >= 0"):
        options.index(-1)
    with pytest.raises(TypeError, match="index must be an int"):
        options.index(True)
    with pytest.raises(TypeError, match="index must be an int"):
        options.index("1")  # type: ignore[arg-type]


def test_hosts_are_immutable_and_never_show_the_token() -> None:
    base = remote.RemoteHost("127.0.0.1:9000")
    fp = "ab" * 32
    host = base.with_credential(TOKEN).with_fingerprint(fp)
    assert base.address == host.address == "127.0.0.1:9000"
    assert not base.has_credential and base.fingerprint is None
    assert host.has_credential and host.fingerprint == fp
    assert TOKEN not in repr(host) and "***" in repr(host) and fp in repr(host)
    assert host != base and host == base.with_credential(TOKEN).with_fingerprint(fp)
    with pytest.raises(AttributeError, match="immutable"):
        host._token = b"x"
    assert remote.RemoteHost("[::1]:80").address == "[::1]:80"


@pytest.mark.parametrize(
    ("address", "error", "match"),
    [
        ("localhost", ValueError, "HOST:PORT"),
        ("localhost:", ValueError, "HOST:PORT"),
        (":80", ValueError, "HOST:PORT"),
        ("localhost:0", ValueError, "port 0"),
        ("localhost:70000", ValueError, "1-65535"),
        ("localhost:http", ValueError, "HOST:PORT"),
        (8080, TypeError, "address"),
    ],
)
def test_a_bad_address_names_the_argument(address: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        remote.RemoteHost(address)  # type: ignore[arg-type]


def test_bad_credentials_and_fingerprints_name_the_argument() -> None:
    host = remote.RemoteHost("127.0.0.1:9000")
    with pytest.raises(ValueError, match="token must not be empty"):
        host.with_credential("")
    with pytest.raises(ValueError, match="token must not be empty"):
        host.with_credential(b"")
    with pytest.raises(TypeError, match="token must be a str or bytes"):
        host.with_credential(1234)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fingerprint must be .*SHA-256"):
        host.with_fingerprint("abc")
    with pytest.raises(TypeError, match="fingerprint must be a str"):
        host.with_fingerprint(b"ab" * 32)  # type: ignore[arg-type]
    # remote.devices' forms pass: colons and upper case.
    colons = ":".join(["AB"] * 32)
    assert host.with_fingerprint(colons).fingerprint == colons
    with pytest.raises(ValueError, match="token must not be empty"):
        remote.TokenAuthorizer("")
    with pytest.raises(TypeError, match="token"):
        remote.TokenAuthorizer(None)  # type: ignore[arg-type]


def test_a_remote_server_serves_a_host_until_closed() -> None:
    auth = remote.TokenAuthorizer(TOKEN)
    assert TOKEN not in repr(auth)
    builder = remote.RemoteServer(["cpu", "cpu"]).with_authorizer(auth).with_port(0)
    assert TOKEN not in repr(builder)
    server = builder.serve()
    try:
        host = remote.RemoteHost(server.address).with_credential(TOKEN)
        devs = tl.Device.enumerate(host)
        assert len(devs) == 2
        y = tl.tensor(np.ones(3), device=devs[0]) + 1
        np.testing.assert_array_equal(y.numpy(), np.full(3, 2.0))
        with pytest.raises(remote.RemoteAuthError):
            remote.RemoteHost(server.address).with_credential("wrong").devices()
    finally:
        server.close()
    with pytest.raises(remote.RemoteConnectionError):
        remote.RemoteHost(server.address).with_credential(TOKEN).devices(timeout=2.0)


@pytest.mark.skipif(not HAS_CRYPTOGRAPHY, reason="--tls certificates need cryptography")
def test_a_tls_server_is_reached_with_its_fingerprint() -> None:
    auth = remote.TokenAuthorizer(TOKEN.encode())
    with remote.RemoteServer(["cpu"]).with_authorizer(auth).with_tls().serve() as server:
        assert server.fingerprint is not None
        host = remote.RemoteHost(server.address).with_credential(TOKEN)
        assert len(host.with_fingerprint(server.fingerprint).devices()) == 1
        with pytest.raises(remote.RemoteAuthError):
            host.with_fingerprint("00" * 32).devices()


def test_bad_server_arguments_name_the_argument() -> None:
    with pytest.raises(TypeError, match="devices must be a list"):
        remote.RemoteServer("cpu")
    with pytest.raises(ValueError, match="at least one device"):
        remote.RemoteServer([])
    srv = remote.RemoteServer(["cpu"])
    with pytest.raises(TypeError, match="TokenAuthorizer"):
        srv.with_authorizer(TOKEN)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port must be in 0-65535"):
        srv.with_port(65536)
    with pytest.raises(TypeError, match="port must be an int"):
        srv.with_port("80")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host must not be empty"):
        srv.with_host(" ")
    with pytest.raises(TypeError, match="with_tls"):
        srv.with_tls("yes")  # type: ignore[arg-type]
    # remote.serve's own checks still apply: off loopback a token is required.
    with pytest.raises(ValueError, match="without a token"):
        srv.with_host("0.0.0.0").serve()
    # The builders are values: with_* leave the original as it was.
    assert "authorizer" not in repr(srv.with_host("127.0.0.1")) and "authorizer" not in repr(srv)
