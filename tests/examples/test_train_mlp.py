"""The main example trains to the accuracy the README claims."""

from __future__ import annotations

import pytest

from tests.helpers import load_example


@pytest.mark.timeout(60)
def test_digits_mlp_reaches_95_percent() -> None:
    pytest.importorskip("sklearn", reason="the example's dataset ships with scikit-learn")
    mod = load_example("train_mlp")
    acc = mod.train(epochs=20, progress=False, log=False)
    assert acc >= 0.95, f"test accuracy {acc:.2%} is below the 95% the README claims"


@pytest.mark.timeout(60)
def test_example_cli_prints_progress_and_final_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    mod = load_example("train_mlp")
    assert mod.main(["--epochs", "2"]) == 0
    out, err = capsys.readouterr()
    assert "epoch   2" in out
    assert "final test accuracy:" in out
    assert "epoch 2/2" in err  # the progress bar goes to stderr
