"""benchmarks/ddp_scaling.py end to end on a tiny model: the report and its JSON (never timings)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers import run_to_end

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_tiny_run_reports_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    p = run_to_end(
        [sys.executable, "-m", "benchmarks.ddp_scaling", "--width", "64", "--depth", "2",
         "--steps", "2", "--rounds", "1", "--warmup", "1", "--no-torch", "--json", str(out)],
        env, 110,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    for needle in ("1 rank, no DDP", "2 ranks, DDP", "scaling efficiency", "all-reduce of"):
        assert needle in p.stdout, p.stdout
    doc = json.loads(out.read_text())
    assert set(doc["rows_ms"]) == {"plain", "ddp1", "indep2", "ddp2"}
    for row in doc["rows_ms"].values():
        assert row["step"] > 0 and row["step"] >= row["bwd"] > 0
    assert doc["bucket_bytes"] and sum(doc["bucket_bytes"]) == 4 * (64 * 65 * 2 + 10 * 65)
    assert doc["efficiency"] == pytest.approx(1 / doc["step_ratio_2_over_1"])
    assert doc["floor_without_idle_core"] > 0
