from __future__ import annotations

import numpy as np
import pytest

import tensorlib as tl
from tests.helpers import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_linear_relu_backward_runs(device: str) -> None:
    x = tl.randn(4, 3, device=device, requires_grad=True)
    y = (x * 2.0).relu().sum()
    y.backward()
    expected = np.where(x.numpy() > 0, 2.0, 0.0)
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), expected)
