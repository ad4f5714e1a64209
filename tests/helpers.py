"""Helpers shared by the test modules."""

from __future__ import annotations

import pytest

# Use as @pytest.mark.parametrize("device", DEVICES): the same test body runs on the CPU and,
# marked `gpu`, on cuda:0 (skipped with the reason when no GPU is usable).
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu, id="cuda")]
