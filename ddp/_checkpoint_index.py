"""The index of a sharded checkpoint, and reading element ranges of its tensors.

A sharded checkpoint is a directory: one ``tensorlib.save`` file per rank of the save that
wrote it (``shard-{save id}-{rank:05d}.npz``, a list of 1-D arrays), and ``index.npz``
(a ``tensorlib.save`` file: its manifest is the JSON below) that rank 0 writes last.

Every tensor of the checkpoint (a model entry, an optimizer state array) is described by its
full shape, its dtype and its *chunks*: ``[file, member, lo, hi]`` says that member ``member``
of file ``files[file]`` holds the elements ``[lo, hi)`` of the tensor's C-order flat view.
One codec for every way of sharding: a ``fully_shard`` shard's rows ``[a, b)`` are the flat
elements ``[a * row, b * row)``, a ZeRO-1 piece is a flat range already, and a tensor that
every rank holds whole is cut into even flat ranges, one per rank. So a reader at any world
size asks for the flat range it needs (its rows, its piece, or everything) and gets it from
whichever chunks overlap it, reading only those bytes of each member.

Index::

    {"format": "ddp.sharded-checkpoint/1", "world_size": N, "files": [name per rank],
     "tensors": {key: {"shape": [...], "dtype": "float64", "chunks": [[file, member, lo, hi]]}},
     "model": [model state names, in order] (tensor key "model/{name}"),
     "optimizer": None or {"state": {index: [[name, "tensor", key] or [name, "scalar", v]]},
                           "param_groups": [...]},
     "scheduler", "scaler", "step", "epoch", "loader", "rng", "extra": as ddp.checkpoint/2}
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

import tensorlib as tl

__all__ = ["FORMAT", "INDEX", "ShardReader", "check_index", "merge_chunks", "model_key"]

FORMAT = "ddp.sharded-checkpoint/1"
INDEX = "index.npz"
# The dtypes a Tensor holds (what tensorlib.save writes): anything else is a damaged file.
_DTYPES = {str(np.dtype(d)) for d in (tl.float16, tl.float32, tl.float64, tl.int32, tl.int64)}
_DTYPES.add("bool")
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header (30 bytes)


def model_key(name: str) -> str:
    """The tensor key of model state entry ``name``."""
    return f"model/{name}"


def optimizer_key(index: int, name: str) -> str:
    """The tensor key of state ``name`` of the optimizer's parameter ``index``."""
    return f"optimizer/{index}/{name}"


def merge_chunks(metas: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's declared tensors and chunks as the index's ``tensors`` table.

    Raises:
        ValueError: when ranks declare one tensor with different shapes or dtypes, or the
            chunks of a tensor leave elements uncovered (the ranks held different state).
    """
    tensors: dict[str, dict[str, Any]] = {}
    for r, meta in enumerate(metas):
        for key, shape, dtype in meta["tensors"]:
            entry = tensors.setdefault(key, {"shape": shape, "dtype": dtype, "chunks": []})
            if entry["shape"] != shape or entry["dtype"] != dtype:
                raise ValueError(
                    f"the ranks hold different {key!r}: rank 0..{r - 1} declare "
                    f"{entry['dtype']} {entry['shape']}, rank {r} {dtype} {shape} (every rank "
                    "must save the same model and optimizer)"
                )
        for key, member, lo, hi in meta["chunks"]:
            tensors[key]["chunks"].append([r, member, lo, hi])
    for key, entry in tensors.items():
        gap = _gap(entry["chunks"], math.prod(entry["shape"]))
        if gap is not None:
            raise ValueError(
                f"no rank holds elements {gap[0]}..{gap[1] - 1} of {key!r} (shape "
                f"{entry['shape']}): the ranks hold different state (every rank must step "
                "the same parameters with the same optimizer)"
            )
    return tensors


def _gap(chunks: list[list[int]], total: int) -> tuple[int, int] | None:
    """The first range of ``[0, total)`` that no chunk covers, or None."""
    at = 0
    for _, _, lo, hi in sorted(chunks, key=lambda c: (c[2], c[3])):
        if lo > at:
            return at, lo
        at = max(at, hi)
    return (at, total) if at < total else None


def check_index(where: str, target: Path, index: Any) -> None:
    """Raise a ValueError naming what is wrong when ``index`` is not a complete index whose
    files are all present (every rank checks the same things, so every rank raises alike)."""
    head = f"{where}: {target} is not a complete sharded checkpoint"
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise ValueError(f"{head}: its {INDEX} has format {found!r}, expected {FORMAT!r}")
    files, tensors = index.get("files"), index.get("tensors")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ValueError(f"{head}: its index has no list of shard files")
    if not isinstance(tensors, dict) or not isinstance(index.get("model"), list):
        raise ValueError(f"{head}: its index has no tensor table or model entry list")
    for name in files:
        if os.path.basename(name) != name or not (target / name).is_file():
            raise ValueError(f"{head}: shard file {name!r} named by the index is missing")
    for key, entry in tensors.items():
        try:
            shape, dtype, chunks = entry["shape"], entry["dtype"], entry["chunks"]
            total = math.prod(int(d) for d in shape)
            ok = dtype in _DTYPES and all(
                0 <= c[0] < len(files) and 0 <= c[2] < c[3] <= total for c in chunks
            )
        except (KeyError, TypeError, IndexError, ValueError):
            ok, total, chunks = False, 0, []
        if not ok:
            raise ValueError(f"{head}: the index entry of {key!r} is malformed: {entry!r:.200}")
        gap = _gap(chunks, total)
        if gap is not None:
            raise ValueError(f"{head}: no shard holds elements {gap[0]}..{gap[1] - 1} of {key!r}")
    missing = [n for n in index["model"] if model_key(n) not in tensors]
    if missing:
        raise ValueError(f"{head}: model entries {missing} have no tensor in the index")


class ShardReader:
    """Reads flat element ranges of an index's tensors from its shard files (only the bytes
    of the chunks that overlap; members stored uncompressed are read in place).

    Use as a context manager: the shard files stay open until it exits.
    """

    def __init__(self, target: Path, index: dict[str, Any]) -> None:
        self.target = target
        self.tensors: dict[str, dict[str, Any]] = index["tensors"]
        self._files: list[str] = index["files"]
        self._open: dict[int, tuple[Any, zipfile.ZipFile, list[str]]] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for raw, zf, _ in self._open.values():
            zf.close()
            raw.close()
        self._open.clear()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def dtype(self, key: str) -> np.dtype[Any]:
        return np.dtype(self.tensors[key]["dtype"])

    def read(self, key: str, lo: int, hi: int) -> np.ndarray[Any, Any]:
        """Elements ``[lo, hi)`` of tensor ``key``'s flat view, as a new 1-D array."""
        entry = self.tensors[key]
        total = math.prod(entry["shape"])
        if not 0 <= lo <= hi <= total:
            raise ValueError(f"elements {lo}..{hi} of {key!r} are outside its {total}")
        out = np.empty(max(0, hi - lo), dtype=self.dtype(key))
        for f, member, clo, chi in entry["chunks"]:
            a, b = max(lo, clo), min(hi, chi)
            if a < b:
                out[a - lo : b - lo] = self._member(f, member, chi - clo, a - clo, b - a, key)
        return out

    def _member(
        self, f: int, member: int, size: int, start: int, count: int, key: str
    ) -> np.ndarray[Any, Any]:
        """``count`` elements from ``start`` of member ``member`` (of ``size`` elements)."""
        raw, zf, names = self._zip(f)
        path = self.target / self._files[f]
        if not 0 <= member < len(names):
            raise ValueError(f"{path}: has no member {member} (for {key!r}); damaged file")
        info = zf.getinfo(f"{names[member]}.npy")
        dtype = self.dtype(key)
        with zf.open(info) as fp:
            version = np.lib.format.read_magic(fp)
            with tl.npy_header_lock:  # NumPy's header parser is not thread-safe on 3.11
                if version == (1, 0):
                    shape, fortran, stored = np.lib.format.read_array_header_1_0(fp)
                else:
                    shape, fortran, stored = np.lib.format.read_array_header_2_0(fp)
            header = fp.tell()
            if stored != dtype or fortran or tuple(shape) != (size,):
                raise ValueError(
                    f"{path}: member for {key!r} holds {stored} {tuple(shape)}, the index says "
                    f"{dtype} ({size},); the file is damaged or not this save's"
                )
            at = header + start * dtype.itemsize
            if info.compress_type != zipfile.ZIP_STORED:
                fp.seek(at)  # compressed: read through (np.savez never compresses)
                data = fp.read(count * dtype.itemsize)
                return np.frombuffer(data, dtype=dtype, count=count)
        # Stored: the member's bytes sit in the file after its local header; read just those.
        raw.seek(info.header_offset)
        fields = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
        if fields[0] != b"PK\x03\x04":
            raise ValueError(f"{path}: bad zip header for {key!r}; damaged file")
        raw.seek(info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1] + at)
        out = np.empty(count, dtype=dtype)
        if raw.readinto(out.view(np.uint8)) != out.nbytes:
            raise ValueError(f"{path}: truncated member for {key!r}; damaged file")
        return out

    def _zip(self, f: int) -> tuple[Any, zipfile.ZipFile, list[str]]:
        """File ``f``: its raw handle, its archive, and its members in list order."""
        got = self._open.get(f)
        if got is not None:
            return got
        path = self.target / self._files[f]
        raw = open(path, "rb")  # noqa: SIM115 (closed in __exit__)
        try:
            zf = zipfile.ZipFile(raw)
            names = _members(zf, path)
        except (zipfile.BadZipFile, ValueError, KeyError) as exc:
            raw.close()
            raise ValueError(f"{path} is not a shard file of this checkpoint: {exc}") from exc
        self._open[f] = (raw, zf, names)
        return self._open[f]


def _members(zf: zipfile.ZipFile, path: Path) -> list[str]:
    """The archive member of each array of the saved list, from tensorlib's JSON manifest
    (``{"root": [{"$array": "a0"}, ...]}``), without loading any array."""
    with zf.open("__manifest__.npy") as fp, tl.npy_header_lock:
        manifest = json.loads(np.lib.format.read_array(fp, allow_pickle=False).tobytes())
    root = manifest.get("root")
    if not isinstance(root, list) or not all(
        isinstance(n, dict) and isinstance(n.get("$array"), str) for n in root
    ):
        raise ValueError(f"{path}: its manifest is not a list of arrays")
    return [n["$array"] for n in root]
