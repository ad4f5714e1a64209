"""The one sys.excepthook of collectives (collectives/_exit.py) and the error helper."""

from __future__ import annotations

import os
import sys
from types import TracebackType

import pytest

from collectives import _exit
from collectives._errors import CollectiveTimeoutError, PeerFailureError, collective_error, where
from tests.helpers import run_to_end


def _exc() -> tuple[type[BaseException], BaseException, TracebackType | None]:
    try:
        raise ValueError("boom")
    except ValueError as exc:
        return type(exc), exc, exc.__traceback__


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """An empty registry and a recording previous hook (restored afterwards)."""
    calls: list[str] = []

    def previous(tp: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        calls.append(f"previous:{e}")

    monkeypatch.setattr(_exit, "_before", [])
    monkeypatch.setattr(_exit, "_after", [])
    monkeypatch.setattr(_exit, "_handling", None)
    monkeypatch.setattr(sys, "excepthook", previous)
    return calls


@pytest.mark.timeout(60)
def test_importing_collectives_leaves_sys_excepthook_alone() -> None:
    code = (
        "import sys; before = sys.excepthook; import collectives, collectives.backends.cpu; "
        "import collectives.backends.nccl, collectives.backends.mpi; "
        "print(sys.excepthook is before)"
    )
    out = run_to_end([sys.executable, "-c", code], os.environ, 50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


@pytest.mark.timeout(10)
def test_one_hook_chains_to_the_previous_one_in_order(clean_registry: list[str]) -> None:
    calls = clean_registry

    def before(tp: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        calls.append("before")

    def after(tp: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        calls.append("after")

    _exit.on_uncaught(before)
    hook = sys.excepthook
    _exit.on_uncaught(after, after_print=True)
    _exit.on_uncaught(before)  # registering again changes nothing
    assert sys.excepthook is hook, "a second registration installed a second hook"
    sys.excepthook(*_exc())
    assert calls == ["before", "previous:boom", "after"]


@pytest.mark.timeout(10)
def test_a_failing_callback_does_not_hide_the_error(
    clean_registry: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(tp: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        raise OSError("disk full")

    _exit.on_uncaught(broken)
    sys.excepthook(*_exc())
    assert clean_registry == ["previous:boom"]
    assert "an exit hook failed: OSError: disk full" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_a_hook_wrapped_by_another_runs_the_callbacks_once(clean_registry: list[str]) -> None:
    calls = clean_registry

    def note(tp: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        calls.append("note")

    _exit.on_uncaught(note)
    ours = sys.excepthook

    def user_hook(tp: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        calls.append("user")
        ours(tp, e, tb)

    sys.excepthook = user_hook  # a library wraps our hook...
    _exit.on_uncaught(note)  # ...and a later registration installs ours on top of it
    sys.excepthook(*_exc())
    assert calls == ["note", "user", "previous:boom"]


def test_the_error_helper_names_rank_op_and_sequence_number() -> None:
    err = collective_error(
        CollectiveTimeoutError, "timed out", rank=3, op="all_reduce", seq=7, group="group 'g'"
    )
    assert str(err) == "[rank 3] all_reduce #7 (group 'g'): timed out"
    assert (err.rank, err.op, err.seq) == (3, "all_reduce", 7)
    cause = OSError("x")
    about_rank = collective_error(PeerFailureError, "setup failed", rank=1, cause=cause)
    assert str(about_rank) == "[rank 1] setup failed" and about_rank.op is None
    assert about_rank.__cause__ is cause
    assert where(2, "init") == "[rank 2] init"
