"""Burn's "DDP on Remote Devices" example: ExecutionStrategy.ddp over every device of a server.

    python examples/burn/remote_ddp.py                   # its own server, 2 cpu devices
    python examples/burn/remote_ddp.py --devices 4 --epochs 3
    python examples/burn/remote_ddp.py --address HOST:PORT --token-file TOKEN [--fingerprint FP]

The page's Rust::

    let devices = Device::enumerate(DeviceType::Remote(RemoteHost::websocket(ADDRESS)));
    crate::launch(ExecutionStrategy::ddp(
        devices.into_vec(),
        DistributedConfig { all_reduce_op: ReduceOperation::Mean },
    ));

``launch`` is examples/burn/ddp_training.py's training (the same model, data and Learner,
repeated here so each script reads on its own): one replica and one rank thread per device
of the server, each global batch split across them, and the gradients averaged **on the
server** among its devices, so they never travel to the client. With no ``--address`` the
script serves ``--devices`` cpu devices itself, on loopback, behind a fresh random token
(``python -m remote serve --device cpu --device cpu`` does the same in its own process).
The data are scikit-learn's 8x8 digits; an epoch takes a fraction of a second, and the
figures are ddp_training.py's over as many logical CPU devices (about 95% validation
accuracy after 2 epochs): the server runs the same NumPy and reduces in the same order.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from contextlib import ExitStack

import numpy as np

import remote
import tensorlib as tl
import tensorlib.functional as F
from collectives.distributed import DistributedConfig, ReduceOperation
from ddp import DataLoader
from ddp.learner import ExecutionStrategy, Learner, SupervisedTraining
from remote import RemoteHost
from tensorlib import Device, DeviceType, nn, optim

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--address", help="HOST:PORT of a running server (default: start one here)")
parser.add_argument("--token-file", help="file holding that server's token")
parser.add_argument("--fingerprint", help="its TLS certificate's SHA-256 (a --tls server's)")
parser.add_argument("--devices", type=int, default=2, help="cpu devices of our own server (2)")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--artifact-dir", default=None, help="checkpoint directory (default: temp)")
args = parser.parse_args()
if args.devices < 1 or args.epochs < 1:
    parser.error("--devices and --epochs must be at least 1")
if args.address is None and (args.token_file or args.fingerprint):
    parser.error("--token-file and --fingerprint go with --address")

# The digits (1,797 8x8 images, 10 classes), standardized; a fixed 80/20 split, as in
# ddp_training.py.
try:
    from sklearn.datasets import load_digits
except ImportError:
    raise SystemExit("this example needs scikit-learn: pip install -e '.[examples]'") from None
x, y = load_digits(return_X_y=True)
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order].astype(np.float32), y[order].astype(np.int64)
x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1.0)
n_valid = len(x) // 5
dataloader_train = DataLoader((x[n_valid:], y[n_valid:]), batch_size=64, shuffle=True, seed=0)
dataloader_valid = DataLoader((x[:n_valid], y[:n_valid]), batch_size=256)


def launch(strategy: ExecutionStrategy) -> None:
    """ddp_training.py's training under ``strategy`` (Burn's ``crate::launch``)."""
    tl.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model.to(strategy.main_device())
    optimizer = optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * len(dataloader_train)
    )
    artifact_dir = args.artifact_dir or tempfile.mkdtemp(prefix="burn-remote-ddp-")
    training = (
        SupervisedTraining(
            artifact_dir, dataloader_train, dataloader_valid, loss_fn=F.cross_entropy
        )
        .with_training_strategy(strategy)
        .num_epochs(args.epochs)
    )
    result = training.launch(Learner(model, optimizer, lr_scheduler))
    last = result.history[-1]
    print(
        f"trained {len(result.history)} epoch(s) with DDP over {len(strategy.devices)} remote "
        f"device(s): final valid loss {last.valid_loss:.4f}, valid accuracy "
        f"{last.valid_accuracy:.2%}"
    )
    main = next(iter(result.model.parameters())).device
    print(f"model on {main}, checkpoint {result.checkpoint}")


token: str | bytes | None = None  # None: a server that asks for none (on loopback)
with ExitStack() as stack:
    if args.address is None:
        # Our own server: --devices cpu devices of one process, on loopback, with a token
        # nobody else knows. Their gradients are reduced in that process, among its devices.
        fresh = secrets.token_hex(16)
        server = stack.enter_context(
            remote.RemoteServer(["cpu"] * args.devices)
            .with_authorizer(remote.TokenAuthorizer(fresh))
            .serve()
        )
        address, token = server.address, fresh
        print(f"started a server with {args.devices} cpu device(s) at {address}")
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

    # Burn's enumerate panics where the server cannot be reached; ours raises RemoteError.
    try:
        devices = Device.enumerate(DeviceType.Remote(host))
    except remote.RemoteError as exc:
        sys.exit(f"cannot use {address}: {exc}")
    for device in devices:
        stack.callback(remote.close, device)  # end each session before the server stops
    strategy = ExecutionStrategy.ddp(
        devices.into_vec(), DistributedConfig(all_reduce_op=ReduceOperation.Mean)
    )
    print(f"strategy: {strategy!r}")
    launch(strategy)
