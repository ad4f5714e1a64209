"""benchmarks/gpu_check.py's plan, checked without a GPU (the run itself needs one)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import gpu_check


def test_no_gpu_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    import tensorlib as tl

    if tl.cuda_unavailable_reason() is None:
        pytest.skip("a GPU is usable here")
    assert gpu_check.main([]) == 2
    assert "no usable GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sizes,why,expect_share",
    [
        ([1, 2, 4], "one GPU, NCCL >= 2.30: ranks share it (NCCL_MULTI_RANK_GPU_ENABLE=1)", True),
        ([1, 4], "4 GPUs: one rank per GPU", False),
        ([1], "one GPU and NCCL 2.21 < 2.30 ...: world size 1 only", False),
    ],
)
def test_ddp_on_nccl_steps(
    monkeypatch: pytest.MonkeyPatch, sizes: list[int], why: str, expect_share: bool
) -> None:
    """DDP on NCCL runs at world size 1 and, where NCCL allows it, 2 (sharing the GPU only
    when there is one GPU)."""
    calls: list[tuple[list[str], dict[str, str]]] = []

    def fake_run(cmd: list[str], timeout: int, log: list[str], env: Any = None) -> Any:
        calls.append((cmd, dict(env or {})))
        return 0, "final test accuracy: 97.00% (359 images, 1 rank(s), 1.0 s, cuda)", 1.0

    monkeypatch.setattr(gpu_check, "nccl_world_sizes", lambda info: (sizes, why))
    monkeypatch.setattr(gpu_check, "run", fake_run)
    steps = gpu_check.ddp_nccl_steps({}, "python", lambda keep=0.0: 400, [])
    worlds = [w for w in sizes if w <= 2]
    assert [c[0][c[0].index("--nproc") + 1] for c in calls] == [str(w) for w in worlds]
    for cmd, env in calls:
        assert cmd[1] == "examples/train_ddp.py"
        assert cmd[cmd.index("--backend") + 1] == "nccl" and "cuda" in cmd
        assert env.get("NCCL_MULTI_RANK_GPU_ENABLE") == ("1" if expect_share else None)
    assert [code for _, code, _ in steps] == [0] * len(worlds)
    assert all("final test accuracy" in detail for _, _, detail in steps)
