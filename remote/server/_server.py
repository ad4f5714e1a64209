"""The server: ``serve`` hosts devices; each connection is one session on one device.

Threads: one accepts; one per connection does the handshake and then receives and runs that
session's frames on its device (``_worker``); one sends heartbeats to clients that may be
waiting for a reply. A malformed frame or a
failed tag closes that one connection (its session is freed); the others go on.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Sequence

import tensorlib as tl

from .._conn import Framed, tune
from .._handshake import (
    CONTROL,
    NONCE_BYTES,
    REFUSED_AUTH,
    REFUSED_DEVICE,
    REFUSED_PROTOCOL,
    client_proof,
    device_list,
    greeting,
    parse_hello,
    parse_list,
    refused,
    server_proof,
    session_seal,
    welcome,
)
from .._records import HEARTBEAT_FRAME
from .._tls import fingerprint_of, self_signed, server_context
from .._wire import MAX_HELLO_FRAME, PROTOCOL_VERSION, ProtocolError
from ._worker import Worker

__all__ = ["Server", "serve"]

HANDSHAKE_TIMEOUT = 10.0
HEARTBEAT_S = 1.0
MAX_CONNECTIONS = 64


def _due(w: Worker, now: float) -> bool:
    """Whether a session's client may be waiting: a reply is due, or a frame runs so long
    that a read may sit behind it, not yet received."""
    busy = w.busy_since
    return w.waiting > 0 or (busy is not None and now - busy >= HEARTBEAT_S)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """A running server (from :func:`serve`); a context manager that closes it.

    Attributes:
        address: ``"HOST:PORT"`` to pass to ``remote.devices``.
        port: the port it listens on.
        fingerprint: SHA-256 of its TLS certificate (None without TLS).
        specs: the devices it hosts, by index.
    """

    def __init__(
        self,
        specs: list[str],
        listener: socket.socket,
        host: str,
        token: bytes | None,
        tls: ssl.SSLContext | None,
        fingerprint: str | None,
        max_session_bytes: int | None,
    ) -> None:
        self.specs = specs
        self._devices = [tl.device(s) for s in specs]
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self.address = f"{host}:{self.port}"
        self.fingerprint = fingerprint
        self._token = token
        self._tls = tls
        self._limit = max_session_bytes
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[Framed] = set()
        self._workers: set[Worker] = set()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._threads = [
            threading.Thread(target=self._accept, name="remote-accept", daemon=True),
            threading.Thread(target=self._heartbeats, name="remote-heartbeat", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<remote.Server {self.address} devices={self.specs}>"

    def stats(self) -> dict[str, int]:
        """``sessions`` open now, the ``bytes`` their arrays hold, and ``peak_bytes``: the
        sum of each one's most at once since it began (what one session's limit sees)."""
        with self._lock:
            workers = [w for w in self._workers if not w.closed]
        return {
            "sessions": len(workers),
            "bytes": sum(w.bytes for w in workers),
            "peak_bytes": sum(w.peak_bytes for w in workers),
        }

    def close(self) -> None:
        """Stop serving: close every connection (sessions are freed) and the listener."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
            for w in self._workers:
                w.closed = True  # each stops between two records
        for c in conns:
            c.close()
        for t in self._threads:
            t.join(timeout=2.0)

    # ------------------------------------------------------------------ threads
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                sock.close()  # too many connections at once: refuse without a thread
                continue
            threading.Thread(
                target=self._connection, args=(sock,), name="remote-conn", daemon=True
            ).start()

    def _heartbeats(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            now = time.monotonic()
            with self._lock:
                workers = [w for w in self._workers if not w.closed and _due(w, now)]
            for w in workers:
                try:
                    w.framed.send(HEARTBEAT_FRAME)
                except OSError:
                    pass

    def _connection(self, sock: socket.socket) -> None:
        framed: Framed | None = None
        worker: Worker | None = None
        try:
            tune(sock)
            sock.settimeout(HANDSHAKE_TIMEOUT)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            framed = Framed(sock)
            with self._lock:
                self._conns.add(framed)
            if self._closed.is_set():
                return
            device = self._handshake(framed)
            if device is None:
                return
            sock.settimeout(None)
            index = device
            dev = self._devices[index]
            worker = Worker(framed, dev.xp, dev if dev.type == "cuda" else None, self._limit)
            with self._lock:
                self._workers.add(worker)
            if not self._closed.is_set():
                worker.run()
        except (OSError, EOFError, ProtocolError, ssl.SSLError, ValueError):
            pass  # a broken or hostile connection: drop it, serve the others
        finally:
            if worker is not None:
                worker.closed = True
                with self._lock:
                    self._workers.discard(worker)
            if framed is not None:
                framed.close()
                with self._lock:
                    self._conns.discard(framed)
            else:
                sock.close()
            self._slots.release()

    def _handshake(self, framed: Framed) -> int | None:
        """Run the handshake; the session's device index, or None (refused, or a control
        connection that got its device list)."""
        token = self._token
        sn = secrets.token_bytes(NONCE_BYTES)
        framed.send(greeting(token is not None, sn))
        version, device, cn, proof = parse_hello(bytes(framed.recv(MAX_HELLO_FRAME)))
        if version != PROTOCOL_VERSION:
            framed.send(refused(REFUSED_PROTOCOL, f"protocol {version} is not {PROTOCOL_VERSION}"))
            return None
        if not hmac.compare_digest(proof, client_proof(token, sn, cn, device)):
            framed.send(refused(REFUSED_AUTH, "authentication failed: wrong or missing token"))
            return None
        if device != CONTROL and device >= len(self.specs):
            framed.send(refused(REFUSED_DEVICE, f"no device {device} here"))
            return None
        framed.send(welcome(server_proof(token, sn, cn, device)))
        if token is not None:
            framed.seal = session_seal(token, sn, cn, device, server=True)
        if device != CONTROL:
            return device
        parse_list(framed.recv(MAX_HELLO_FRAME))
        framed.send(device_list(self.specs))
        return None


def serve(
    devices: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | bytes | None = None,
    *,
    tls: bool | tuple[str, str] = False,
    max_session_bytes: int | None = None,
) -> Server:
    """Host ``devices`` (``"cpu"``, ``"cuda:0"``...) for remote clients, on background threads.

    Args:
        devices: tensorlib device specs, one per device clients may use (repeats allowed).
        host: the address to listen on; anything but loopback requires a token.
        port: the port (0: any free one; see ``Server.port``).
        token: the shared secret clients prove (and this server proves back).
        tls: True for TLS with a fresh self-signed certificate (needs ``cryptography``), or
            ``(certfile, keyfile)`` PEM paths; clients pin ``Server.fingerprint``.
        max_session_bytes: what one session's arrays may hold (None: no limit).

    Returns:
        The running :class:`Server` (close it, or use it as a context manager).

    Raises:
        ValueError: a non-loopback host without a token, or no devices.
        RemoteError: ``tls=True`` without ``cryptography``.
    """
    specs = [str(tl.device(d)) for d in devices]
    if not specs:
        raise ValueError("serve: give at least one device")
    if any(tl.device(s).type not in ("cpu", "cuda") for s in specs):
        raise ValueError("serve: hosts local devices only ('cpu', 'cuda:N')")
    tok = token.encode("utf-8") if isinstance(token, str) else token
    tok = tok or None
    if tok is None and not _is_loopback(host):
        raise ValueError(
            f"serve: refusing to listen on {host!r} without a token (anyone who can reach it "
            "could run code on its devices); pass token=... or listen on 127.0.0.1"
        )
    ctx = fingerprint = None
    if tls:
        if not isinstance(tls, tuple):
            cert, key = self_signed()
        else:
            with open(tls[0], "rb") as f:
                cert = f.read()
            with open(tls[1], "rb") as f:
                key = f.read()
        ctx, fingerprint = server_context(cert, key), fingerprint_of(cert)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(64)
    listener.settimeout(0.2)
    shown = f"[{host}]" if ":" in host else host
    return Server(specs, listener, shown, tok, ctx, fingerprint, max_session_bytes)
