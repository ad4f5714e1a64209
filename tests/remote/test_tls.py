"""TLS: the client pins the server's certificate fingerprint and refuses any other."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import remote
import tensorlib as tl

from .conftest import TOKEN, ServerProcess

HAS_CRYPTOGRAPHY = importlib.util.find_spec("cryptography") is not None
needs_cryptography = pytest.mark.skipif(
    not HAS_CRYPTOGRAPHY,
    reason="the cryptography package (pip install '.[remote]') makes --tls certificates",
)


@pytest.fixture(scope="module")
def own_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate and key made by the openssl CLI (no cryptography needed)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=test"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return str(cert), str(key)


def _check(server_address: str, fingerprint: str) -> None:
    wrong = "0" * 64
    with pytest.raises(remote.RemoteAuthError, match="not the pinned"):
        remote.devices(server_address, token=TOKEN, fingerprint=wrong)
    with pytest.raises(remote.RemoteConnectionError, match="--tls"):
        remote.devices(server_address, token=TOKEN, timeout=1.0)  # plain text to a TLS server
    colons = ":".join(fingerprint[i : i + 2] for i in range(0, 64, 2)).upper()
    dev = remote.devices(server_address, token=TOKEN, fingerprint=colons)[0]
    x = tl.tensor(np.arange(3.0), device=dev)
    assert (x * x).sum().item() == 5.0
    remote.close(dev)


def test_tls_with_a_certificate_of_ones_own_pins_its_fingerprint(
    own_cert: tuple[str, str],
) -> None:
    with remote.serve(["cpu"], token=TOKEN, tls=own_cert) as server:
        assert server.fingerprint is not None and len(server.fingerprint) == 64
        _check(server.address, server.fingerprint)


@needs_cryptography
def test_the_cli_makes_a_certificate_and_prints_its_fingerprint(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process("--device", "cpu", "--tls")
    fingerprint = server.lines[-1].split()[-1]
    assert server.lines[-1].startswith("fingerprint") and len(fingerprint) == 64
    _check(server.address, fingerprint)


def test_tls_true_without_cryptography_says_what_to_install(tmp_path: Path) -> None:
    if HAS_CRYPTOGRAPHY:
        pytest.skip("cryptography is installed here")
    with pytest.raises(remote.RemoteError, match=r"pip install '\.\[remote\]'"):
        remote.serve(["cpu"], token=TOKEN, tls=True)
