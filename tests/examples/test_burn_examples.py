"""Every example of Burn's distributed computing page (examples/burn/) runs as a script, ends
by itself and prints what the page's code computes.

Each script runs in a subprocess under a hard time limit, as a user would run it: on logical
CPU devices, with any remote server started by the script itself on loopback.
"""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import remote
import tensorlib as tl
from tests.helpers import run_to_end

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "burn"
TIMEOUT_S = 120
pytestmark = pytest.mark.slow  # end-to-end runs of the scripts
HAS_CRYPTOGRAPHY = importlib.util.find_spec("cryptography") is not None


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "TENSORLIB_CPU_DEVICES"):
        env.pop(var, None)  # neither launched nor pre-configured: the script decides
    return env


def _run(script: str, *args: str) -> str:
    """Run ``examples/burn/<script>`` to its end; its stdout, after checking it exited 0."""
    proc = run_to_end([sys.executable, str(EXAMPLES / script), *args], _env(), TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def _epoch_lines(out: str) -> list[tuple[int, float]]:
    """(epoch, valid accuracy) of each of the learner's per-epoch lines."""
    found = re.finditer(r"^epoch (\d+)/\d+  train loss [\d.]+ acc [\d.]+%  valid loss [\d.]+ "
                        r"acc ([\d.]+)%", out, re.M)  # fmt: skip
    return [(int(m.group(1)), float(m.group(2)) / 100) for m in found]


@pytest.mark.timeout(TIMEOUT_S + 10)
@pytest.mark.parametrize("n", [1, 4])
def test_all_reduce_sums_and_averages_over_the_device_list(n: int) -> None:
    out = _run("all_reduce.py", "--devices", str(n))
    names = ["cpu"] + [f"cpu:{i}" for i in range(1, n)]
    assert f"devices: {', '.join(names)}" in out
    total, mean = n * (n + 1) // 2, (n + 1) / 2
    for name in names:  # every device holds the same result, on its own device
        assert re.search(rf"^{name}: sum {total}  mean {mean:g}  on {name}$", out, re.M), out
    assert "reduced values correct" in out


@pytest.mark.timeout(TIMEOUT_S + 10)
def test_ddp_training_trains_over_two_logical_devices(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the example's digits ship with scikit-learn")
    out = _run("ddp_training.py", "--epochs", "2", "--artifact-dir", str(tmp_path))
    assert "strategy: ExecutionStrategy.ddp([cpu, cpu:1], all_reduce_op=mean)" in out
    epochs = _epoch_lines(out)
    assert [e for e, _ in epochs] == [1, 2], out
    assert epochs[-1][1] >= 0.85, out
    assert "with DDP over 2 device(s)" in out
    assert "model on cpu," in out  # back on the main device
    assert (tmp_path / "checkpoint.npz").is_file()


@pytest.mark.timeout(TIMEOUT_S + 10)
def test_remote_device_runs_the_model_on_its_own_server_as_locally() -> None:
    out = _run("remote_device.py")
    m = re.search(r"^started a server with 1 cpu device at (127\.0\.0\.1:\d+)$", out, re.M)
    assert m is not None, out
    address = m.group(1)
    assert f"host: RemoteHost('{address}', credential=***)" in out  # the token is never shown
    assert f"device: remote://{address}/0" in out
    assert f"output: (32, 10) float32 on remote://{address}/0" in out
    assert "in 1 round trip(s)" in out  # the ops streamed; only the read waited
    assert "max |remote - local| = 0" in out
    assert "remote output equals the local run" in out


@pytest.mark.timeout(TIMEOUT_S + 10)
@pytest.mark.parametrize(
    "tls",
    [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_CRYPTOGRAPHY, reason="--tls "
                                                         "certificates need cryptography"))],
)  # fmt: skip
def test_remote_server_serves_its_own_demo_client(tmp_path: Path, tls: bool) -> None:
    # With --tls, also a --token-file that does not exist yet: the script creates it.
    token_file = tmp_path / "token"
    out = _run("remote_server.py", *(["--tls", "--token-file", str(token_file)] if tls else []))
    m = re.search(r"^serving 1 device\(s\) \(cpu\) at (127\.0\.0\.1:\d+)$", out, re.M)
    assert m is not None, out
    address = m.group(1)
    if tls:
        fp = re.search(r"^fingerprint ([0-9a-f]{64})$", out, re.M)
        assert fp is not None, out
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert token_file.read_text().strip() not in out  # the file holds it, not the output
        assert f"wrote a fresh token to {token_file}" in out
        assert (
            f"client: python examples/burn/remote_device.py --address {address} --token-file "
            f"{token_file} --fingerprint {fp.group(1)}"
        ) in out
    else:  # a fresh token, printed once, in the line a client pastes
        assert "fingerprint" not in out
        assert re.search(
            rf"^client: remote\.RemoteHost\('{address}'\)\.with_credential\('[0-9a-f]{{32}}'\)$",
            out, re.M,
        ), out  # fmt: skip
    assert f"demo client on remote://{address}/0: " in out and "[ 4.5 18. ]" in out
    assert "demo client's result correct" in out


@pytest.mark.timeout(TIMEOUT_S + 10)
def test_remote_server_serves_a_client_here_for_the_time_asked(tmp_path: Path) -> None:
    token = "s3cret-token"  # tests/remote/conftest.py's
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    cmd = [sys.executable, str(EXAMPLES / "remote_server.py"), "--device", "cpu", "--device",
           "cpu", "--token-file", str(token_file), "--serve-for", "3"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        end = time.monotonic() + 60
        while time.monotonic() < end and not (lines and lines[-1].startswith("serving for")):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
        head = "\n".join(lines)
        m = re.search(r"^serving 2 device\(s\) \(cpu, cpu\) at (127\.0\.0\.1:\d+)$", head, re.M)
        assert m is not None and lines[-1] == "serving for 3 s", head
        address = m.group(1)
        assert (
            f"client: python examples/burn/remote_device.py --address {address} "
            f"--token-file {token_file}"
        ) in lines
        # A client in this process: the page's lines against the script's server.
        host = remote.RemoteHost(address).with_credential(token)
        device = tl.Device.remote_options(host).index(1).init()
        assert str(device) == f"remote://{address}/1"
        y = (tl.ones((32, 128), device=device) * 2).sum(axis=0)
        np.testing.assert_array_equal(y.numpy(), np.full(128, 64.0))
        remote.close(device)
        with pytest.raises(remote.RemoteAuthError):
            tl.Device.remote_options(remote.RemoteHost(address).with_credential("wrong")).init()
        rest, err = proc.communicate(timeout=60)  # it stops by itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, f"{head}\n{rest}\n{err}"
    stopped = r"^stopping after 3\.\d s \(time is up\); 0 session\(s\) open$"
    assert re.search(stopped, rest, re.M), rest


@pytest.mark.timeout(TIMEOUT_S + 10)
def test_remote_ddp_trains_over_the_devices_of_its_own_server(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the example's digits ship with scikit-learn")
    out = _run("remote_ddp.py", "--epochs", "2", "--artifact-dir", str(tmp_path))
    m = re.search(r"^started a server with 2 cpu device\(s\) at (127\.0\.0\.1:\d+)$", out, re.M)
    assert m is not None, out
    devs = f"remote://{m.group(1)}/0, remote://{m.group(1)}/1"
    assert f"strategy: ExecutionStrategy.ddp([{devs}], all_reduce_op=mean)" in out
    epochs = _epoch_lines(out)
    assert [e for e, _ in epochs] == [1, 2], out
    assert epochs[-1][1] >= 0.85, out
    assert "with DDP over 2 remote device(s)" in out
    assert f"model on remote://{m.group(1)}/0," in out  # on the main device, the server's
    assert (tmp_path / "checkpoint.npz").is_file()
