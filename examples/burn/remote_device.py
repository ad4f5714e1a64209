"""Burn's "Remote Devices" example (the client): a device a server hosts, used like a local one.

    python examples/burn/remote_device.py             # starts its own server on loopback
    python examples/burn/remote_device.py --address HOST:PORT --token-file TOKEN
    python examples/burn/remote_device.py --address HOST:PORT --token-file TOKEN --fingerprint FP

The page's Rust, line for line::

    let host = RemoteHost::iroh(server_id).with_credential(token);
    let device = Device::remote_options(&host).init()?;
    let tensor = Tensor::<2>::ones([32, 128], &device);
    let output = model.to_device(&device).forward(tensor); // Executed by the remote server.

A host here is ``HOST:PORT`` of a ``python -m remote serve`` or
``examples/burn/remote_server.py`` (plain TCP; with ``--fingerprint``, TLS pinning the
server certificate: our stand-in for Iroh's server id). With no ``--address`` the script
serves one cpu device itself, on loopback, behind a fresh random token. ``init()`` connects
(a wrong token or an unreachable server fails there, as Burn's ``?`` would). The model is a
small MLP, seeded; the script runs it on the CPU first and exits 1 unless the server's output
is the same.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from contextlib import ExitStack

import numpy as np

import remote
import tensorlib as tl
from remote import RemoteHost
from tensorlib import Device, nn

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--address", help="HOST:PORT of a running server (default: start one here)")
parser.add_argument("--token-file", help="file holding that server's token")
parser.add_argument("--fingerprint", help="its TLS certificate's SHA-256 (a --tls server's)")
args = parser.parse_args()
if args.address is None and (args.token_file or args.fingerprint):
    parser.error("--token-file and --fingerprint go with --address")

token: str | bytes | None = None  # None: a server that asks for none (on loopback)
with ExitStack() as stack:
    if args.address is None:
        # Our own server on loopback, with a token nobody else knows: the setup of the
        # page's server example (examples/burn/remote_server.py), in this process.
        fresh = secrets.token_hex(16)
        server = stack.enter_context(
            remote.RemoteServer(["cpu"]).with_authorizer(remote.TokenAuthorizer(fresh)).serve()
        )
        address, token = server.address, fresh
        print(f"started a server with 1 cpu device at {address}")
    else:
        address = args.address
        if args.token_file:
            try:
                with open(args.token_file, "rb") as f:  # as `python -m remote serve` reads it
                    token = f.read().strip()
            except OSError as exc:
                sys.exit(f"cannot read the token: {exc}")
            if not token:
                sys.exit(f"token file {args.token_file} is empty")

    host = RemoteHost(address)
    if token is not None:
        host = host.with_credential(token)
    if args.fingerprint:
        host = host.with_fingerprint(args.fingerprint)
    try:
        device = Device.remote_options(host).init()
    except remote.RemoteError as exc:
        sys.exit(f"cannot use {address}: {exc}")
    print(f"host: {host!r}")
    print(f"device: {device}")

    tl.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    expected = model.forward(tl.ones((32, 128))).numpy()  # the same model, run here

    tensor = tl.ones((32, 128), device=device)
    output = model.to(device).forward(tensor)  # Executed by the remote server.
    # The ops above were streamed without waiting; reading the result is the one wait.
    got = output.numpy()
    stats = remote.stats(device)
    remote.close(device)  # ends the session: the server frees its arrays

print(f"output: {output.shape} {output.dtype} on {output.device}")
print(f"server ran {stats['ops']} op record(s) in {stats['round_trips']} round trip(s)")
diff = float(np.max(np.abs(got - expected)))
print(f"max |remote - local| = {diff:g}")
ok = bool(np.array_equal(got, expected))
print("remote output equals the local run" if ok else "remote output DIFFERS from the local run")
sys.exit(0 if ok else 1)
