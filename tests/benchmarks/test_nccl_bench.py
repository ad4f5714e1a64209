"""benchmarks/nccl_bench.py pieces that need no GPU (its sweep runs on the fake libnccl in
tests/collectives/test_nccl.py)."""

from __future__ import annotations

import itertools
import types
from typing import Any

import pytest

from benchmarks import nccl_bench

UID = bytes(range(0, 256, 2))  # 128 bytes, half above 127: negative in CuPy 13's tuple form


def _cupy_nccl(takes: type) -> Any:
    """A stand-in for ``cupy.cuda.nccl`` whose communicator takes the id as ``takes`` only,
    refusing the other form with TypeError as Cython does."""

    class NcclCommunicator:
        def __init__(self, ndev: int, commId: Any, rank: int) -> None:
            if not isinstance(commId, takes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected {takes})")
            self.args = (ndev, commId, rank)

    return types.SimpleNamespace(NcclCommunicator=NcclCommunicator)


@pytest.mark.parametrize("uid", [UID, tuple(b - 256 if b > 127 else b for b in UID)])
def test_cupy_14_gets_the_id_as_bytes(uid: Any) -> None:
    """CuPy 14's get_unique_id returns bytes and its communicator takes bytes only; rank 0
    passes its own id, the others the bytes they read from the store."""
    comm = nccl_bench.cupy_communicator(_cupy_nccl(bytes), 2, uid, 1)
    assert comm.args == (2, UID, 1)


@pytest.mark.parametrize("uid", [UID, tuple(b - 256 if b > 127 else b for b in UID)])
def test_cupy_13_gets_the_id_as_signed_chars(uid: Any) -> None:
    comm = nccl_bench.cupy_communicator(_cupy_nccl(tuple), 3, uid, 0)
    ndev, got, rank = comm.args
    assert (ndev, rank) == (3, 0) and len(got) == 128
    assert (got[0], got[63], got[64], got[127]) == (0, 126, -128, -2)
    assert bytes(v & 0xFF for v in got) == UID


def test_sizes_and_iterations() -> None:
    sizes = nccl_bench.sizes_up_to(1 << 30)
    assert sizes[0] == 8 and sizes[-1] == 1 << 29
    assert all(b * 4 == a for b, a in itertools.pairwise(sizes))
    assert nccl_bench.iters_for(8) == nccl_bench.HOST_CALLS and nccl_bench.iters_for(1 << 30) == 5
