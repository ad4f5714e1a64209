"""Burn's "Remote Devices" example (the server): host devices for remote clients.

    python examples/burn/remote_server.py                   # serve, run one demo client, exit
    python examples/burn/remote_server.py --tls             # the same over TLS
    python examples/burn/remote_server.py --serve-for 60 --token-file TOKEN   # a minute
    python examples/burn/remote_server.py --serve-for 0 --device cpu --device cpu  # to Ctrl-C

The page's Rust, line for line::

    let transport = IrohTransport::new(IrohIdentity::load_or_create("server.key")?);
    println!("server id: {}", transport.id());
    RemoteServer::new([Device::cuda(0)])
        .with_authorizer(TokenAuthorizer::new(token)?)
        .serve(transport)?;

``--device cuda:0`` hosts the page's GPU (the default is one cpu device, to run anywhere).
There is no Iroh here: the server listens on plain TCP (loopback unless ``--host`` says
otherwise) and clients prove the token by HMAC challenge-response; with ``--tls`` it also
speaks TLS with a fresh self-signed certificate, whose SHA-256 fingerprint is what clients
pin, as Burn's clients trust an Iroh server id. The script prints the address (and the
fingerprint) and a line a client can paste. The token comes from ``--token-file F`` (read
it, or create F with a fresh random token when it does not exist, as ``load_or_create``
does the key), else it is a fresh random one, printed once in that line.

``serve`` returns at once (the server runs on background threads), so the script decides how
long to serve: by default it serves one demo client of its own (connect, a short op round
trip, check) and exits; ``--serve-for S`` serves S seconds, ``--serve-for 0`` until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import threading
import time

import numpy as np

import remote
import tensorlib as tl
from remote import RemoteHost, RemoteServer, TokenAuthorizer
from tensorlib import Device

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--device", action="append", help="device to host, cpu or cuda:N (repeat; "
                    "default one cpu)")  # fmt: skip
parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
parser.add_argument("--port", type=int, default=0, help="port (default: any free one)")
parser.add_argument("--token-file", help="read the token here, or create it with a fresh one")
parser.add_argument("--tls", action="store_true", help="TLS, a fresh self-signed certificate")
parser.add_argument("--serve-for", type=float, default=None, metavar="SECONDS",
                    help="serve this long, 0: until Ctrl-C (default: serve one demo client "
                    "of its own, then exit)")  # fmt: skip
args = parser.parse_args()
if args.serve_for is not None and args.serve_for < 0:
    parser.error(f"--serve-for must be >= 0, got {args.serve_for:g}")


def load_or_create_token(path: str) -> str | bytes:
    """The token in ``path``, or a fresh one written there (readable by its owner only)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            with open(path, "rb") as f:  # as `python -m remote serve --token-file` reads it
                token = f.read().strip()
        except OSError as exc:
            sys.exit(f"cannot read the token: {exc}")
        if not token:
            sys.exit(f"token file {path} is empty")
        return token
    except OSError as exc:  # no such directory, no permission
        sys.exit(f"cannot create the token file: {exc}")
    fresh = secrets.token_hex(16)
    with os.fdopen(fd, "w") as f:
        f.write(fresh + "\n")
    print(f"wrote a fresh token to {path}")
    return fresh


# A token always: the server refuses to listen off loopback without one, and on loopback it
# still keeps out the machine's other users.
token = load_or_create_token(args.token_file) if args.token_file else secrets.token_hex(16)
builder = RemoteServer(args.device or ["cpu"]).with_authorizer(TokenAuthorizer(token))
builder = builder.with_host(args.host).with_port(args.port)
if args.tls:
    builder = builder.with_tls()
try:
    server = builder.serve()
except (ValueError, OSError, RuntimeError) as exc:  # a bad device or port, no GPU, no TLS
    sys.exit(f"cannot serve: {exc}")

with server:
    print(f"serving {len(server.specs)} device(s) ({', '.join(server.specs)}) at {server.address}")
    if server.fingerprint is not None:
        print(f"fingerprint {server.fingerprint}")  # Burn prints its Iroh server id here
    # What a client dials: this machine's name when listening on every interface.
    wildcard = args.host in ("0.0.0.0", "::")
    dial = f"{socket.gethostname()}:{server.port}" if wildcard else server.address
    if args.token_file:
        fp = f" --fingerprint {server.fingerprint}" if server.fingerprint else ""
        print(f"client: python examples/burn/remote_device.py --address {dial} "
              f"--token-file {args.token_file}{fp}")  # fmt: skip
    else:  # the token's one appearance
        fp = f".with_fingerprint({server.fingerprint!r})" if server.fingerprint else ""
        print(f"client: remote.RemoteHost({dial!r}).with_credential({token!r}){fp}")
    sys.stdout.flush()

    if args.serve_for is None:
        # One demo client of our own, as a user's would connect.
        local = f"127.0.0.1:{server.port}" if wildcard else server.address
        host = RemoteHost(local).with_credential(token)
        if server.fingerprint is not None:
            host = host.with_fingerprint(server.fingerprint)
        device = Device.remote_options(host).init()
        x = tl.arange(6, device=device).reshape(2, 3) * 1.5
        got = x.sum(axis=1).numpy()  # the round trip: ops stream, the read waits
        remote.close(device)
        expected = (np.arange(6).reshape(2, 3) * 1.5).sum(axis=1)
        ok = bool(np.array_equal(got, expected))
        print(f"demo client on {device}: (arange(6).reshape(2, 3) * 1.5).sum(axis=1) = {got}")
        print("demo client's result correct" if ok else "demo client's result WRONG")
        sys.exit(0 if ok else 1)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    start = time.monotonic()
    print("serving until Ctrl-C" if args.serve_for == 0 else f"serving for {args.serve_for:g} s",
          flush=True)  # fmt: skip
    interrupted = stop.wait(args.serve_for or None)
    why = "interrupted" if interrupted else "time is up"
    print(f"stopping after {time.monotonic() - start:.1f} s ({why}); "
          f"{server.stats()['sessions']} session(s) open")  # fmt: skip
