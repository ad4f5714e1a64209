"""init_method URLs: ``env://`` (the environment, :mod:`._env`) and ``tcp://HOST:PORT``.

``init_process_group(init_method=...)`` reads its rank's configuration here: the URL names
where the store is, and the environment (or the arguments) the rank and world size.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from ._env import EnvConfig, EnvError, check_host, read_env

__all__ = ["InitAddress", "parse_init_method", "resolve_init_method"]


class InitAddress(NamedTuple):
    """The details of an init method: the store's address (``("", 0)`` for ``env://``)."""

    host: str
    port: int


def parse_init_method(init_method: str) -> tuple[str, InitAddress]:
    """Split an init method URL into its kind and the store's address.

    Args:
        init_method: ``"env://"`` or ``"tcp://HOST:PORT"`` (IPv6 hosts in brackets).

    Returns:
        ``("env", InitAddress("", 0))`` or ``("tcp", InitAddress(host, port))``. With tcp://,
        rank and world size still come from arguments or the environment.

    Raises:
        EnvError: any other scheme, or a tcp:// URL without a valid host and port.
    """
    if not isinstance(init_method, str):
        raise TypeError(f"init_method must be a str, got {type(init_method).__name__}")
    text = init_method.strip()
    if text in ("env://", "env:"):
        return "env", InitAddress("", 0)
    if text.lower().startswith("tcp://"):
        parts = urlsplit(text)
        try:
            port = parts.port
        except ValueError as exc:
            raise EnvError(
                f"init_method {init_method!r}: the port must be an integer in 0..65535"
            ) from exc
        host = parts.hostname
        extra = parts.path.strip("/") or parts.query or parts.fragment or parts.username
        if not host or port is None or extra:
            raise EnvError(
                f"init_method {init_method!r} is not of the form 'tcp://HOST:PORT' "
                "(e.g. 'tcp://10.0.0.1:29500', 'tcp://[::1]:29500')"
            )
        if port == 0:
            raise EnvError(f"init_method {init_method!r}: port 0 cannot be shared by all ranks")
        return "tcp", InitAddress(check_host("init_method host", host), port)
    raise EnvError(
        f"unsupported init_method {init_method!r}: supported are 'env://' (RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT, ... or SLURM's / Open MPI's variables) and "
        "'tcp://HOST:PORT'"
    )


def resolve_init_method(
    init_method: str = "env://",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> EnvConfig:
    """The configuration for ``init_process_group(init_method=..., rank=..., world_size=...)``.

    ``env://`` is :func:`read_env`. ``tcp://HOST:PORT`` takes the store's address from the URL
    (replacing MASTER_ADDR/MASTER_PORT) and requires rank and world size from the arguments
    or a launcher's variables.

    Raises:
        EnvError: as :func:`parse_init_method` and :func:`read_env`, or tcp:// without a rank
            and world size.
    """
    kind, address = parse_init_method(init_method)
    base = dict(os.environ if environ is None else environ)
    if kind == "env":
        return read_env(base, rank=rank, world_size=world_size)
    base["MASTER_ADDR"], base["MASTER_PORT"] = address.host, str(address.port)
    config = read_env(base, rank=rank, world_size=world_size)
    if config.source == "default" or (config.source == "args" and None in (rank, world_size)):
        missing = "rank" if rank is None else "world_size"
        raise EnvError(
            f"init_method {init_method!r} needs {missing} (pass rank= and world_size=, or set "
            "RANK and WORLD_SIZE)"
        )
    return config
