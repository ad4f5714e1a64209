"""The main example trains to the accuracy the README claims."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_mlp", ROOT / "examples" / "train_mlp.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_mlp"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
def test_digits_mlp_reaches_95_percent() -> None:
    pytest.importorskip("sklearn", reason="the example's dataset ships with scikit-learn")
    mod = _load_example()
    acc = mod.train(epochs=20, progress=False, log=False)
    assert acc >= 0.95, f"test accuracy {acc:.2%} is below the 95% the README claims"


@pytest.mark.timeout(60)
def test_example_cli_prints_progress_and_final_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    mod = _load_example()
    assert mod.main(["--epochs", "2"]) == 0
    out, err = capsys.readouterr()
    assert "epoch   2" in out
    assert "final test accuracy:" in out
    assert "epoch 2/2" in err  # the progress bar goes to stderr
