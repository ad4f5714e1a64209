"""``python -m remote serve --device cpu --device cuda:0 --port P --token-file F [--tls]``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .server import serve


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m remote", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="host devices for remote clients")
    s.add_argument("--device", action="append", required=True, help="cpu or cuda:N (repeat)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    s.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    s.add_argument("--token-file", help="file holding the shared token (required off loopback)")
    s.add_argument("--tls", action="store_true", help="TLS with a fresh self-signed certificate")
    s.add_argument("--tls-cert", help="PEM certificate to use instead (with --tls-key)")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--max-session-bytes", type=int, help="what one session's arrays may hold")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; serve until SIGINT or SIGTERM."""
    args = _parser().parse_args(argv)
    token = None
    if args.token_file:
        with open(args.token_file, "rb") as f:
            token = f.read().strip()
        if not token:
            print(f"error: token file {args.token_file} is empty", file=sys.stderr)
            return 2
    tls: bool | tuple[str, str] = bool(args.tls)
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            print("error: --tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        tls = (args.tls_cert, args.tls_key)
    try:
        server = serve(
            args.device, host=args.host, port=args.port, token=token, tls=tls,
            max_session_bytes=args.max_session_bytes,
        )  # fmt: skip
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"serving {len(server.specs)} device(s) at {server.address}", flush=True)
    if server.fingerprint is not None:
        print(f"fingerprint {server.fingerprint}", flush=True)
    with server:
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
