"""Every test in this package compares with PyTorch; without torch they skip, saying why."""

from __future__ import annotations

import pytest

from .compare import TORCH_REASON


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the differential suite with the reason when torch cannot be imported."""
    if TORCH_REASON is None:
        return
    skip = pytest.mark.skip(reason=TORCH_REASON)
    for item in items:
        if "tests/tensorlib/parity/" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)
