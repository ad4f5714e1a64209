"""Where the launcher's multi-node settings come from: flags, torchrun's ``PET_*``, SLURM.

A cluster's scheduler tells each node's launcher its place in one of three ways, and this
module reads all three into one set of :class:`Sourced` values, each remembering where it came
from so that an error can say so:

1. Flags (``--nnodes 2``), torchrun's spellings included.
2. torchrun's environment: every flag ``--foo-bar`` has a variable ``PET_FOO_BAR`` (Kubeflow's
   PyTorchJob sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
   ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, and for elastic jobs ``PET_RDZV_BACKEND``,
   ``PET_RDZV_ENDPOINT``, ``PET_RDZV_ID``, ``PET_MAX_RESTARTS``).
3. SLURM, when the launcher itself is one task of an ``srun`` step (``SLURM_STEP_NUM_NODES``
   set): the step's node count gives the number of nodes and ``SLURM_NODEID`` this node's
   index, when nothing else gives them.

A flag and its ``PET_*`` variable may both be set only when they agree; a disagreement, or one
with SLURM's values, is an error naming both values and where each came from (never a silent
choice between them). Empty variables count as unset.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["ClusterEnvError", "Sourced", "pick", "slurm_node_count", "slurm_node_id"]

T = TypeVar("T")


class ClusterEnvError(ValueError):
    """Two sources disagree about a setting, or one holds a malformed value."""


@dataclass(frozen=True)
class Sourced(Generic[T]):
    """A setting's value and where it came from (``--nnodes``, ``PET_NNODES``, ...)."""

    value: T
    source: str
    raw: str = ""  # the text as given, when it was parsed

    def shown(self) -> str:
        """``"--nnodes 2"`` or ``"PET_NNODES=2"``, for messages."""
        text = self.raw or str(self.value)
        if self.source.startswith("--"):
            return f"{self.source} {text}"
        return f"{self.source}={text}"


def pet_name(flag: str) -> str:
    """torchrun's variable for a flag: ``--nproc-per-node`` -> ``PET_NPROC_PER_NODE``."""
    return "PET_" + flag.lstrip("-").replace("-", "_").upper()


def _env_text(environ: Mapping[str, str], name: str) -> str | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def pick(
    what: str,
    flag: str,
    flag_value: str | None,
    environ: Mapping[str, str],
    parse: Callable[[str, str], T],
    same: Callable[[T, T], bool] | None = None,
) -> Sourced[T] | None:
    """The value of one setting from its flag or its ``PET_*`` variable.

    Args:
        what: the setting in words, for messages ("the number of nodes").
        flag: the flag's canonical spelling (``--nnodes``).
        flag_value: the flag's raw value, None when not given.
        environ: the launcher's environment.
        parse: turns a raw value into the setting; raises ``ValueError`` with a message that
            names the source (its first argument) when malformed.
        same: whether two parsed values agree (default ``==``).

    Returns:
        The value and its source, or None when neither gives it.

    Raises:
        ClusterEnvError: the value is malformed, or flag and variable disagree.
    """
    var = pet_name(flag)
    env_raw = _env_text(environ, var)
    try:
        from_flag = None
        if flag_value is not None:
            from_flag = Sourced(parse(flag, flag_value), flag, flag_value)
        from_env = None if env_raw is None else Sourced(parse(var, env_raw), var, env_raw)
    except ValueError as exc:
        raise ClusterEnvError(str(exc)) from None
    if from_flag is not None and from_env is not None:
        agree = same(from_flag.value, from_env.value) if same else from_flag.value == from_env.value
        if not agree:
            raise conflict(what, from_flag, from_env)
    return from_flag if from_flag is not None else from_env


def conflict(what: str, a: Sourced[Any], b: Sourced[Any]) -> ClusterEnvError:
    """The error for two sources that disagree about ``what``."""
    return ClusterEnvError(
        f"conflicting values for {what}: {a.shown()} ({_kind(a.source)}) but {b.shown()} "
        f"({_kind(b.source)}); remove one, or make them agree"
    )


def _kind(source: str) -> str:
    if source.startswith("--"):
        return "flag"
    if source.startswith("PET_"):
        return "torchrun's environment"
    if source.startswith("SLURM_"):
        return "SLURM's environment"
    return "environment"


def _slurm_int(environ: Mapping[str, str], name: str) -> Sourced[int] | None:
    raw = _env_text(environ, name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ClusterEnvError(f"{name} must be an integer, got {raw!r}") from None
    return Sourced(value, name)


def slurm_node_count(environ: Mapping[str, str]) -> Sourced[int] | None:
    """The nodes of the ``srun`` step this launcher runs in, or None outside a step."""
    return _slurm_int(environ, "SLURM_STEP_NUM_NODES")


def slurm_node_id(environ: Mapping[str, str]) -> Sourced[int] | None:
    """This node's index in the ``srun`` step (``SLURM_NODEID``), or None outside a step."""
    if slurm_node_count(environ) is None:
        return None
    return _slurm_int(environ, "SLURM_NODEID")
