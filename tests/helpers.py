"""Helpers shared by the test modules."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Use as @pytest.mark.parametrize("device", DEVICES): the same test body runs on the CPU and,
# marked `gpu`, on cuda:0 (skipped with the reason when no GPU is usable).
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu, id="cuda")]


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as module ``name`` (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_to_end(
    cmd: Sequence[str], env: Mapping[str, str], timeout: float, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to its end under a hard time limit (a hang fails the test with
    ``TimeoutExpired``, never hangs CI), capturing stdout and stderr as text."""
    return subprocess.run(
        list(cmd), cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout
    )
