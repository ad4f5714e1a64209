"""Fixtures of the remote tests: servers in a subprocess (``python -m remote serve``) or in
this process, each with a hard deadline, and the digits MLP both sides train."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import remote
import tensorlib as tl
import tensorlib.functional as F
from tensorlib import nn, optim

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


def env() -> dict[str, str]:
    """The environment of a subprocess: this checkout first on its path."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH", "")) if p)
    return e


class ServerProcess:
    """A ``python -m remote serve`` subprocess; ``address`` once it printed it."""

    def __init__(self, args: list[str], deadline: float = 20.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "remote", "serve", *args],
            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        end = time.monotonic() + deadline
        assert self.proc.stdout is not None
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.strip())
            if line.startswith("serving"):
                self.address = line.split()[-1]
                if "--tls" in args:
                    self.lines.append(self.proc.stdout.readline().strip())
                return
        err = self.proc.stderr.read() if self.proc.stderr else ""
        self.kill()
        raise RuntimeError(f"server did not start: {self.lines} {err}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers (``start("--device", "cpu", ...)``, the token file added); all are
    killed at the end."""
    started: list[ServerProcess] = []
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    def start(*args: str, token: bool = True) -> ServerProcess:
        extra = ["--token-file", str(token_file)] if token else []
        s = ServerProcess([*args, *extra])
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.fixture(scope="module")
def local_server() -> Iterator[remote.Server]:
    """One in-process server with two cpu devices for a module's tests."""
    with remote.serve(["cpu", "cpu"], token=TOKEN) as server:
        yield server


@pytest.fixture(scope="module")
def rdev(local_server: remote.Server) -> tl.Device:
    """Device 0 of the module's in-process server."""
    return remote.devices(local_server.address, token=TOKEN)[0]


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1.0)
    return x.astype(np.float64), y.astype(np.int64)


def train_mlp(dev: Any, steps: int = 50, batch: int = 64) -> tuple[list[np.ndarray], list[float]]:
    """The digits MLP (64-128-128-10, ReLU, cross-entropy, AdamW, float64) on ``dev``:
    its parameters and losses after ``steps`` steps from seed 0."""
    tl.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    ).to(tl.float64)
    model.to(dev)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    x, y = digits()
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        xb, yb = tl.tensor(x[idx], device=dev), tl.tensor(y[idx], device=dev)
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.numpy() for p in model.parameters()], losses
