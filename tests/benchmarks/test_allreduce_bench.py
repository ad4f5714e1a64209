"""allreduce-bench end to end on the cpu backend with tiny sizes, plus its arithmetic.

Functional checks only (table shape, JSON schema, #wrong, errors): never timings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _bench_engines as be
from benchmarks import _bench_math as bm
from benchmarks import _bench_report as br
from benchmarks import _bench_sweep as bs
from benchmarks import allreduce as ab
from benchmarks import cpu_allreduce
from tests.helpers import run_to_end

ROOT = Path(__file__).resolve().parents[2]
TINY = ["-b", "64", "-e", "1K", "-f", "4", "--iters", "2", "--warmup-iters", "1", "--blocks", "1"]
ROW_KEYS = {"size", "count", "type", "redop", "root", "time_us", "algbw", "busbw", "wrong",
            "limit_us", "limit_busbw", "share"}  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", bs.CORRUPT_ENV)
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def bench(
    *args: str, env: dict[str, str] | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return run_to_end(
        [sys.executable, "-m", "benchmarks.allreduce", *args], _env(**(env or {})), timeout
    )


def data_rows(stdout: str) -> list[list[str]]:
    return [ln.split() for ln in stdout.splitlines() if ln.strip() and not ln.startswith("#")]


# ---------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    ("text", "expect"),
    [("4", 4), ("4K", 4096), ("4k", 4096), ("256M", 256 << 20), ("1G", 1 << 30),
     ("64KiB", 65536), ("1.5K", 1536), ("8B", 8)],
)  # fmt: skip
def test_parse_size(text: str, expect: int) -> None:
    assert bm.parse_size(text) == expect


@pytest.mark.parametrize("bad", ["", "x", "4Q", "0", "-1K"])
def test_parse_size_rejects(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bm.parse_size(bad)


def test_human_sizes() -> None:
    assert [bm.human(n) for n in (512, 4096, 1536, 256 << 20, 1 << 30)] == [
        "512B", "4K", "1.5K", "256M", "1G"]  # fmt: skip
    almost = int(4.02 * (1 << 20))
    assert bm.human(almost) == "4.0M"  # the table's footer: one decimal unless exactly whole
    assert bm.human(almost, whole_within=0.05) == "4M"  # ddp_scaling's bucket sizes


def test_busbw_factors() -> None:
    assert bm.bus_factor("all_reduce", 1) == 0
    assert bm.bus_factor("all_reduce", 2) == 1
    assert bm.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bm.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    for op in ("all_gather", "reduce_scatter"):
        assert bm.bus_factor(op, 2) == pytest.approx(0.5)
        assert bm.bus_factor(op, 8) == pytest.approx(7 / 8)
    for op in ("broadcast", "reduce"):
        assert bm.bus_factor(op, 2) == bm.bus_factor(op, 16) == 1
    with pytest.raises(ValueError):
        bm.bus_factor("all_to_all", 2)


def test_sweep_and_rounding() -> None:
    assert bm.sizes(4 << 10, 256 << 20, 4)[-1] == 256 << 20
    assert bm.sizes(4, 100, 4) == [4, 16, 64]
    assert bm.sizes(8, 8, 2) == [8]
    assert bm.element_count("all_reduce", 10, 4, 3) == 2
    assert bm.element_count("reduce_scatter", 40, 4, 3) == 9  # 10 elements -> 9 = 3 * 3
    assert bm.element_count("all_gather", 4, 4, 2) == 2  # at least one element per rank


# ---------------------------------------------------------------------------- end to end
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [1, 2])
def test_table_and_json(nproc: int, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    p = bench("--nproc", str(nproc), "--backend", "cpu", *TINY, "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = data_rows(p.stdout)
    assert [int(r[0]) for r in rows] == [64, 256, 1024]
    for r in rows:
        assert len(r) == 11  # size count type redop root time algbw busbw #wrong lim(us) %lim
        assert r[2:5] == ["float", "sum", "-1"] and r[8] == "0" and r[10].endswith("%")
    assert "avg busbw" in p.stdout and "share of the limit" in p.stdout
    assert "[cpu] 3/3" in p.stderr  # progress goes to stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == br.SCHEMA and doc["engine"] == "cpu"
    for key in ("python", "numpy", "host", "cpu_model", "world_size", "backend"):
        assert key in doc["env"]
    assert doc["env"]["world_size"] == nproc
    res = doc["results"]["cpu"]
    assert res["world"] == nproc
    assert len(res["rows"]) == 3 and all(set(r) >= ROW_KEYS for r in res["rows"])
    factor = bm.bus_factor("all_reduce", nproc)
    for r in res["rows"]:
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["busbw"] == pytest.approx(r["algbw"] * factor)
        # Each row's share of the limit timed at its own size.
        assert r["limit_us"] > 0 and r["share"] == pytest.approx(r["limit_us"] / r["time_us"])


def test_limit_pass_covers_the_size_and_leaves_the_buffer_as_it_was() -> None:
    import numpy as np

    for n, words in ((1, 1), (7, 1), (8, 1), (9, 2), (4096, 512)):
        buf = bm.limit_buffer(n)
        assert buf.nbytes == 8 * words and buf.nbytes - n < 8, (n, buf.nbytes)
        buf[:] = np.arange(words, dtype=np.uint64) * 0x0123456789ABCDEF
        before = buf.copy()
        bm.limit_pass(buf)
        assert np.array_equal(buf, before)


@pytest.mark.timeout(120)
def test_timed_data_never_overflows() -> None:
    """The timed calls reduce in place many times: float16 would overflow within 17 sums of
    growing data (the old RuntimeWarning); the fixed point of the timed data is checked."""
    p = bench("--nproc", "2", "--dtype", "float16", "-b", "64", "-e", "256", "--iters", "40",
              "--warmup-iters", "2", "--blocks", "2")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "RuntimeWarning" not in p.stderr and "overflow" not in p.stderr
    assert [r[8] for r in data_rows(p.stdout)] == ["0", "0"]


@pytest.mark.timeout(120)
def test_cpu_py_is_the_cpu_backend_without_its_helper(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    # With --bind-cores: every rank on a core of its own (the run must work the same).
    p = bench("--nproc", "2", *TINY, "--bind-cores", "--compare", "cpu-py", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert all(r[8] == "0" and r[14] == "0" for r in data_rows(p.stdout))  # #wrong, both
    res = json.loads(out.read_text())["results"]
    built = importlib.util.find_spec("collectives.backends.cpu._cshm") is not None
    assert res["cpu"]["native"] is built and res["cpu-py"]["native"] is False


@pytest.mark.timeout(120)
def test_busy_main_reports_idle_and_busy() -> None:
    p = bench("--nproc", "2", "-b", "4K", "-e", "16K", "-f", "4", "--iters", "3", "--blocks",
              "2", "--busy-main", "--compare", "cpu-zc")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "rank 0 busy in Python" in p.stdout
    head = next(ln for ln in p.stdout.splitlines() if ln.startswith("#") and "busy/idle" in ln)
    assert "idle(us)" in head
    for r in data_rows(p.stdout):
        assert r[8] == "0" and float(r[11]) > 0 and r[12].endswith("x")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("op", bm.OPS)
def test_every_op_at_two_ranks(op: str) -> None:
    p = bench("--nproc", "2", "--op", op, "-b", "24", "-e", "96", "-f", "4", "--iters", "2",
              "--blocks", "1", "--async", "--zero-copy")  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = data_rows(p.stdout)
    assert len(rows) == 2 and all(r[8] == "0" for r in rows)
    root = "0" if op in ("broadcast", "reduce") else "-1"
    assert {r[4] for r in rows} == {root}
    if op == "reduce_scatter":
        assert "rounded to a multiple of world size" not in p.stdout  # 24 and 96 divide
    if op in ("all_gather", "reduce_scatter"):
        assert float(rows[0][7]) == pytest.approx(float(rows[0][6]) * 0.5, abs=0.011)
    assert all(r[10].endswith("%") for r in rows)  # the limit is timed for every op


@pytest.mark.timeout(120)
def test_reduce_scatter_rounds_and_says_so() -> None:
    p = bench("--nproc", "2", "--op", "reduce_scatter", "-b", "12", "-e", "12", "--iters", "1",
              "--blocks", "1")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert data_rows(p.stdout)[0][:2] == ["8", "2"]
    assert "# note: reduce_scatter sizes rounded" in p.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_wrong_counts_corrupted_elements(op: str) -> None:
    p = bench("--nproc", "2", "--op", op, "-b", "64", "-e", "64", "--iters", "1", "--blocks",
              "1", env={bs.CORRUPT_ENV: "3"})  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert data_rows(p.stdout)[0][8] == str(3 * bs.CHECK_ITERS)


@pytest.mark.timeout(120)
def test_no_check_prints_na() -> None:
    p = bench("--nproc", "1", *TINY, "--no-check", env={bs.CORRUPT_ENV: "3"})
    assert p.returncode == 0, p.stderr
    assert {r[8] for r in data_rows(p.stdout)} == {"N/A"}


@pytest.mark.timeout(120)
def test_inside_launcher_ranks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = bench("--backend", "cpu", *TINY, env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "running cpu" not in p.stderr  # no ranks of its own were started
    assert len(data_rows(p.stdout)) == 3


@pytest.mark.timeout(120)
def test_plot_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "busbw.png"
    p = bench("--nproc", "1", *TINY, "--plot", str(png))
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert ab.main(["--nproc", "1", "--plot", "x.png"]) == 2


# ---------------------------------------------------------------------------- errors
def _probe(engine: str) -> str | None:
    return be.availability(engine, "cpu")


@pytest.mark.timeout(60)
def test_nccl_without_gpu_is_one_line() -> None:
    why = _probe("nccl")
    if why is None:
        pytest.skip("NCCL and a GPU are usable here")
    p = bench("--backend", "nccl", timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("allreduce-bench: --backend nccl")
    # The probe's reason (which may list the paths it tried on several lines) on one line.
    assert " ".join(part.strip() for part in why.splitlines() if part.strip()) in lines[0]


@pytest.mark.timeout(60)
def test_mpi_without_mpi4py() -> None:
    if _probe("mpi") is None:
        pytest.skip("mpi4py is installed here")
    p = bench("--backend", "mpi", timeout=60)
    assert p.returncode == 2 and "mpi4py is not installed" in p.stderr


@pytest.mark.timeout(180)
def test_mpi_backend_beside_its_engines_and_raw_mpi4py(tmp_path: Path) -> None:
    """--backend mpi runs our mpi backend under mpiexec; mpi-nb (its non-blocking engine) and
    raw mpi4py run beside it in the same report, every result checked."""
    if (why := _probe("mpi")) is not None:
        pytest.skip(why)
    out = tmp_path / "r.json"
    p = bench("--nproc", "2", "--backend", "mpi", *TINY, "--compare", "mpi-nb,mpi4py",
              "--json", str(out), timeout=170)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "engine mpi, 2 ranks" in p.stdout
    rows = data_rows(p.stdout)
    assert [int(r[0]) for r in rows] == [64, 256, 1024]
    assert all(r[8] == "0" for r in rows)  # ours
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"mpi", "mpi-nb", "mpi4py"}
    for eng, res in doc["results"].items():
        assert res["world"] == 2, eng
        assert [r["wrong"] for r in res["rows"]] == [0, 0, 0], eng


@pytest.mark.timeout(120)
def test_mpi_backend_inside_mpiexec_ranks() -> None:
    """``mpiexec -n 2 allreduce-bench --backend mpi``: the ranks mpiexec started run it."""
    from tests.collectives.harness.mpipool import mpi_env, mpi_unavailable_reason, mpiexec_command

    if (why := mpi_unavailable_reason()) is not None:
        pytest.skip(why)
    env = mpi_env(_env())
    cmd = [*mpiexec_command(2), sys.executable, "-m", "benchmarks.allreduce", "--backend", "mpi"]
    p = run_to_end([*cmd, *TINY], env, 110)
    assert p.returncode == 0, p.stderr
    assert "engine mpi, 2 ranks" in p.stdout and "running mpi" not in p.stderr
    rows = data_rows(p.stdout)
    assert [int(r[0]) for r in rows] == [64, 256, 1024] and all(r[8] == "0" for r in rows)


@pytest.mark.timeout(60)
def test_one_failed_rank_ends_the_others_at_once() -> None:
    # A rank that fails early (CI: its store's port taken) left the other waiting for that
    # store until the test's timeout; the benchmark now kills the rest and reports the first.
    code = "import sys, time; sys.exit(3) if sys.argv[1] == '0' else time.sleep(120)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)]) for r in range(2)]
    try:
        codes = ab._wait_all_or_first_failure(procs)
    finally:
        for p in procs:
            p.kill()
    assert codes == [3, -9]


@pytest.mark.timeout(120)
def test_missing_peer_is_skipped_with_reason() -> None:
    missing = [e for e in ("gloo", "mpi4py") if _probe(e) is not None]
    if not missing:
        pytest.skip("torch and mpi4py are both installed here")
    p = bench("--nproc", "1", *TINY, "--compare", ",".join(missing))
    assert p.returncode == 0, p.stderr
    for e in missing:
        assert f"# {e}: not run (" in p.stdout


@pytest.mark.parametrize(
    "argv",
    [["--compare", "nope"], ["-b", "1M", "-e", "1K"], ["--dtype", "int32", "--reduce-op", "avg"],
     ["--dtype", "notatype"], ["--backend", "nccl", "--zero-copy"]],
)  # fmt: skip
def test_impossible_requests_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert ab.main(["--nproc", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("allreduce-bench: ") and len(err.strip().splitlines()) == 1


def test_cpu_allreduce_wrapper_translates() -> None:
    argv: list[Any] = cpu_allreduce.translate(["--nproc", "4", "-e", "64M", "--peers", "gloo"])
    assert argv[argv.index("--compare") + 1] == "cpu-zc,gloo"
    assert argv[argv.index("--nproc") + 1] == "4" and argv[argv.index("-e") + 1] == "64M"
    argv = cpu_allreduce.translate(["--no-zero-copy", "--peers", ""])
    assert argv[argv.index("--compare") + 1] == ""


@pytest.mark.gpu
@pytest.mark.real_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_nccl_on_a_gpu_end_to_end(op: str, tmp_path: Path) -> None:
    # The GPU path of the CLI: CuPy buffers, device synchronization, the device-copy share.
    out = tmp_path / "nccl.json"
    p = bench(
        "--backend", "nccl", "--device", "cuda", "--nproc", "1", "--op", op,
        "-b", "8", "-e", "4M", "-f", "16", "--json", str(out), timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    rows = data_rows(p.stdout)
    assert rows and all(r[8] == "0" for r in rows), p.stdout  # #wrong column
    report = json.loads(out.read_text())
    assert report["results"][report["engine"]]["rows"], report
