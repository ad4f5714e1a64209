"""``python -m collectives.run`` end to end, with tiny worker scripts, plus its pure helpers.

Worker scripts import nothing heavy, so each worker starts in a few tens of milliseconds.
Every test has a hard time limit, and every launcher run its own subprocess timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import TracebackType

import pytest

from collectives import _errorfile
from collectives.launch import _launcher
from collectives.launch._launcher import describe_exit, exit_status, gpu_assignment
from collectives.run import parse_args

REPO = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # The launcher's error-file directory lands here, even when a test kills the launcher.
    env["TMPDIR"] = str(tmp_path)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "DPT_ERROR_FILE"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # No GPU binding here (it has its own tests), and no CuPy import in the launcher.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def _launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "collectives.run", *args]


def _launch(
    tmp_path: Path,
    *args: str,
    timeout: float = 30.0,
    environ: dict[str, str] | None = None,
    **env: str,
) -> subprocess.CompletedProcess[bytes]:
    """Run the launcher to the end; ``environ`` replaces the whole environment, ``env`` adds."""
    return subprocess.run(
        _launch_cmd(*args),
        cwd=tmp_path,
        env=_env(tmp_path, **env) if environ is None else environ,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def _script(tmp_path: Path, body: str, name: str = "worker.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie waiting for a reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.02)
    return _gone(pid)


# What the worker scripts share: their rank, and files in their directory that tell the test
# (and other ranks) a pid. A pid file appears whole: written under another name, then renamed.
_PRELUDE = """
import os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
rank = int(os.environ["RANK"])
def path(name):
    return os.path.join(here, name)
def write_pid(name, pid=None):
    with open(path(name + ".tmp"), "w") as f:
        f.write(str(os.getpid() if pid is None else pid))
    os.rename(path(name + ".tmp"), path(name))
def wait_for(*names, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(path(n)) for n in names):
        if time.monotonic() > deadline:
            sys.exit("timed out waiting for " + repr(names))
        time.sleep(0.01)
"""


def test_free_port_is_outside_the_kernels_own_range() -> None:
    # The kernel hands ports in its ephemeral range to every outgoing connection; a port
    # picked from there was taken before rank 0's store bound it, in a parallel CI run.
    lo, hi = _launcher._ephemeral_range()
    ports = {_launcher.free_port() for _ in range(50)}
    assert not any(lo <= p <= hi for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random, so concurrent callers rarely meet
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # it is free


# ---------------------------------------------------------------------- end to end
@pytest.mark.timeout(60)
def test_env_args_and_stdout(tmp_path: Path) -> None:
    _script(
        tmp_path,
        """
        import json, os, sys
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, f"env{os.environ['RANK']}.json"), "w") as f:
            json.dump({"env": dict(os.environ), "argv": sys.argv[1:]}, f)
        print(f"stdout of rank {os.environ['RANK']}")
        """,
    )
    res = _launch(tmp_path, "--nproc-per-node", "2", "worker.py", "--lr", "0.1", "a b")
    assert res.returncode == 0, res.stderr.decode()
    stdout = res.stdout.decode()
    assert "stdout of rank 0" in stdout and "stdout of rank 1" in stdout
    seen = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(2)]
    ports, run_ids, error_files = set(), set(), set()
    for rank, info in enumerate(seen):
        env = info["env"]
        assert info["argv"] == ["--lr", "0.1", "a b"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == env["NODE_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env.get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS", "1")
        ports.add(env["MASTER_PORT"])
        run_ids.add(env["DPT_RUN_ID"])
        error_files.add(env["DPT_ERROR_FILE"])
    assert len(ports) == 1 and len(run_ids) == 1 and "" not in run_ids
    assert len(error_files) == 2
    port = int(ports.pop())
    assert 0 < port < 65536
    # The automatic port was free (and nothing of the job holds it any more).
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.timeout(60)
def test_multi_node_ranks(tmp_path: Path) -> None:
    _script(
        tmp_path,
        """
        import os
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT"]
        # One write: print() under -u writes the text and the newline separately, and the
        # two ranks' lines could interleave.
        os.write(1, (" ".join(os.environ[k] for k in keys) + "\\n").encode())
        """,
    )
    res = _launch(
        tmp_path,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        "29511",
        "worker.py",
    )
    assert res.returncode == 0, res.stderr.decode()
    lines = sorted(res.stdout.decode().splitlines())
    assert lines == ["2 4 0 2 1 10.1.2.3 29511", "3 4 1 2 1 10.1.2.3 29511"]


@pytest.mark.timeout(60)
def test_module_mode_and_raw_stderr(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        textwrap.dedent(
            """
            import sys
            print("module", __name__, sys.argv[1:])
            # A progress bar: carriage returns, no newline until the end.
            for step in range(3):
                sys.stderr.write(f"\\rstep {step}/3")
                sys.stderr.flush()
            sys.stderr.write("\\n")
            """
        )
    )
    res = _launch(tmp_path, "-m", "mypkg.train", "--x", "1")
    assert res.returncode == 0, res.stderr.decode()
    assert "module __main__ ['--x', '1']" in res.stdout.decode()
    assert b"\rstep 0/3\rstep 1/3\rstep 2/3\n" in res.stderr


@pytest.mark.timeout(60)
def test_first_failure_ends_the_others_and_reports_its_traceback(tmp_path: Path) -> None:
    _script(
        tmp_path,
        _PRELUDE
        + """
import signal, subprocess
if rank == 0:
    # A grandchild in rank 0's process group must be ended with it.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    write_pid("grandchild.pid", child.pid)
if rank == 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs SIGKILL after the grace period
if rank != 1:
    write_pid(f"rank{rank}.pid")
    time.sleep(60)
    open(path(f"finished{rank}"), "w").close()
else:
    wait_for("rank0.pid", "rank2.pid", "grandchild.pid")
    def load_batch():
        raise ValueError("bad batch 7 on purpose")
    load_batch()
""",
    )
    start = time.monotonic()
    res = _launch(tmp_path, "--nproc-per-node", "3", "--grace-period", "1", "worker.py")
    elapsed = time.monotonic() - start
    err = res.stderr.decode()
    assert res.returncode == 1, err
    assert elapsed < 15, elapsed
    report = err[err.index("collectives.run: job failed") :]
    assert "rank 1 (of 3; local rank 1" in report and "failed first: exited with code 1" in report
    assert "error: ValueError: bad batch 7 on purpose" in report
    assert "traceback of rank 1 (from its stderr)" in report
    assert "in load_batch" in report and 'raise ValueError("bad batch 7 on purpose")' in report
    assert "rank 0 terminated by SIGTERM" in report
    assert "rank 2 killed by SIGKILL after the 1 s grace period" in report
    assert not list(tmp_path.glob("finished*"))
    for name in ("rank0.pid", "rank2.pid", "grandchild.pid"):
        pid = int((tmp_path / name).read_text())
        assert _wait_gone(pid), f"{name} ({pid}) is still running"


@pytest.mark.timeout(60)
def test_traceback_from_error_file(tmp_path: Path) -> None:
    _script(
        tmp_path,
        """
        from collectives._errorfile import install_excepthook
        assert install_excepthook() and install_excepthook()  # idempotent
        try:
            {}["missing"]
        except KeyError as exc:
            raise RuntimeError("could not load the config") from exc
        """,
    )
    res = _launch(tmp_path, "worker.py")
    err = res.stderr.decode()
    assert res.returncode == 1, err
    report = err[err.index("collectives.run: job failed") :]
    assert "rank 0 (of 1; local rank 0" in report
    assert "error: RuntimeError: could not load the config" in report
    assert "traceback of rank 0 (from its error file)" in report
    # The whole chain, cause first.
    tb = report[report.index("from its error file") :]
    assert tb.index("KeyError: 'missing'") < tb.index("direct cause") < tb.index("RuntimeError")
    assert "other ranks on this node: none" in report


@pytest.mark.timeout(60)
def test_rank_killed_by_sigkill(tmp_path: Path) -> None:
    _script(
        tmp_path,
        _PRELUDE
        + """
import signal
if rank == 0:
    write_pid("rank0.pid")
    time.sleep(60)
else:
    wait_for("rank0.pid")
    os.kill(os.getpid(), signal.SIGKILL)
""",
    )
    res = _launch(tmp_path, "--nproc-per-node", "2", "--grace-period", "2", "worker.py")
    err = res.stderr.decode()
    assert res.returncode == 128 + signal.SIGKILL, err
    assert "rank 1 (of 2; local rank 1" in err and "failed first: killed by SIGKILL" in err
    assert "rank 0 terminated by SIGTERM" in err
    assert _wait_gone(int((tmp_path / "rank0.pid").read_text()))


_SLEEPER = (
    _PRELUDE
    + """
write_pid(f"rank{rank}.pid")
time.sleep(60)
"""
)


def _start_sleepers(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[Path]]:
    _script(tmp_path, _SLEEPER)
    proc = subprocess.Popen(
        _launch_cmd("--nproc-per-node", "2", "--grace-period", "2", "worker.py"),
        cwd=tmp_path,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pidfiles = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
    deadline = time.monotonic() + 20
    while not all(p.exists() for p in pidfiles) and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc, pidfiles


@pytest.mark.timeout(60)
def test_sigterm_to_launcher_ends_workers(tmp_path: Path) -> None:
    proc, pidfiles = _start_sleepers(tmp_path)
    try:
        assert all(p.exists() for p in pidfiles)
        proc.send_signal(signal.SIGTERM)
        _, err_bytes = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err_bytes.decode()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM" in err and "rank 0 killed by SIGTERM" in err
    for p in pidfiles:
        assert _wait_gone(int(p.read_text()))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    proc, pidfiles = _start_sleepers(tmp_path)
    try:
        assert all(p.exists() for p in pidfiles)
        proc.kill()  # SIGKILL: the launcher cannot clean up; the kernel must
        proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for p in pidfiles:
        assert _wait_gone(int(p.read_text()))


@pytest.mark.timeout(60)
def test_missing_script_is_reported(tmp_path: Path) -> None:
    res = _launch(tmp_path, "no_such_script.py")
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert "rank 0 (of 1" in err and "no_such_script.py" in err


# ---------------------------------------------------------------------- arguments
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "t.py"], "needs --master-addr and --master-port"),
        (["--max-restarts", "-1", "t.py"], "expected a number of restarts (an integer >= 0)"),
        (["--nnodes", "2", "--node-rank", "2", "t.py"], "--node-rank must be in [0, 2)"),
        (["--nproc-per-node", "0", "t.py"], "expected a positive integer"),
        (["--grace-period", "-1", "t.py"], "--grace-period must be >= 0"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_parse_defaults_and_torchrun_spellings() -> None:
    cfg = parse_args(["--nproc_per_node", "3", "--standalone", "t.py", "--nproc-per-node", "9"])
    assert cfg.nproc_per_node == 3 and cfg.world_size == 3
    assert cfg.target == "t.py" and cfg.target_args == ("--nproc-per-node", "9")
    assert cfg.master_addr == "127.0.0.1" and 0 < cfg.master_port < 65536
    assert cfg.grace_period == 5.0 and not cfg.module
    assert cfg.max_restarts == 0 and not cfg.fixed_port


# ---------------------------------------------------------------------- GPU binding
@pytest.mark.timeout(10)
def test_gpu_assignment() -> None:
    assert gpu_assignment(2, {}, device_count=0) is None
    assert gpu_assignment(2, {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert gpu_assignment(2, {}, device_count=4) == ["0", "1"]
    visible = {"CUDA_VISIBLE_DEVICES": "3, 5,7"}
    assert gpu_assignment(3, visible, device_count=3) == ["3", "5", "7"]
    with pytest.raises(ValueError, match=r"3 local ranks but only 2 GPU\(s\) visible") as info:
        gpu_assignment(3, {"CUDA_VISIBLE_DEVICES": "3,5"}, device_count=2)
    assert "DPT_ALLOW_SHARED_GPU=1" in str(info.value)
    shared = {"CUDA_VISIBLE_DEVICES": "3,5", "DPT_ALLOW_SHARED_GPU": "1"}
    assert gpu_assignment(3, shared, device_count=2) == ["3", "5", "3"]


@pytest.mark.gpu
@pytest.mark.real_gpu
@pytest.mark.timeout(120)
def test_gpu_binding_end_to_end(tmp_path: Path) -> None:
    import tensorlib

    count = tensorlib.cuda_device_count()
    _script(tmp_path, "import os; print(os.environ['RANK'], os.environ['CUDA_VISIBLE_DEVICES'])")
    env = _env(tmp_path, DPT_ALLOW_SHARED_GPU="1")
    env.pop("CUDA_VISIBLE_DEVICES")
    nproc = count + 1
    res = _launch(tmp_path, "--nproc-per-node", str(nproc), "worker.py", timeout=100, environ=env)
    assert res.returncode == 0, res.stderr.decode()
    got = dict(line.split() for line in res.stdout.decode().splitlines())
    assert got == {str(r): str(r % count) for r in range(nproc)}
    env.pop("DPT_ALLOW_SHARED_GPU")
    res = _launch(tmp_path, "--nproc-per-node", str(nproc), "worker.py", timeout=100, environ=env)
    assert res.returncode == 2 and b"DPT_ALLOW_SHARED_GPU=1" in res.stderr


# ---------------------------------------------------------------------- error records
def _raise_chained() -> tuple[type[BaseException], BaseException, TracebackType | None]:
    try:
        try:
            raise KeyError("inner")
        except KeyError as exc:
            raise RuntimeError("outer") from exc
    except RuntimeError as exc:
        return type(exc), exc, exc.__traceback__


@pytest.mark.timeout(10)
def test_error_file_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "rank3.json"
    monkeypatch.setenv("RANK", "3")
    _errorfile.write_error_file(path, *_raise_chained())
    record = _errorfile.read_error_file(path)
    assert record is not None
    assert record["rank"] == 3 and record["exc_type"] == "RuntimeError"
    assert record["message"] == "outer" and "KeyError: 'inner'" in record["traceback"]
    assert [p.name for p in tmp_path.iterdir()] == ["rank3.json"]  # no temporary left
    (tmp_path / "bad.json").write_text("[1, 2")
    assert _errorfile.read_error_file(tmp_path / "bad.json") is None
    (tmp_path / "list.json").write_text("[1, 2]")
    assert _errorfile.read_error_file(tmp_path / "list.json") is None
    assert _errorfile.read_error_file(tmp_path / "absent.json") is None


@pytest.mark.timeout(10)
def test_install_excepthook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def previous(t: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        calls.append(str(e))

    monkeypatch.setattr(sys, "excepthook", previous)
    monkeypatch.delenv(_errorfile.ERROR_FILE_ENV, raising=False)
    assert _errorfile.install_excepthook() is False
    assert sys.excepthook is previous
    path = tmp_path / "rank0.json"
    monkeypatch.setenv(_errorfile.ERROR_FILE_ENV, str(path))
    assert _errorfile.install_excepthook() is True
    hook = sys.excepthook
    assert _errorfile.install_excepthook() is True and sys.excepthook is hook
    hook(*_raise_chained())
    assert calls == ["outer"]  # the previous hook still runs (it prints the traceback)
    record = _errorfile.read_error_file(path)
    assert record is not None and record["message"] == "outer"


@pytest.mark.timeout(10)
def test_extract_traceback() -> None:
    assert _errorfile.extract_traceback("just some output\n") is None
    first = "Traceback (most recent call last):\n  File 'a.py'\nKeyError: 'x'\n"
    link = "\nThe above exception was the direct cause of the following exception:\n\n"
    second = "Traceback (most recent call last):\n  File 'b.py'\nValueError: y\n"
    old = "Traceback (most recent call last):\n  File 'old.py'\nOSError: z\n"
    text = old + "epoch 2\r50%\r" + first + link + second
    assert _errorfile.extract_traceback(text) == (first + link + second).rstrip("\n")


@pytest.mark.timeout(10)
def test_exit_descriptions() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_status(-signal.SIGTERM) == 143 and exit_status(2) == 2
