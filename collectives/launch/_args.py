"""The command line of ``python -m collectives.run``: options, checks, :class:`LaunchConfig`.

:func:`parse_args` turns argv (and torchrun's ``PET_*`` and SLURM's variables, see
:mod:`collectives.launch._cluster_env`) into a config (exit status 2 and a message for bad
input); the supervisor in :mod:`collectives.run` runs it.

Two ways for nodes to meet, torchrun's ``--rdzv-backend``:

- ``static`` (the default): each node is told its ``--node-rank``, rank 0's
  ``--master-addr``/``--master-port`` and ``--nnodes``; the launchers never talk to each
  other, so ``--max-restarts`` needs one node.
- ``c10d``: every node's launcher joins rounds on a store at ``--rdzv-endpoint`` (served by
  the launcher on that host); node ranks, world size and rank 0's address come from the
  round, ``--nnodes`` may be ``MIN:MAX``, and restarts end and restart every node's workers
  (:mod:`collectives.launch._elastic`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .._store import SECRET_ENV_VAR, is_loopback
from ._cluster_env import ClusterEnvError, Sourced, conflict, pick, slurm_node_count, slurm_node_id
from ._launcher import DEFAULT_GRACE_PERIOD, free_port, new_run_id
from ._rdzv_config import RdzvConfig, parse_endpoint, parse_nnodes, parse_rdzv_conf

__all__ = ["PROG", "LaunchConfig", "parse_args"]

PROG = "collectives.run"
_BACKENDS = ("static", "c10d")


@dataclass(frozen=True)
class LaunchConfig:
    """What to start and where it sits in the job.

    Attributes:
        target: the script path, or the module name when ``module`` is True.
        target_args: its command-line arguments.
        module: run ``python -m target`` instead of a script.
        nproc_per_node: workers on this node.
        nnodes: nodes in the job (each runs one launcher with the same ``nproc_per_node``);
            with ``rdzv``, the most nodes a round takes.
        node_rank: this node's index; its workers get ranks ``node_rank * nproc_per_node + i``
            (static rendezvous; with ``rdzv`` the round assigns it).
        master_addr: rank 0's host (static rendezvous).
        master_port: rank 0's store port (static rendezvous).
        grace_period: seconds between SIGTERM and SIGKILL when ending workers.
        run_id: the job's id (DPT_RUN_ID of the first attempt; restart k gets ``<id>.r<k>``).
        max_restarts: how often the job starts again after a failed attempt.
        fixed_port: every attempt reuses ``master_port`` (it was given); else each restart
            takes a fresh free port.
        rdzv: the c10d rendezvous's settings; None for the static one.
        notes: lines the launcher prints first (settings it was given but does not use).
    """

    target: str
    target_args: tuple[str, ...]
    module: bool
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    grace_period: float
    run_id: str
    max_restarts: int = 0
    fixed_port: bool = True
    rdzv: RdzvConfig | None = None
    notes: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        """Total number of ranks (static rendezvous; a c10d round sets its own)."""
        return self.nnodes * self.nproc_per_node


# ---------------------------------------------------------------------- value parsers
def _int_at_least(minimum: int, what: str) -> Callable[[str, str], int]:
    def parse(source: str, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"{source}: expected {what}, got {text!r}")
        return value

    return parse


_positive = _int_at_least(1, "a positive integer")
_restarts = _int_at_least(0, "a number of restarts (an integer >= 0)")
_node_rank = _int_at_least(0, "a node rank (an integer >= 0)")
_port = _int_at_least(1, "a port in [1, 65535]")


def _text(source: str, text: str) -> str:
    if not text.strip():
        raise ValueError(f"{source}: expected a non-empty value")
    return text.strip()


def _backend(source: str, text: str) -> str:
    if text.strip() not in _BACKENDS:
        raise ValueError(f"{source}: expected one of {', '.join(_BACKENDS)}, got {text!r}")
    return text.strip()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Start one worker process per rank with a torchrun-compatible "
        "environment; end them all and report the failed rank's traceback on the first "
        "failure. Every option below also reads torchrun's PET_<NAME> variable "
        "(PET_NNODES, PET_NPROC_PER_NODE, ...); a flag and its variable must agree.",
    )
    add = p.add_argument
    add("--nproc-per-node", "--nproc_per_node", help="workers to start on this node (default 1)")
    add(
        "--nnodes",
        help="nodes in the job, N or MIN:MAX (c10d); each runs this launcher (default 1, or "
        "the srun step's node count)",
    )
    add(
        "--node-rank",
        "--node_rank",
        help="this node's index in [0, nnodes) (static rendezvous; default 0 or SLURM_NODEID)",
    )
    add("--master-addr", "--master_addr", help="rank 0's host (static rendezvous)")
    add("--master-port", "--master_port", help="rank 0's store port (static rendezvous)")
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        help="static (default: node ranks given) or c10d (node ranks from a rendezvous)",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        help="HOST[:PORT] of the rendezvous store, served by that host's launcher (port 29400)",
    )
    add("--rdzv-id", "--rdzv_id", help="the job's id in the rendezvous (default 'none')")
    add(
        "--rdzv-conf",
        "--rdzv_conf",
        help="key=value,... : join_timeout, last_call_timeout, keep_alive_interval, "
        "keep_alive_max_attempt, is_host",
    )
    add(
        "--standalone",
        action="store_true",
        help="one node with a free port (the default when --nnodes is 1; for torchrun scripts)",
    )
    add(
        "--max-restarts",
        "--max_restarts",
        help="start the whole job again after a failed attempt, up to this many times "
        "(default 0; several nodes need --rdzv-backend c10d)",
    )
    add(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        help=f"seconds between SIGTERM and SIGKILL when ending workers (default "
        f"{DEFAULT_GRACE_PERIOD:g})",
    )
    add("--run-id", "--run_id", default=None, help="job id exported as DPT_RUN_ID")
    add("-m", "--module", action="store_true", help="run the target as a module, like `python -m`")
    add("target", metavar="script.py|module", help="the training script or module")
    add("target_args", metavar="args", nargs=argparse.REMAINDER, help="its arguments")
    return p


# ---------------------------------------------------------------------- resolution
@dataclass
class _Settings:
    """The settings read from flags, ``PET_*`` and SLURM (see ``_cluster_env``)."""

    nproc: int
    nnodes: Sourced[tuple[int, int]] | None
    node_rank: Sourced[int] | None
    master_addr: Sourced[str] | None
    master_port: Sourced[int] | None
    backend: str
    endpoint: Sourced[tuple[str, int]] | None
    rdzv_id: str
    rdzv_conf: dict[str, float | bool]
    max_restarts: int


def _read(ns: argparse.Namespace, env: Mapping[str, str]) -> _Settings:
    nproc = pick("the workers per node", "--nproc-per-node", ns.nproc_per_node, env, _positive)
    nnodes = pick("the number of nodes", "--nnodes", ns.nnodes, env, parse_nnodes)
    slurm_nodes = slurm_node_count(env)
    if slurm_nodes is not None:
        if nnodes is None:
            nnodes = Sourced((slurm_nodes.value, slurm_nodes.value), slurm_nodes.source)
        elif not nnodes.value[0] <= slurm_nodes.value <= nnodes.value[1]:
            raise conflict("the number of nodes", _shown_nnodes(nnodes), slurm_nodes)
    restarts = pick("the restarts", "--max-restarts", ns.max_restarts, env, _restarts)
    backend = pick("the rendezvous backend", "--rdzv-backend", ns.rdzv_backend, env, _backend)
    rdzv_id = pick("the rendezvous id", "--rdzv-id", ns.rdzv_id, env, _text)
    conf = pick("the rendezvous settings", "--rdzv-conf", ns.rdzv_conf, env, parse_rdzv_conf)
    return _Settings(
        nproc=nproc.value if nproc else 1,
        nnodes=nnodes,
        node_rank=pick("this node's rank", "--node-rank", ns.node_rank, env, _node_rank),
        master_addr=pick("rank 0's host", "--master-addr", ns.master_addr, env, _text),
        master_port=pick("rank 0's port", "--master-port", ns.master_port, env, _port),
        backend=backend.value if backend else "static",
        endpoint=pick(
            "the rendezvous endpoint", "--rdzv-endpoint", ns.rdzv_endpoint, env, parse_endpoint
        ),
        rdzv_id=rdzv_id.value if rdzv_id else "none",
        rdzv_conf=conf.value if conf else {},
        max_restarts=restarts.value if restarts else 0,
    )


def _shown_nnodes(nnodes: Sourced[tuple[int, int]]) -> Sourced[str]:
    lo, hi = nnodes.value
    return Sourced(str(lo) if lo == hi else f"{lo}:{hi}", nnodes.source, nnodes.raw)


def _static(ns: argparse.Namespace, s: _Settings, env: Mapping[str, str]) -> dict[str, object]:
    """Checks and values of the static rendezvous (node rank and rank 0 given)."""
    lo, hi = s.nnodes.value if s.nnodes else (1, 1)
    if s.nnodes is not None and lo != hi:
        raise ClusterEnvError(
            f"{_shown_nnodes(s.nnodes).shown()} (a range of nodes) needs --rdzv-backend c10d "
            "and --rdzv-endpoint: the static rendezvous has a fixed number of nodes"
        )
    node_rank, slurm_id = s.node_rank, slurm_node_id(env)
    if slurm_id is not None:
        if node_rank is not None and node_rank.value != slurm_id.value:
            raise conflict("this node's rank", node_rank, slurm_id)
        node_rank = node_rank or slurm_id
    addr, port = s.master_addr, s.master_port
    if s.endpoint is not None:  # torchrun: the static rendezvous's endpoint is rank 0's store
        ep_host = Sourced(s.endpoint.value[0], s.endpoint.source)
        ep_port = Sourced(s.endpoint.value[1], s.endpoint.source)
        if addr is not None and addr.value != ep_host.value:
            raise conflict("rank 0's host", addr, ep_host)
        if port is not None and port.value != ep_port.value:
            raise conflict("rank 0's port", port, ep_port)
        addr, port = addr or ep_host, port or ep_port
    rank = node_rank.value if node_rank else 0
    if not 0 <= rank < hi:
        raise ClusterEnvError(f"--node-rank must be in [0, {hi}), got {rank}")
    if port is not None and not 0 < port.value < 65536:
        raise ClusterEnvError(f"--master-port must be in [1, 65535], got {port.value}")
    if hi > 1:
        if ns.standalone:
            raise ClusterEnvError(
                "--standalone means one node; it cannot be used with --nnodes > 1"
            )
        if addr is None or port is None:
            raise ClusterEnvError(
                "--nnodes > 1 needs --master-addr and --master-port (rank 0's host and a port "
                "that every node can reach), or --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
            )
        if s.max_restarts > 0:
            raise ClusterEnvError(
                "--max-restarts > 0 needs --nnodes 1 with the static rendezvous: a restart "
                "starts every rank of the job again, and this node's launcher cannot restart "
                "the other nodes' ranks; use --rdzv-backend c10d --rdzv-endpoint HOST:PORT, "
                "whose launchers restart every node together"
            )
    return {
        "nnodes": hi,
        "node_rank": rank,
        "master_addr": addr.value if addr else "127.0.0.1",
        "master_port": port.value if port else free_port("127.0.0.1"),
        "fixed_port": port is not None,
    }


def _c10d(ns: argparse.Namespace, s: _Settings, env: Mapping[str, str]) -> dict[str, object]:
    """Checks and values of the c10d rendezvous (node ranks from the rounds)."""
    if s.endpoint is None:
        raise ClusterEnvError(
            "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT: the node whose launcher "
            "serves the rendezvous (the same on every node)"
        )
    if ns.standalone:
        raise ClusterEnvError("--standalone picks its own rendezvous; drop --rdzv-backend c10d")
    host, port = s.endpoint.value
    secret = env.get(SECRET_ENV_VAR, "")
    if not is_loopback(host) and not secret:
        raise ClusterEnvError(
            f"the rendezvous endpoint {host}:{port} ({s.endpoint.source}) is not a loopback "
            f"address, so every node must prove a shared secret: set {SECRET_ENV_VAR} to the "
            "same value on every node (e.g. export DPT_STORE_SECRET=$(python -c 'import "
            "secrets; print(secrets.token_hex(16))'))"
        )
    lo, hi = s.nnodes.value if s.nnodes else (1, 1)
    conf = dict(s.rdzv_conf)
    is_host = conf.pop("is_host", None)
    defaults = RdzvConfig(host, port, s.rdzv_id, lo, hi)
    rdzv = RdzvConfig(
        host=host,
        port=port,
        rdzv_id=s.rdzv_id,
        min_nodes=lo,
        max_nodes=hi,
        is_host=None if is_host is None else bool(is_host),
        join_timeout=float(conf.get("join_timeout", defaults.join_timeout)),
        last_call_timeout=float(conf.get("last_call_timeout", defaults.last_call_timeout)),
        keep_alive_interval=float(conf.get("keep_alive_interval", defaults.keep_alive_interval)),
        keep_alive_max_attempt=int(
            conf.get("keep_alive_max_attempt", defaults.keep_alive_max_attempt)
        ),
    )
    notes = []
    for given in (s.node_rank, s.master_addr, s.master_port):
        if given is not None:
            notes.append(
                f"{PROG}: ignoring {given.shown()}: with --rdzv-backend c10d the rendezvous "
                "assigns node ranks and rank 0's address"
            )
    return {
        "nnodes": hi,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": 0,
        "fixed_port": False,
        "rdzv": rdzv,
        "notes": tuple(notes),
    }


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> LaunchConfig:
    """Turn the command line into a :class:`LaunchConfig` (exits with status 2 on bad input).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        environ: where ``PET_*`` and SLURM's variables are read (default ``os.environ``).
    """
    parser = _parser()
    ns = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    if not ns.grace_period >= 0:
        parser.error(f"--grace-period must be >= 0, got {ns.grace_period}")
    try:
        s = _read(ns, env)
        where = _c10d(ns, s, env) if s.backend == "c10d" else _static(ns, s, env)
    except ClusterEnvError as exc:
        parser.error(str(exc))
    # Each node's own id (segments of its workers carry it, so a node's cleanup never
    # touches another node's); the rendezvous id is what the nodes share.
    run_id = ns.run_id or new_run_id()
    return LaunchConfig(
        target=ns.target,
        target_args=tuple(ns.target_args),
        module=ns.module,
        nproc_per_node=s.nproc,
        grace_period=float(ns.grace_period),
        run_id=run_id,
        max_restarts=s.max_restarts,
        **where,  # type: ignore[arg-type]
    )
