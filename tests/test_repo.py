"""Promises about the repository itself: the README's commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("python3 -m venv")]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = _command_lines((ROOT / "README.md").read_text())
    ci = _command_lines((ROOT / ".ci" / "run").read_text())
    tests = [ln for ln in ci if "pytest" in ln]
    assert len(tests) == 1, f".ci/run should hold one set-up-and-test line, found {tests}"
    assert tests[0] in readme, f"README does not show the command .ci/run runs:\n{tests[0]}"
    assert ci[-1] == tests[0], ".ci/run should end with the README's test command"


def test_ci_installs_the_parity_extra_it_documents() -> None:
    # Without torch the differential suite skips: CI must install the extra that brings it,
    # pinned to the CPU build the README names.
    ci = (ROOT / ".ci" / "run").read_text()
    assert "'.[parity]'" in ci
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'parity = ["torch==2.13.0"]' in pyproject
    assert "'.[parity]'" in (ROOT / "README.md").read_text()


def test_readme_main_job_runs_the_example() -> None:
    readme = _command_lines((ROOT / "README.md").read_text())
    jobs = [ln for ln in readme if "examples/" in ln]
    assert jobs, "README has no main-job command running a script under examples/"
    script = jobs[0].split("examples/")[1].split()[0]
    assert (ROOT / "examples" / script).is_file(), f"README runs a missing script {script}"


def test_every_package_is_typed_and_declares_all() -> None:
    for pkg in ("tensorlib", "collectives", "ddp", "remote"):
        assert (ROOT / pkg / "py.typed").is_file(), f"{pkg} lacks py.typed"
        assert "__all__" in (ROOT / pkg / "__init__.py").read_text(), f"{pkg} lacks __all__"
