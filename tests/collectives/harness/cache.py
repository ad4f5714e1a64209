"""Pools shared by many tests: one live :class:`RankPool` per :class:`PoolSpec`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .pool import RankPool


@dataclass(frozen=True)
class PoolSpec:
    """Which pool a test runs on: backend, world size and extra environment."""

    backend: str
    world_size: int
    env: tuple[tuple[str, str], ...] = field(default=())
    timeout: float = 20.0
    tag: str = ""

    @property
    def id(self) -> str:
        return f"{self.backend}{self.world_size}{'-' + self.tag if self.tag else ''}"


class PoolCache:
    """One live pool per spec, restarted when a test broke it."""

    def __init__(self) -> None:
        self._pools: dict[PoolSpec, RankPool] = {}

    def get(self, spec: PoolSpec) -> RankPool:
        pool = self._pools.get(spec)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            cls = RankPool
            if spec.backend == "mpi":
                from .mpipool import MpiRankPool

                cls = MpiRankPool
            pool = cls.launch(
                spec.backend,
                spec.world_size,
                env=dict(spec.env),
                timeout=spec.timeout,
                tag=spec.tag,
            )
            self._pools[spec] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
