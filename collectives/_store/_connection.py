r"""Connecting to the store server: retries while it is not up, the handshake, the secret.

A ``Dialer`` opens ``Connection``\ s, each a blocking socket that speaks frames (``_wire``)
and has completed the handshake. With a secret the two ends prove it to each other and then
seal every frame; a client with a secret never talks to a server that cannot prove it.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import time
from collections.abc import Callable

from ._errors import StoreAuthError, StoreConnectionError, StoreError, StoreTimeoutError
from ._framing import Seal, recv_frame, send_frame
from ._wire import (
    FLAG_AUTH,
    MAX_FRAME_BYTES,
    MAX_HELLO_FRAME,
    MAX_HELLO_REPLY_FRAME,
    MAX_MAC_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ErrorKind,
    Greeting,
    ProtocolError,
    Reader,
    Status,
    client_proof,
    hello_payload,
    parse_greeting,
    server_proof,
    session_seal,
)

SECRET_ENV_VAR = "DPT_STORE_SECRET"
# One connect() attempt waits at most this long; retries back off from the first delay to
# the longest.
_CONNECT_ATTEMPT_TIMEOUT = 5.0
_MIN_CONNECT_ATTEMPT_TIMEOUT = 0.05
_FIRST_RETRY_DELAY = 0.01
_LONGEST_RETRY_DELAY = 0.5
# The handshake of a server that accepted the connection gets at least this long.
_MIN_HANDSHAKE_TIMEOUT = 1.0


class Connection:
    """One authenticated client socket that sends and receives frames (one thread at a time).

    Attributes:
        sock: the socket.
        seal: tags and checks every frame once the handshake proved the secret (else None).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.seal: Seal | None = None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send(self, payload: bytes) -> None:
        send_frame(self.sock, self.seal, payload)

    def recv(self, limit: int = MAX_FRAME_BYTES) -> bytes:
        """The next frame's payload (its tag checked and removed when sealed).

        Raises:
            ProtocolError: a bad length, or a sealed frame whose tag is wrong.
            EOFError: the server closed the connection.
        """
        return bytes(recv_frame(self.sock, self.seal, limit, ProtocolError))


def secret_from(secret: bytes | str | None) -> bytes | None:
    """The shared secret: ``secret`` (str as UTF-8), else ``DPT_STORE_SECRET``, else None."""
    if secret is None:
        env = os.environ.get(SECRET_ENV_VAR, "")
        return env.encode("utf-8") if env else None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"secret must be bytes, str or None, got {type(secret).__name__}")
    # An empty secret is treated as none (like an empty DPT_STORE_SECRET).
    return bytes(secret) or None


class Dialer:
    """Opens authenticated connections to one store server.

    Attributes:
        host: the address connected to.
        port: the server's port.
        where: ``host:port`` as the user named it, for messages.
        server_lost: a connection to the server broke; the next connect makes one attempt
            and, failing, reports the server gone rather than unreachable.
    """

    def __init__(self, host: str, port: int, secret: bytes | None, where: str) -> None:
        self.host = host
        self.port = port
        self.secret = secret
        self.where = where
        self.server_lost = False

    def connect(
        self, window: float, connect_timeout: float, closed: Callable[[], bool]
    ) -> Connection:
        """Connect and authenticate, retrying with backoff while the server is not up.

        Args:
            window: how long to retry; 0 makes one attempt (of up to ``connect_timeout``).
            connect_timeout: the client's connect timeout, which bounds a single attempt.
            closed: whether the client was closed meanwhile (then give up at once).

        Raises:
            StoreTimeoutError: the server was not reached within ``window``.
            StoreConnectionError: the server was reached before but is gone now.
            StoreAuthError: the server refused this client.
            StoreError: the client was closed, or the service is not a dpt store.
        """
        start = time.monotonic()
        deadline = start + window
        delay = _FIRST_RETRY_DELAY
        attempts = 0
        last: BaseException | None = None
        while True:
            attempts += 1
            remaining = deadline - time.monotonic()
            if window == 0:
                remaining = min(connect_timeout, _CONNECT_ATTEMPT_TIMEOUT)
            try:
                attempt = min(remaining, _CONNECT_ATTEMPT_TIMEOUT)
                sock = socket.create_connection(
                    (self.host, self.port),
                    timeout=max(_MIN_CONNECT_ATTEMPT_TIMEOUT, attempt),
                )
            except OSError as exc:  # refused, unreachable, name not resolved, timed out
                last = exc
            else:
                try:
                    conn = self._handshake(sock, max(remaining, _MIN_HANDSHAKE_TIMEOUT))
                    self.server_lost = False
                    return conn
                except StoreConnectionError as exc:  # reset mid-handshake: try again
                    sock.close()
                    last = exc
                except BaseException:
                    sock.close()
                    raise
            if closed():
                raise StoreError(f"the store client for {self.where} is closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _LONGEST_RETRY_DELAY)
        waited = time.monotonic() - start
        if self.server_lost:
            raise StoreConnectionError(
                f"store at {self.where} is gone ({last}); it was reachable before: did the "
                "process hosting it (rank 0) exit?"
            )
        raise StoreTimeoutError(
            f"store at {self.where} unreachable: tried for {waited:.1f} s "
            f"({attempts} attempts, connect timeout {window:g} s); last error: {last}. "
            "Is rank 0 running, and do MASTER_ADDR/MASTER_PORT name its host and a free port?"
        )

    def _handshake(self, sock: socket.socket, timeout: float) -> Connection:
        """Answer the server's greeting on a fresh socket; with a secret, prove it and check
        the server's proof.

        Raises:
            StoreConnectionError: the connection broke (transient: the caller retries).
            StoreAuthError: the server refused this client, speaks another version, or (with
                a secret) did not prove the secret.
            StoreError: the service on the port is not a dpt store.
        """
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.settimeout(timeout)
        conn = Connection(sock)
        nonce = secrets.token_bytes(NONCE_BYTES)
        theirs = b""
        try:
            greeting = parse_greeting(conn.recv(MAX_HELLO_FRAME))
            if greeting is None:
                raise StoreError(
                    f"the service at {self.where} is not a dpt store (unexpected greeting); "
                    "check MASTER_PORT"
                )
            self._check_greeting(greeting)
            proof = client_proof(self.secret, greeting.nonce, nonce) if self.secret else b""
            conn.send(hello_payload(nonce, proof))
            reply = Reader(conn.recv(MAX_HELLO_REPLY_FRAME))
            status = reply.u8()
            if status == Status.OK:
                theirs = reply.blob(MAX_MAC_BYTES)
                reply.end()
        except ProtocolError as exc:
            raise StoreError(
                f"the service at {self.where} is not a dpt store ({exc}); check MASTER_PORT"
            ) from exc
        except (EOFError, OSError) as exc:
            # Transient (the server is starting or closing): the caller retries.
            raise StoreConnectionError(
                f"store at {self.where}: handshake failed ({str(exc) or 'connection closed'})"
            ) from exc
        if status != Status.OK:
            raise self._refusal(status, reply, secret_required=bool(greeting.flags & FLAG_AUTH))
        if self.secret is not None:
            if not hmac.compare_digest(server_proof(self.secret, greeting.nonce, nonce), theirs):
                raise StoreAuthError(
                    f"store at {self.where} could not prove it knows the shared secret "
                    f"({SECRET_ENV_VAR}): refusing to trust it. Another process may hold the "
                    "port, or rank 0 has a different secret; give every rank the same one"
                )
            conn.seal = session_seal(self.secret, greeting.nonce, nonce, server=False)
        return conn

    def _check_greeting(self, greeting: Greeting) -> None:
        """Refuse a server of another version, or one whose wish for a secret does not match.

        Raises:
            StoreAuthError: as above.
        """
        if greeting.version != PROTOCOL_VERSION:
            raise StoreAuthError(
                f"store at {self.where} speaks protocol version {greeting.version}, this "
                f"client {PROTOCOL_VERSION}: use the same dpt version on every rank"
            )
        wants_secret = bool(greeting.flags & FLAG_AUTH)
        if wants_secret and self.secret is None:
            raise StoreAuthError(
                f"store at {self.where} refused the connection: wrong or missing secret "
                f"({SECRET_ENV_VAR}): the server requires a shared secret and this client "
                "has none"
            )
        if not wants_secret and self.secret is not None:
            # Anyone can run a server that asks for nothing; it could not prove the secret.
            raise StoreAuthError(
                f"store at {self.where} does not ask for the shared secret, but this client "
                f"has one ({SECRET_ENV_VAR}): refusing a server that cannot prove it knows "
                "it. Another process may hold the port, or rank 0 runs without the secret; "
                f"set {SECRET_ENV_VAR} to the same value on every rank"
            )

    def _refusal(self, status: int, reply: Reader, *, secret_required: bool) -> StoreAuthError:
        """The error for a server's answer to HELLO other than OK."""
        kind: int | None = None
        message = "unknown reply"
        try:
            kind, message = reply.error()
        except ProtocolError:
            pass
        if status == Status.ERROR and kind == ErrorKind.REFUSED and secret_required:
            # The server refuses a version or the proof of the secret. This client sent the
            # version the greeting named, so what the server refused is the proof.
            return StoreAuthError(
                f"store at {self.where} refused the connection: wrong or missing secret "
                f"({SECRET_ENV_VAR})"
            )
        return StoreAuthError(f"store at {self.where} refused the connection: {message}")
