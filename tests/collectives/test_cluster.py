"""torchrun's multi-node contract for ``python -m collectives.run``, nodes simulated here.

A node is one launcher process on this machine, every rendezvous on 127.0.0.1. The workers
(``cluster_worker.py``) run a few exact steps with checkpoint and resume, so every scenario's
result is compared bitwise with :func:`cluster_worker.reference`. Every launcher runs in its
own session with a hard deadline, and every test ends what it started (process groups).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import collectives
from collectives._store import StoreError, TCPStore
from collectives.run import free_port, parse_args
from tests.collectives.cluster_worker import reference

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("cluster_worker.py")
# Short rendezvous timeouts: a lost node shows in 1.2 s, a round's last call lasts 0.5 s.
FAST = "keep_alive_interval=0.3,keep_alive_max_attempt=4,last_call_timeout=0.5,join_timeout=15"

pytestmark = pytest.mark.skipif(
    "cpu" not in collectives.available_backends(), reason="the cpu backend is not available"
)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_"))}
    env["TMPDIR"] = str(tmp_path)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("DPT_STORE_SECRET", None)
    env.update(extra)
    return env


class _Nodes:
    """Launcher processes standing for nodes; every one ended (its group) on the way out."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        i = len(self.procs)
        with open(self.tmp / f"node{i}.err", "w") as err:  # the child keeps its own copy
            proc = subprocess.Popen(
                [sys.executable, "-m", "collectives.run", "--grace-period", "1", *args],
                cwd=self.tmp,
                env=env or _env(self.tmp),
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def err(self, proc: subprocess.Popen[str]) -> str:
        return (self.tmp / f"node{self.procs.index(proc)}.err").read_text()

    def wait(self, proc: subprocess.Popen[str], timeout: float) -> int:
        """The launcher's exit code; a launcher still running after ``timeout`` fails the test."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"launcher pid {proc.pid} still running after {timeout} s:\n{self.err(proc)}"
            )

    def close(self) -> None:
        for proc in self.procs:
            for sig in (signal.SIGKILL,):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.wait()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[_Nodes]:
    n = _Nodes(tmp_path)
    try:
        yield n
    finally:
        n.close()


def _c10d(port: int, nnodes: str, *extra: str, conf: str = FAST) -> list[str]:
    return [
        *("--nnodes", nnodes, "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job42", "--rdzv-conf", conf),
        *extra,
    ]


def _work(out: Path, steps: int, *extra: str) -> list[str]:
    return [str(WORKER), str(out), str(steps), *extra]


def _starts(out: Path) -> list[dict[str, Any]]:
    path = out / "starts.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _final(out: Path) -> dict[str, Any]:
    return json.loads((out / "final.json").read_text())


def _until(what: str, cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _ckpt_step(out: Path) -> int:
    try:
        return int(json.loads((out / "ckpt.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1


# ---------------------------------------------------------------------- jobs that succeed
@pytest.mark.timeout(60)
def test_two_nodes_from_pet_variables_only(tmp_path: Path, nodes: _Nodes) -> None:
    # Kubeflow's PyTorchJob: the operator sets PET_*, the command has no launcher flags.
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = [
        nodes.start(
            *_work(out, 6),
            env=_env(
                tmp_path,
                PET_NNODES="2",
                PET_NPROC_PER_NODE="2",
                PET_NODE_RANK=str(i),
                PET_MASTER_ADDR="127.0.0.1",
                PET_MASTER_PORT=str(port),
            ),
        )
        for i in (1, 0)
    ]
    for proc in procs:
        assert nodes.wait(proc, 45) == 0, nodes.err(proc)
    starts = _starts(out)
    assert sorted((s["rank"], s["node"], s["world"]) for s in starts) == [
        (0, 0, 4),
        (1, 0, 4),
        (2, 1, 4),
        (3, 1, 4),
    ]
    assert _final(out)["w"] == reference(6)


@pytest.mark.slow  # waits out rendezvous rounds and keep-alives
@pytest.mark.timeout(60)
def test_three_nodes_get_node_ranks_in_join_order(tmp_path: Path, nodes: _Nodes) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = []
    for i in range(3):
        # torchrun's underscore spellings on one node: both are accepted.
        flags = _c10d(port, "3")
        if i == 1:
            flags = [f.replace("rdzv-", "rdzv_") for f in flags]
        procs.append(nodes.start(*flags, *_work(out, 6)))
        if i < 2:  # the next launcher starts once this one has joined: a known join order
            _until(f"launcher {i} to join", lambda i=i: _joined(port) == i + 1)
    for i, proc in enumerate(procs):
        assert nodes.wait(proc, 45) == 0, nodes.err(proc)
        assert f"this is node {i} of 3 (ranks {i}..{i} of 3" in nodes.err(proc)
    starts = _starts(out)
    assert sorted((s["rank"], s["node"], s["world"], s["restart"]) for s in starts) == [
        (0, 0, 3, 0),
        (1, 1, 3, 0),
        (2, 2, 3, 0),
    ]
    assert _final(out)["w"] == reference(6)


def _joined(port: int) -> int:
    try:
        with TCPStore("127.0.0.1", port, is_server=False, timeout=2, connect_timeout=0.2) as s:
            return s.add("rdzv/job42/r0/joined", 0)
    except StoreError:  # not served yet
        return 0


# ---------------------------------------------------------------------- failures
@pytest.mark.slow  # waits out rendezvous rounds and keep-alives
@pytest.mark.timeout(60)
def test_worker_killed_on_node_1_restarts_every_node_bitwise(tmp_path: Path, nodes: _Nodes) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    host = nodes.start(
        *_c10d(port, "2", "--nproc-per-node", "2", "--max-restarts", "1"),
        *_work(out, 10, "--kill", "1:3"),
    )
    _until("the host launcher to serve the rendezvous", lambda: _joined(port) == 1)
    other = nodes.start(
        *_c10d(port, "2", "--nproc-per-node", "2", "--max-restarts", "1"),
        *_work(out, 10, "--kill", "1:3"),
    )
    for proc in (host, other):
        assert nodes.wait(proc, 45) == 0, nodes.err(proc)
    starts = _starts(out)
    # Round 0 (4 ranks), then every rank of both nodes again with DPT_RESTART_COUNT=1.
    assert sorted((s["restart"], s["rank"]) for s in starts) == [
        (a, r) for a in (0, 1) for r in range(4)
    ]
    assert _final(out) == {"w": reference(10), "world": 4, "restart": 1}
    # Both nodes report the failed worker of node 1 (round 0's node 1: the second joiner).
    killed = "rank 2 (of 4; local rank 0 on"
    assert killed in nodes.err(other) and "killed by SIGKILL" in nodes.err(other)
    assert "node 1 (" in nodes.err(host) and "reported a failed worker" in nodes.err(host)
    assert killed in nodes.err(host)
    for proc in (host, other):
        assert "restarting every node's workers in rendezvous round 1 (restart 1 of 1" in nodes.err(
            proc
        )


@pytest.mark.slow  # waits out rendezvous rounds and keep-alives
@pytest.mark.timeout(60)
def test_lost_node_with_fixed_nnodes_ends_the_others(tmp_path: Path, nodes: _Nodes) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    job = _work(out, 200, "--step-sleep", "0.05")
    host = nodes.start(*_c10d(port, "2"), *job)
    _until("the host launcher to serve the rendezvous", lambda: _joined(port) == 1)
    lost = nodes.start(*_c10d(port, "2", conf=FAST + ",is_host=false"), *job)
    _until("a few steps", lambda: _ckpt_step(out) >= 2)
    os.kill(lost.pid, signal.SIGKILL)  # its worker dies with it (parent-death signal)
    t0 = time.monotonic()
    code = nodes.wait(host, 1.2 + 10)
    err = nodes.err(host)
    assert code == 1, err
    assert time.monotonic() - t0 < 1.2 + 10
    assert f"node 1, {os.uname().nodename} (127.0.0.1, launcher pid {lost.pid}), was lost" in err
    assert "fewer than the 2 the job needs (--nnodes 2)" in err


@pytest.mark.slow  # waits out rendezvous rounds and keep-alives
@pytest.mark.timeout(90)
def test_elastic_node_lost_then_replaced(tmp_path: Path, nodes: _Nodes) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    job = _work(out, 12, "--step-sleep", "0.05", "--hold-below", "2")
    host = nodes.start(*_c10d(port, "1:2"), *job)
    _until("the host launcher to serve the rendezvous", lambda: _joined(port) == 1)
    first = nodes.start(*_c10d(port, "1:2", conf=FAST + ",is_host=false"), *job)
    # Round 0 has both nodes, or (a slow start: the second came after the last call) round 1
    # does, the second's arrival being a membership change: r is that round.
    _until("a round of both nodes", lambda: any(s["world"] == 2 for s in _starts(out)))
    r = min(s["restart"] for s in _starts(out) if s["world"] == 2)
    _until("a few steps", lambda: _ckpt_step(out) >= 2)
    os.kill(first.pid, signal.SIGKILL)
    # The survivor goes on alone, from its checkpoint, in round r + 1.
    _until(
        "the survivor to restart alone",
        lambda: any(s["world"] == 1 and s["restart"] > r for s in _starts(out)),
    )
    replacement = nodes.start(*_c10d(port, "1:2", conf=FAST + ",is_host=false"), *job)
    for proc in (host, replacement):
        assert nodes.wait(proc, 60) == 0, nodes.err(proc)
    starts = _starts(out)
    alone = [s for s in starts if s["world"] == 1 and s["restart"] > r]
    assert len(alone) == 1 and alone[0]["restart"] == r + 1, starts
    last = [s for s in starts if s["restart"] == r + 2]
    assert sorted((s["rank"], s["world"]) for s in last) == [(0, 2), (1, 2)], starts
    assert {s["pid"] for s in last}.isdisjoint(s["pid"] for s in starts if s["restart"] <= r + 1)
    assert _final(out) == {"w": reference(12), "world": 2, "restart": r + 2}
    assert "was lost" in nodes.err(host)
    assert f"continuing in round {r + 1} without it" in nodes.err(host)
    assert "a node is waiting to join" in nodes.err(host)
    assert f"DPT_RESTART_COUNT={r + 2}" in nodes.err(replacement)


# ---------------------------------------------------------------------- bad input
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (
            ["--nnodes", "2"],
            {"PET_NNODES": "3"},
            "conflicting values for the number of nodes: --nnodes 2 (flag) but PET_NNODES=3 "
            "(torchrun's environment)",
        ),
        (
            ["--nproc-per-node", "2"],
            {"PET_NPROC_PER_NODE": "8"},
            "--nproc-per-node 2 (flag) but PET_NPROC_PER_NODE=8",
        ),
        (
            ["--master-addr", "127.0.0.1", "--master-port", "29500"],
            {
                "PET_NNODES": "2",
                "PET_NODE_RANK": "1",
                "SLURM_STEP_NUM_NODES": "2",
                "SLURM_NODEID": "0",
            },
            "this node's rank: PET_NODE_RANK=1 (torchrun's environment) but SLURM_NODEID=0 "
            "(SLURM's environment)",
        ),
        (
            ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"],
            {"SLURM_STEP_NUM_NODES": "4", "SLURM_NODEID": "0"},
            "the number of nodes: --nnodes 2 (flag) but SLURM_STEP_NUM_NODES=4",
        ),
        (
            ["--nnodes", "3:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1"],
            {},
            "--nnodes: MIN must be <= MAX in MIN:MAX, got '3:2' (3 > 2)",
        ),
        (["--nnodes", "1:2"], {}, "needs --rdzv-backend c10d"),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400"],
            {},
            "is not a loopback address, so every node must prove a shared secret: set "
            "DPT_STORE_SECRET",
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "no-such-host.invalid:29400"],
            {},
            "the rendezvous endpoint's host 'no-such-host.invalid' does not resolve",
        ),
        (["--rdzv-backend", "c10d"], {}, "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT"),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1", "--rdzv-conf", "x=1"],
            {},
            "--rdzv-conf: unknown key 'x'",
        ),
        (["--rdzv-backend", "etcd"], {}, "--rdzv-backend: expected one of static, c10d"),
    ],
)
def test_bad_input_is_a_clear_usage_error(
    argv: list[str], environ: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args([*argv, "train.py"], environ=environ)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_pet_variables_fill_in_and_agree_with_flags() -> None:
    env = {
        "PET_NNODES": "1:4",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "localhost:29411",
        "PET_RDZV_ID": "job7",
        "PET_MAX_RESTARTS": "3",
    }
    cfg = parse_args(["--nproc_per_node", "2", "t.py"], environ=env)
    assert cfg.nproc_per_node == 2 and cfg.max_restarts == 3 and cfg.rdzv is not None
    assert (cfg.rdzv.min_nodes, cfg.rdzv.max_nodes) == (1, 4)
    assert (cfg.rdzv.host, cfg.rdzv.port, cfg.rdzv.rdzv_id) == ("localhost", 29411, "job7")
    # srun: the step's node count and node id, when nothing else gives them.
    slurm = {"SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1"}
    cfg = parse_args(
        ["--master-addr", "127.0.0.1", "--master-port", "29500", "t.py"], environ=slurm
    )
    assert (cfg.nnodes, cfg.node_rank, cfg.world_size) == (2, 1, 2) and cfg.rdzv is None


@pytest.mark.slow  # waits out a join timeout
@pytest.mark.timeout(30)
def test_unreachable_endpoint_and_wrong_secret_fail_within_seconds(
    tmp_path: Path, nodes: _Nodes
) -> None:
    port = free_port()
    conf = "join_timeout=1.5,is_host=false"
    t0 = time.monotonic()
    lonely = nodes.start(*_c10d(port, "2", conf=conf), "t.py")
    assert nodes.wait(lonely, 10) == 1
    assert time.monotonic() - t0 < 10
    assert f"the rendezvous store at 127.0.0.1:{port} is unreachable" in nodes.err(lonely)
    # A launcher with another secret than the one serving the rendezvous.
    host = nodes.start(*_c10d(port, "2"), "t.py", env=_env(tmp_path, DPT_STORE_SECRET="s1"))
    _until("the host launcher to serve the rendezvous", lambda: nodes.err(host) != "" or _up(port))
    intruder = nodes.start(
        *_c10d(port, "2", conf=conf), "t.py", env=_env(tmp_path, DPT_STORE_SECRET="s2")
    )
    assert nodes.wait(intruder, 10) == 1
    err = nodes.err(intruder)
    assert f"the rendezvous store at 127.0.0.1:{port} refused this node" in err, err
    assert "the same DPT_STORE_SECRET" in err


def _up(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---------------------------------------------------------------------- the main job
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("form", "nnodes", "nproc"),
    [("c10d", 2, 1), ("pet", 2, 2), ("static", 3, 1)],
    ids=["c10d-2x1", "pet-2x2", "static-3x1"],
)
def test_train_ddp_on_nodes_matches_one_node(
    tmp_path: Path, nodes: _Nodes, form: str, nnodes: int, nproc: int
) -> None:
    # examples/train_ddp.py (the main job) on simulated nodes, each form of the contract:
    # torchrun's c10d flags (node ranks from the rendezvous), Kubeflow's PET_* only, and the
    # static flags; against one node with the same world size. One BLAS thread per worker in
    # both, so the arithmetic is the same.
    script = [str(REPO / "examples" / "train_ddp.py"), "--epochs", "1", "--no-progress"]
    script += ["--batch-size", "48"]  # divisible by 2, 3 and 4 workers
    env = _env(tmp_path, OMP_NUM_THREADS="1")
    port = free_port()
    many = []
    for i in range(nnodes):
        ckpt = ["--checkpoint", str(tmp_path / f"n{i}.npz")]
        if form == "c10d":
            many.append(nodes.start(*_c10d(port, str(nnodes)), *script, *ckpt, env=env))
        elif form == "pet":
            pet = {"PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": str(nproc)}
            pet |= {"PET_NODE_RANK": str(i), "PET_MASTER_ADDR": "127.0.0.1"}
            pet |= {"PET_MASTER_PORT": str(port)}
            many.append(nodes.start(*script, *ckpt, env={**env, **pet}))
        else:
            flags = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
            flags += ["--node-rank", str(i), "--master-addr", "127.0.0.1"]
            flags += ["--master-port", str(port)]
            many.append(nodes.start(*flags, *script, *ckpt, env=env))
    world = str(nnodes * nproc)
    ckpt_one = ["--checkpoint", str(tmp_path / "one.npz")]
    one = nodes.start("--nproc-per-node", world, *script, *ckpt_one, env=env)
    for proc in (*many, one):
        assert nodes.wait(proc, 150) == 0, nodes.err(proc)
    import numpy as np

    saved = [p for i in range(nnodes) if (p := tmp_path / f"n{i}.npz").exists()]
    assert len(saved) == 1  # rank 0 saves, on node 0
    with np.load(saved[0]) as a, np.load(tmp_path / "one.npz") as b:
        # Model, optimizer and step: every array of the checkpoint.
        arrays = [k for k in b.files if k != "__manifest__"]
        assert len(arrays) > 4 and sorted(a.files) == sorted(b.files)
        for k in arrays:
            assert np.array_equal(a[k], b[k]), k
