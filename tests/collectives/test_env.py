"""Tests for env:// configuration (collectives/_env.py): every source and every error path."""

from __future__ import annotations

from typing import Any

import pytest

from collectives._env import EnvConfig, EnvError, read_env
from collectives._init_method import InitAddress, parse_init_method, resolve_init_method

# TEST-NET-1 (RFC 5737): never an address of this machine, so "another host".
FOREIGN = "192.0.2.1"
# Two ranks on this host: the base of the tests that spoil one variable.
TWO_HERE = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _vars(names: tuple[str, ...], values: tuple[int | None, ...]) -> dict[str, str]:
    return {name: str(v) for name, v in zip(names, values, strict=False) if v is not None}


def torchrun(*values: int | None) -> dict[str, str]:
    """``torchrun(rank, world, local_rank, local_world)``: the values given; None skips one."""
    return _vars(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), values)


def ompi(*values: int | None) -> dict[str, str]:
    """Open MPI's four variables, as :func:`torchrun`."""
    names = (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    )
    return _vars(names, values)


def pmi(*values: int | None) -> dict[str, str]:
    """MPICH Hydra's ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``."""
    return _vars(("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), values)


def slurm(*values: int | None) -> dict[str, str]:
    """srun's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, as :func:`torchrun`."""
    return _vars(("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), values)


def cfg(rank: int | None = None, world_size: int | None = None, /, **env: str) -> EnvConfig:
    return read_env(env, rank=rank, world_size=world_size)


def env_error(*needles: str, **env: Any) -> EnvError:
    """Assert read_env fails with an EnvError whose message contains every needle.

    ``rank=`` and ``world_size=`` are passed as arguments; the other keywords are variables.
    """
    rank, world_size = env.pop("rank", None), env.pop("world_size", None)
    with pytest.raises(EnvError) as info:
        cfg(rank, world_size, **env)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {str(info.value)!r}"
    assert isinstance(info.value, ValueError)
    return info.value


# ----------------------------------------------------------------------------- sources


def test_nothing_set_is_a_single_process() -> None:
    assert cfg() == EnvConfig(0, 1, 0, 1, "127.0.0.1", 0, "default")


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    c = read_env()
    assert (c.rank, c.world_size, c.master_port) == (1, 2, 29500)


def test_torchrun_full() -> None:
    c = cfg(**torchrun(5, 8, 1, 4), MASTER_ADDR="10.1.2.3", MASTER_PORT="29500")
    assert c == EnvConfig(5, 8, 1, 4, "10.1.2.3", 29500, "torchrun")


def test_torchrun_single_host_defaults_local_values() -> None:
    # No LOCAL_*: the store's host is this one, so every rank is taken to be here.
    c = cfg(RANK="2", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1234")
    assert (c.local_rank, c.local_world_size) == (2, 3)
    c = cfg(RANK="2", WORLD_SIZE="3", MASTER_ADDR="localhost", MASTER_PORT="1234")
    assert (c.local_rank, c.local_world_size, c.master_addr) == (2, 3, "localhost")


def test_local_rank_defaults_to_rank_when_all_local() -> None:
    c = cfg(RANK="3", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", MASTER_PORT="29500")
    assert (c.local_rank, c.local_world_size) == (3, 4)
    assert c.master_addr == "127.0.0.1"  # every rank local: loopback


def test_local_world_size_defaults_on_one_host() -> None:
    c = cfg(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="9")
    assert (c.local_rank, c.local_world_size) == (1, 2)


def test_world_size_one_without_rank() -> None:
    c = cfg(WORLD_SIZE="1")
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (0, 1, "127.0.0.1", 0)


def test_empty_variables_count_as_unset() -> None:
    assert cfg(RANK="", WORLD_SIZE=" ", MASTER_ADDR="") == cfg()


def test_ipv6_master_addr_brackets_stripped() -> None:
    c = cfg(RANK="0", WORLD_SIZE="2", MASTER_ADDR="[::1]", MASTER_PORT="29500")
    assert c.master_addr == "::1" and c.local_world_size == 2


def test_slurm() -> None:
    c = cfg(
        **slurm(5, 8, 1),
        SLURM_NODEID="1",
        SLURM_TASKS_PER_NODE="4(x2)",
        SLURM_JOB_NODELIST="gpu[03-04]",
        SLURM_JOB_ID="12345",
    )
    assert c == EnvConfig(5, 8, 1, 4, "gpu03", 15000 + 12345 % 20000, "slurm")


def test_slurm_uneven_tasks_per_node() -> None:
    base = slurm(9, 11, 1)
    extra = {"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_JOB_NODELIST": "a1,b[1-2]"}
    c = cfg(**base, **extra, SLURM_NODEID="2", MASTER_PORT="29500")
    assert (c.local_world_size, c.master_addr) == (3, "a1")
    env_error("SLURM_NODEID=3", "SLURM_TASKS_PER_NODE", **base, **extra, SLURM_NODEID="3")


def test_slurm_step_values_preferred() -> None:
    c = cfg(
        SLURM_PROCID="1",
        SLURM_NTASKS="16",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_LOCALID="1",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_TASKS_PER_NODE="8(x2)",
        MASTER_PORT="29500",
    )
    assert (c.world_size, c.local_world_size, c.master_addr) == (2, 2, "127.0.0.1")


def test_slurm_ntasks_per_node_and_launch_node_ip() -> None:
    c = cfg(
        **slurm(3, 4, 1),
        SLURM_NTASKS_PER_NODE="2",
        SLURM_LAUNCH_NODE_IPADDR="10.0.0.7",
        SLURM_JOB_ID="7",
    )
    assert (c.local_world_size, c.master_addr, c.master_port) == (2, "10.0.0.7", 15007)


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node01", "node01"),
        ("node[01-04]", "node01"),
        ("gpu-a[007,009-010],gpu-b[1-2]", "gpu-a007"),
        ("rack[2-3]-n[5-6]", "rack2-n5"),
        ("x1,x2", "x1"),
    ],
)
def test_slurm_nodelist_first_host(nodelist: str, first: str) -> None:
    c = cfg(
        **slurm(0, 4, 0),
        SLURM_NTASKS_PER_NODE="2",
        SLURM_JOB_NODELIST=nodelist,
        MASTER_PORT="29500",
    )
    assert c.master_addr == first


def test_slurm_unparsable_nodelist_falls_back_to_launch_node() -> None:
    c = cfg(
        **slurm(0, 4, 0),
        SLURM_NTASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="weird[a-b]",
        SLURM_LAUNCH_NODE_IPADDR="10.0.0.9",
        MASTER_PORT="29500",
    )
    assert c.master_addr == "10.0.0.9"


def test_slurm_single_node_uses_loopback_and_env_overrides() -> None:
    base = {
        **slurm(1, 2, 1),
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_ID": "100",
    }
    c = cfg(**base)
    assert (c.master_addr, c.master_port, c.local_world_size) == ("127.0.0.1", 15100, 2)
    c = cfg(**base, MASTER_ADDR="10.9.9.9", MASTER_PORT="4242")
    assert (c.master_addr, c.master_port) == ("10.9.9.9", 4242)


def test_open_mpi() -> None:
    c = cfg(**ompi(3, 4, 3, 4), MASTER_PORT="29500")
    assert c == EnvConfig(3, 4, 3, 4, "127.0.0.1", 29500, "ompi")


def test_open_mpi_multi_node_needs_master_addr() -> None:
    env = {**ompi(3, 4, 1, 2), "MASTER_PORT": "29500"}
    env_error("MASTER_ADDR", "OMPI_COMM_WORLD_SIZE=4", **env)
    assert cfg(**env, MASTER_ADDR="10.0.0.1").master_addr == "10.0.0.1"


def test_open_mpi_before_slurm() -> None:
    # mpirun inside a SLURM job: the SLURM_* values describe mpirun's daemons, not the ranks.
    c = cfg(**ompi(5, 8, 1, 4), **slurm(1, 2, 0), SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_ID="42")
    assert c == EnvConfig(5, 8, 1, 4, "n1", 15042, "ompi")


def test_mpich_hydra() -> None:
    c = cfg(**pmi(2, 4, 2, 4), MASTER_PORT="1")
    assert c == EnvConfig(2, 4, 2, 4, "127.0.0.1", 1, "pmi")
    env_error("PMI_SIZE is not set", PMI_RANK="1")
    env_error("PMI_RANK=4 must be < PMI_SIZE=4", PMI_RANK="4", PMI_SIZE="4")


def test_mpich_hydra_before_slurm_and_after_open_mpi() -> None:
    c = cfg(**pmi(5, 8, 1, 4), **slurm(1, 2, 0), SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[1-2]")
    assert c == EnvConfig(5, 8, 1, 4, "n1", 15007, "pmi")
    both = {**ompi(5, 8, 1, 4), **pmi(5, 8, 1, 4)}
    assert cfg(**both, MASTER_ADDR="h", MASTER_PORT="2").source == "ompi"


def test_torchrun_disagreeing_with_mpich_is_an_error() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    env_error("RANK=1", "PMI_RANK=0", "inconsistent", **env, PMI_RANK="0", PMI_SIZE="2")


def test_torchrun_nested_inside_srun() -> None:
    # srun starts one torchrun per node, which starts 4 workers: WORLD_SIZE > SLURM_NTASKS.
    c = cfg(**torchrun(6, 8, 2, 4), **slurm(1, 2, 0), MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert (c.rank, c.world_size, c.local_rank, c.source) == (6, 8, 2, "torchrun")


def test_torchrun_agreeing_with_ompi_is_fine() -> None:
    c = cfg(**torchrun(1, 2), **ompi(1, 2), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert (c.rank, c.source) == (1, "torchrun")


@pytest.mark.parametrize("marker", ["TORCHELASTIC_RUN_ID", "DPT_RUN_ID"])
def test_launcher_marker_means_nested_launcher(marker: str) -> None:
    # torchrun (elastic: ranks in any order) under srun, or spawn() under mpirun: the
    # launcher's own variables win without comparison.
    nested = {**torchrun(1, 2, 0, 1), **slurm(0, 2, 0), marker: "abc123"}
    c = cfg(**nested, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert (c.rank, c.source) == (1, "torchrun")
    nested = {**torchrun(1, 2), **ompi(3, 4), marker: "abc123"}
    c = cfg(**nested, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert (c.rank, c.world_size) == (1, 2)


def test_explicit_arguments_override() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    c = cfg(1, 2, **env)
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.source) == (
        1,
        2,
        1,
        2,
        "args",
    )
    c = cfg(3, None, **env)  # rank only: world size from the environment
    assert (c.rank, c.world_size, c.source) == (3, 4, "torchrun")
    c = cfg(None, 1, RANK="0")
    assert (c.rank, c.world_size) == (0, 1)


def test_explicit_arguments_ignore_launcher_layout() -> None:
    # mpirun -np 4 running a script that asks for a world of its own.
    c = cfg(0, 1, **ompi(2, 4, 2, 4))
    assert c == EnvConfig(0, 1, 0, 1, "127.0.0.1", 0, "args")


def test_arguments_without_environment() -> None:
    c = cfg(1, 2, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert (c.rank, c.local_rank, c.local_world_size, c.source) == (1, 1, 2, "args")
    env_error("MASTER_ADDR", "world_size=2", rank=1, world_size=2)


# ----------------------------------------------------------------------------- errors


def test_missing_world_size() -> None:
    env_error("WORLD_SIZE is not set", "RANK", RANK="1")
    env_error("OMPI_COMM_WORLD_SIZE is not set", OMPI_COMM_WORLD_RANK="1")
    env_error("SLURM_NTASKS is not set", SLURM_PROCID="1")
    env_error("world_size", "WORLD_SIZE", rank=2)


def test_missing_rank() -> None:
    env_error("RANK is not set", "WORLD_SIZE=2", WORLD_SIZE="2")
    env_error("OMPI_COMM_WORLD_RANK is not set", OMPI_COMM_WORLD_SIZE="2")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RANK", "abc"),
        ("RANK", "1.0"),
        ("WORLD_SIZE", "two"),
        ("WORLD_SIZE", "0x2"),
        ("LOCAL_RANK", "x"),
        ("LOCAL_WORLD_SIZE", "4 nodes"),
        ("MASTER_PORT", "http"),
        ("SLURM_PROCID", "a"),
        ("SLURM_NTASKS", "?"),
        ("OMPI_COMM_WORLD_RANK", "r1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "1e3"),
    ],
)
def test_non_integer(name: str, value: str) -> None:
    env_error(name, repr(value), "integer", **{**TWO_HERE, name: value})


@pytest.mark.parametrize(
    ("name", "value", "minimum"),
    [
        ("RANK", "-1", ">= 0"),
        ("WORLD_SIZE", "0", ">= 1"),
        ("WORLD_SIZE", "-3", ">= 1"),
        ("LOCAL_RANK", "-1", ">= 0"),
        ("LOCAL_WORLD_SIZE", "0", ">= 1"),
    ],
)
def test_negative_or_zero(name: str, value: str, minimum: str) -> None:
    env_error(name, repr(value), minimum, **{**TWO_HERE, name: value})


def test_rank_not_below_world_size() -> None:
    env_error("RANK=2", "WORLD_SIZE=2", RANK="2", WORLD_SIZE="2", MASTER_PORT="1")
    env_error("SLURM_PROCID=4", "SLURM_NTASKS=4", SLURM_PROCID="4", SLURM_NTASKS="4")
    env_error("rank=3", "world_size=3", rank=3, world_size=3)


def test_local_rank_not_below_local_world_size() -> None:
    env_error(
        "LOCAL_RANK=2",
        "LOCAL_WORLD_SIZE=2",
        **torchrun(2, 4, 2, 2),
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29500",
    )
    env_error(
        "LOCAL_RANK=1",
        "world_size=1",
        LOCAL_RANK="1",
    )


def test_local_world_size_above_world_size() -> None:
    env_error(
        "LOCAL_WORLD_SIZE=8",
        "WORLD_SIZE=4",
        RANK="0",
        WORLD_SIZE="4",
        LOCAL_WORLD_SIZE="8",
        MASTER_PORT="29500",
    )


@pytest.mark.parametrize("port", ["0", "65536", "70000", "-1"])
def test_port_out_of_range(port: str) -> None:
    env_error(
        "MASTER_PORT must be in 1..65535",
        repr(port),
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
    )


def test_missing_master_port() -> None:
    env_error(
        "MASTER_PORT is not set", "WORLD_SIZE=2", RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"
    )


def test_missing_master_addr() -> None:
    env_error("MASTER_ADDR is not set", "WORLD_SIZE=2", RANK="0", WORLD_SIZE="2", MASTER_PORT="1")
    env_error(
        "MASTER_ADDR is not set",
        RANK="0",
        WORLD_SIZE="4",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="2",
        MASTER_PORT="1",
    )


def test_multi_host_needs_local_rank() -> None:
    env_error(
        "LOCAL_RANK is not set",
        FOREIGN,
        RANK="1",
        WORLD_SIZE="2",
        MASTER_ADDR=FOREIGN,
        MASTER_PORT="29500",
    )
    env_error(
        "LOCAL_WORLD_SIZE is not set",
        RANK="1",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        MASTER_ADDR=FOREIGN,
        MASTER_PORT="29500",
    )
    env_error(
        "LOCAL_RANK is not set",
        RANK="3",
        WORLD_SIZE="4",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR=FOREIGN,
        MASTER_PORT="29500",
    )


def test_bad_master_addr() -> None:
    env_error("MASTER_ADDR", "'tcp://h:1'", RANK="0", WORLD_SIZE="2", MASTER_ADDR="tcp://h:1")
    env_error("MASTER_ADDR", "'a b'", RANK="0", WORLD_SIZE="2", MASTER_ADDR="a b")


@pytest.mark.parametrize(
    ("other", "needles"),
    [
        (ompi(0, 2), ("RANK=1", "OMPI_COMM_WORLD_RANK=0")),
        (slurm(0, 2), ("RANK=1", "SLURM_PROCID=0")),
        (slurm(1, 2, 0), ("LOCAL_RANK=1", "SLURM_LOCALID=0")),
        (ompi(1, 4), ("WORLD_SIZE=2", "OMPI_COMM_WORLD_SIZE=4")),
        (ompi(1, 2, None, 1), ("LOCAL_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_SIZE=1")),
    ],
    ids=["rank-ompi", "rank-slurm", "local-rank-slurm", "world-ompi", "local-size-ompi"],
)
def test_inconsistent_launchers(other: dict[str, str], needles: tuple[str, ...]) -> None:
    env_error(*needles, "inconsistent", **torchrun(1, 2, 1, 2), MASTER_PORT="29500", **other)


def test_local_rank_next_to_mpirun_must_agree() -> None:
    env = {**ompi(1, 2, 1, 2), "MASTER_PORT": "29500"}
    assert cfg(**env, LOCAL_RANK="1").local_rank == 1
    env_error("LOCAL_RANK=0", "OMPI_COMM_WORLD_LOCAL_RANK=1", **env, LOCAL_RANK="0")


@pytest.mark.parametrize("value", ["4(x)", "x", "4(2)", "0", "4(x0)", ""])
def test_bad_slurm_tasks_per_node(value: str) -> None:
    env = {**slurm(0, 2, 0), "MASTER_PORT": "1"}
    if value == "":  # empty is unset: nothing says how many tasks are here
        env_error("MASTER_ADDR", **env, SLURM_TASKS_PER_NODE=value)
    else:
        env_error("SLURM_TASKS_PER_NODE", repr(value), **env, SLURM_TASKS_PER_NODE=value)


def test_bad_arguments() -> None:
    env_error("rank", "-1", rank=-1, world_size=2)
    env_error("world_size", "0", world_size=0)
    with pytest.raises(TypeError, match="rank"):
        read_env({}, rank="1", world_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="world_size"):
        read_env({}, rank=0, world_size=True)


# ----------------------------------------------------------------------------- init methods


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("env://", ("env", InitAddress("", 0))),
        ("  env://  ", ("env", InitAddress("", 0))),
        ("tcp://10.0.0.1:29500", ("tcp", InitAddress("10.0.0.1", 29500))),
        ("tcp://node-1.cluster:1234/", ("tcp", InitAddress("node-1.cluster", 1234))),
        ("tcp://[::1]:29500", ("tcp", InitAddress("::1", 29500))),
    ],
)
def test_parse_init_method(url: str, expected: tuple[str, InitAddress]) -> None:
    kind, details = parse_init_method(url)
    assert (kind, details) == expected
    assert details[0] == details.host and details[1] == details.port


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("file:///tmp/rendezvous", "'tcp://HOST:PORT'"),
        ("127.0.0.1:29500", "supported are"),
        ("", "supported are"),
        ("tcp://10.0.0.1", "tcp://HOST:PORT"),
        ("tcp://:29500", "tcp://HOST:PORT"),
        ("tcp://h:abc", "port"),
        ("tcp://h:99999", "port"),
        ("tcp://h:0", "port 0"),
        ("tcp://h:1/path", "tcp://HOST:PORT"),
        ("tcp://h:1?rank=0", "tcp://HOST:PORT"),
    ],
)
def test_parse_init_method_errors(url: str, needle: str) -> None:
    with pytest.raises(EnvError, match="init_method") as info:
        parse_init_method(url)
    assert needle in str(info.value) and repr(url) in str(info.value)


def test_resolve_init_method() -> None:
    c = resolve_init_method("tcp://127.0.0.1:4000", rank=1, world_size=2, environ={})
    assert c == EnvConfig(1, 2, 1, 2, "127.0.0.1", 4000, "args")
    # The URL replaces MASTER_ADDR/MASTER_PORT; rank and size may come from the environment.
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": FOREIGN, "MASTER_PORT": "1"}
    c = resolve_init_method("tcp://localhost:4001", environ=env)
    assert (c.master_addr, c.master_port, c.source) == ("localhost", 4001, "torchrun")
    with pytest.raises(EnvError, match="needs rank"):
        resolve_init_method("tcp://127.0.0.1:4000", environ={})
    with pytest.raises(EnvError, match="needs world_size"):
        resolve_init_method("tcp://127.0.0.1:4000", rank=0, environ={})
    assert resolve_init_method("env://", environ={}) == cfg()
