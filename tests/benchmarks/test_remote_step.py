"""The remote-step benchmark runs end to end and reports one round trip a step."""

from __future__ import annotations

from benchmarks import remote_step


def test_remote_step_benchmark_reports_its_figures() -> None:
    out = remote_step.main(["--steps", "3", "--warmup", "1", "--ops", "200"])
    assert out["round_trips_per_step"] == 1.0
    # Linear and cross_entropy are one fused record each way: 18 records a step, not ~58.
    assert 10 <= out["records_per_step"] <= 30
    assert out["local_ms"] > 0 and out["remote_ms"] > 0
