"""Backwards-compatible wrapper: the cpu backend's all-reduce against gloo and MPI.

    python -m benchmarks.cpu_allreduce [--nproc 2] [-e 64M] [--peers gloo,mpi4py] [--json out.json]

Kept for old command lines; the one implementation is ``benchmarks/allreduce.py``
(``allreduce-bench``). This runs ``allreduce-bench --backend cpu --compare cpu-zc,gloo,mpi4py``
(``--no-zero-copy`` drops ``cpu-zc``, ``--peers`` picks the others, ``--reps`` is
``--blocks``).
"""

from __future__ import annotations

import argparse

from benchmarks import allreduce


def translate(argv: list[str] | None = None) -> list[str]:
    """This script's old options as ``allreduce-bench`` arguments."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("-b", "--min-bytes", default="4K")
    p.add_argument("-e", "--max-bytes", default="256M")
    p.add_argument("-f", "--step-factor", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=5, help="timed blocks per size")
    p.add_argument("--peers", default="gloo,mpi4py", help="comma list of gloo,mpi4py; '' for none")
    p.add_argument("--no-zero-copy", action="store_true", help="skip the cpu-zc engine")
    p.add_argument("--json", help="write all results here")
    a = p.parse_args(argv)
    peers = ([] if a.no_zero_copy else ["cpu-zc"]) + [e for e in a.peers.split(",") if e]
    out = ["--backend", "cpu", "--nproc", str(a.nproc), "-b", str(a.min_bytes)]
    out += ["-e", str(a.max_bytes), "-f", str(a.step_factor), "--dtype", a.dtype]
    out += ["--blocks", str(a.reps), "--compare", ",".join(peers)]
    return out + (["--json", a.json] if a.json else [])


def main(argv: list[str] | None = None) -> int:
    """Run ``allreduce-bench`` with the translated options."""
    return allreduce.main(translate(argv))


if __name__ == "__main__":
    raise SystemExit(main())
