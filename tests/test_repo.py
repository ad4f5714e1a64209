"""Promises about the repository itself: the README's commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("python3 -m venv")]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = _command_lines((ROOT / "README.md").read_text())
    ci = _command_lines((ROOT / ".ci" / "run").read_text())
    assert len(ci) == 1, f".ci/run should hold one set-up-and-test line, found {ci}"
    assert ci[0] in readme, f"README does not show the command .ci/run runs:\n{ci[0]}"
    assert "pytest" in ci[0]


def test_readme_main_job_runs_the_example() -> None:
    readme = _command_lines((ROOT / "README.md").read_text())
    jobs = [ln for ln in readme if "examples/" in ln]
    assert jobs, "README has no main-job command running a script under examples/"
    script = jobs[0].split("examples/")[1].split()[0]
    assert (ROOT / "examples" / script).is_file(), f"README runs a missing script {script}"


def test_every_package_is_typed_and_declares_all() -> None:
    for pkg in ("tensorlib", "collectives", "ddp"):
        assert (ROOT / pkg / "py.typed").is_file(), f"{pkg} lacks py.typed"
        assert "__all__" in (ROOT / pkg / "__init__.py").read_text(), f"{pkg} lacks __all__"
