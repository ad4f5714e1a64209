"""Promises about the repository itself: the README's commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("python3 -m venv")]


def _readme_command(kind: str) -> str:
    lines = _command_lines((ROOT / "README.md").read_text())
    found = [ln for ln in lines if (kind in ln)]
    assert len(found) == 1, f"README should show one {kind!r} command, found {found}"
    return found[0]


def test_ci_runs_the_readme_test_command_first_in_a_fresh_environment() -> None:
    # Verbatim, and before anything else is installed: an extra installed first (torch) once
    # hid a README command that failed for everyone following it.
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = _readme_command("pytest")
    assert command in ci, f".ci/run does not run the README's test command:\n{command}"
    at = ci.index(command)
    # set -e ignores a failure before the last command of an && list: the status is checked.
    assert 'status=$?; if [ "$status" -ne 0 ]' in ci[at + 1], ".ci/run must check the status"
    assert "rm -rf .venv" in ci[:at], ".ci/run must remove any old .venv before the README command"
    before = [ln for ln in ci[:at] if "pip install" in ln]
    assert not before, f".ci/run installs something before the README's test command: {before}"


def test_ci_runs_the_parity_suite_after_the_readme_command() -> None:
    # Without torch the differential suite skips: CI installs the extra that brings it, pinned
    # to the CPU build the README names, only once the README's own command has passed.
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    at = ci.index(_readme_command("pytest"))
    parity = [i for i, ln in enumerate(ci) if "'.[parity]'" in ln]
    assert parity and min(parity) > at, ".ci/run should install '.[parity]' after the README test"
    after = ci[min(parity) :]
    assert any(
        "pytest" in ln and "tests/tensorlib/parity" in ln and "tests/ddp/parity" in ln
        for ln in after
    )
    assert any(ln.strip().endswith("mypy .") for ln in after), "mypy must run again with torch"
    pyproject = (ROOT / "pyproject.toml").read_text()
    # Ignite's own engine and metrics are the reference for ddp.engine and ddp.metrics.
    assert 'parity = ["torch==2.13.0", "pytorch-ignite==0.5.5"]' in pyproject
    assert "'.[parity]'" in (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_main_job_in_a_fresh_clone() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    job = _readme_command("examples/")
    assert job in ci, f".ci/run does not run the README's main-job command:\n{job}"
    assert 'status=$?; if [ "$status" -ne 0 ]' in ci[ci.index(job) + 1], "check the job's status"
    before = ci[: ci.index(job)]
    assert any("git clone" in ln for ln in before), "the main job should run in a fresh clone"


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


def test_ci_runs_the_slow_tests_the_default_run_leaves_out() -> None:
    # The default run deselects `slow` (pyproject's addopts) to stay under 10 minutes on 2
    # cores; CI must still run them, after the README's test command.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "addopts = \"-rfE -m 'not slow'\"" in pyproject
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    at = ci.index(_readme_command("pytest"))
    assert any("pytest" in ln and "-m slow" in ln for ln in ci[at + 1 :]), ".ci/run: no -m slow"
