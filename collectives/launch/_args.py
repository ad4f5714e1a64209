"""The command line of ``python -m collectives.run``: options, checks, :class:`LaunchConfig`.

:func:`parse_args` turns argv into a config (exit status 2 and a message for bad input); the
supervisor in :mod:`collectives.run` runs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from ._launcher import DEFAULT_GRACE_PERIOD, free_port, new_run_id

__all__ = ["PROG", "LaunchConfig", "parse_args"]

PROG = "collectives.run"


@dataclass(frozen=True)
class LaunchConfig:
    """What to start and where it sits in the job.

    Attributes:
        target: the script path, or the module name when ``module`` is True.
        target_args: its command-line arguments.
        module: run ``python -m target`` instead of a script.
        nproc_per_node: workers on this node.
        nnodes: nodes in the job (each runs one launcher with the same ``nproc_per_node``).
        node_rank: this node's index; its workers get ranks ``node_rank * nproc_per_node + i``.
        master_addr: rank 0's host.
        master_port: rank 0's store port.
        grace_period: seconds between SIGTERM and SIGKILL when ending workers.
        run_id: the job's id (DPT_RUN_ID of the first attempt; restart k gets ``<id>.r<k>``).
        max_restarts: how often the job starts again after a failed attempt.
        fixed_port: every attempt reuses ``master_port`` (it was given); else each restart
            takes a fresh free port.
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

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nnodes * self.nproc_per_node


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _restart_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of restarts (an integer >= 0), got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a number of restarts (an integer >= 0), got {text!r}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description="Start one worker process per rank with a torchrun-compatible "
        "environment; end them all and report the failed rank's traceback on the first "
        "failure.",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=_positive_int,
        default=1,
        help="workers to start on this node (default 1)",
    )
    p.add_argument(
        "--nnodes",
        type=_positive_int,
        default=1,
        help="nodes in the job; each runs this launcher (default 1)",
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        help="this node's index in [0, nnodes) (default 0)",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        help="rank 0's host (default 127.0.0.1 on one node; required with --nnodes > 1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="rank 0's store port (default: a free port on one node; required with --nnodes > 1)",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="one node with a free port (the default when --nnodes is 1; for torchrun scripts)",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=_restart_count,
        default=0,
        help="start the whole job again after a failed attempt, up to this many times "
        "(default 0; one node only)",
    )
    p.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        help=f"seconds between SIGTERM and SIGKILL when ending workers (default "
        f"{DEFAULT_GRACE_PERIOD:g})",
    )
    p.add_argument("--run-id", "--run_id", default=None, help="job id exported as DPT_RUN_ID")
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module, like `python -m`",
    )
    p.add_argument("target", metavar="script.py|module", help="the training script or module")
    p.add_argument("target_args", metavar="args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Turn the command line into a :class:`LaunchConfig` (exits with status 2 on bad input)."""
    parser = _parser()
    ns = parser.parse_args(argv)
    if not ns.grace_period >= 0:
        parser.error(f"--grace-period must be >= 0, got {ns.grace_period}")
    if not 0 <= ns.node_rank < ns.nnodes:
        parser.error(f"--node-rank must be in [0, {ns.nnodes}), got {ns.node_rank}")
    if ns.master_port is not None and not 0 < ns.master_port < 65536:
        parser.error(f"--master-port must be in [1, 65535], got {ns.master_port}")
    if ns.nnodes > 1:
        if ns.standalone:
            parser.error("--standalone means one node; it cannot be used with --nnodes > 1")
        if ns.master_addr is None or ns.master_port is None:
            parser.error(
                "--nnodes > 1 needs --master-addr and --master-port (rank 0's host and a port "
                "that every node can reach)"
            )
        if ns.max_restarts > 0:
            parser.error(
                "--max-restarts > 0 needs --nnodes 1: a restart starts every rank of the job "
                "again, and this node's launcher cannot restart the other nodes' ranks "
                "(restart all the nodes' launchers together, e.g. from the job scheduler)"
            )
    addr = ns.master_addr or "127.0.0.1"
    port = ns.master_port if ns.master_port is not None else free_port("127.0.0.1")
    return LaunchConfig(
        target=ns.target,
        target_args=tuple(ns.target_args),
        module=ns.module,
        nproc_per_node=ns.nproc_per_node,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=addr,
        master_port=port,
        grace_period=float(ns.grace_period),
        run_id=ns.run_id or new_run_id(),
        max_restarts=ns.max_restarts,
        fixed_port=ns.master_port is not None,
    )
