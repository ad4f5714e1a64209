"""The house rules, checked on the source: imports go down the stack, and rooms stay small.

The stack (docs/design.md): tensorlib <- collectives <- ddp and remote; ddp and remote do not
import each other; nothing in a library imports benchmarks or examples; and a package reaches
into another only through its public modules (no ``collectives._registry`` from benchmarks).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("tensorlib", "collectives", "ddp", "remote")
USERS = ("benchmarks", "examples")
# What each top-level package may import of the project's own packages.
ALLOWED: dict[str, set[str]] = {
    "tensorlib": set(),
    "collectives": {"tensorlib"},
    "ddp": {"tensorlib", "collectives"},
    "remote": {"tensorlib", "collectives"},
    "benchmarks": {"tensorlib", "collectives", "ddp", "remote"},
    "examples": {"tensorlib", "collectives", "ddp", "remote"},
}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _sources(packages: tuple[str, ...]) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if p.is_file())


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every module ``source`` (the text of ``module``) imports, relative ones resolved,
    including imports inside functions (lazy imports count too)."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(target)
            # `from pkg import _private_module` names a module too.
            found.extend(f"{target}.{alias.name}" for alias in node.names)
    return found


def violations(path: Path, source: str | None = None) -> list[str]:
    """The imports of ``path`` that break the layering or reach into a private module."""
    module = _module_name(path)
    owner = module.split(".")[0]
    text = path.read_text() if source is None else source
    bad: list[str] = []
    for target in imported_modules(text, module, path.name == "__init__.py"):
        top = target.split(".")[0]
        if top not in ALLOWED or top == owner:
            continue
        if top not in ALLOWED[owner]:
            bad.append(f"{module} imports {target} ({owner} may not import {top})")
        elif any(part.startswith("_") and not part.startswith("__") for part in target.split(".")):
            bad.append(f"{module} imports {target}, a private module of {top}")
    return bad


def test_imports_go_down_the_stack_and_only_through_public_modules() -> None:
    bad = [v for path in _sources(LIBRARIES + USERS) for v in violations(path)]
    assert not bad, "layering broken:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("where", "line", "complaint"),
    [
        ("tensorlib/_x.py", "from collectives import all_reduce", "may not import collectives"),
        ("tensorlib/_x.py", "import ddp", "may not import ddp"),
        ("collectives/_x.py", "from ddp._ddp import DistributedDataParallel", "may not import"),
        ("collectives/_x.py", "def f():\n    import benchmarks.allreduce", "benchmarks"),
        ("ddp/_x.py", "from remote import serve", "may not import remote"),
        ("remote/_x.py", "from ddp import DataLoader", "may not import ddp"),
        ("tensorlib/_x.py", "import remote", "may not import remote"),
        ("collectives/_x.py", "from remote import devices", "may not import remote"),
        ("remote/_x.py", "from tensorlib._device_kinds import register", "private module"),
        ("ddp/_x.py", "from tensorlib._tensor import Tensor", "private module of tensorlib"),
        ("benchmarks/x.py", "from collectives import _registry", "private module"),
        ("benchmarks/x.py", "from collectives.backends.nccl._lib import load", "private"),
    ],
)
def test_the_layering_check_catches_each_kind_of_violation(
    where: str, line: str, complaint: str
) -> None:
    found = violations(ROOT / where, line + "\n")
    assert found and complaint in found[0], found


def test_the_layering_check_allows_what_the_stack_allows() -> None:
    ok = [
        ("collectives/_x.py", "from tensorlib import Tensor"),
        ("ddp/_x.py", "import collectives\nfrom tensorlib import nn"),
        ("collectives/backends/_x.py", "from .._backend import Backend\nfrom . import _shm"),
        ("benchmarks/x.py", "from collectives.backends.nccl import load_library"),
        ("remote/_x.py", "import tensorlib as tl\nfrom collectives import Work"),
        ("benchmarks/x.py", "import remote"),
    ]
    for where, source in ok:
        assert violations(ROOT / where, source + "\n") == [], (where, source)


# Rooms inside a package that may not import others (prefixes of module names). The process-group
# core of collectives never imports its backends or the launcher (it finds backends through the
# registry that collectives/__init__.py fills); backends never launch. The device-list context
# (collectives.distributed) stands on the backends' pieces (the in-order reduction, the NCCL
# binding) beside the process-group core, which never imports it. remote's client and server
# stand on the protocol between them and never import each other.
WINGS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    # (who, except these of its own, may not import)
    (
        "collectives",
        (
            "collectives.backends",
            "collectives.distributed",
            "collectives.launch",
            "collectives.run",
        ),
        (
            "collectives.backends",
            "collectives.distributed",
            "collectives.launch",
            "collectives.run",
        ),
    ),
    (
        "collectives.backends",
        (),
        ("collectives.distributed", "collectives.launch", "collectives.run"),
    ),
    ("collectives.distributed", (), ("collectives.launch", "collectives.run")),
    # remote: the protocol at the top (_wire, _conn, _tls, _errors...) serves both sides, and
    # the client and the server never import each other.
    (
        "remote",
        ("remote.client", "remote.server", "remote.__main__"),
        ("remote.client", "remote.server"),
    ),
    ("remote.client", (), ("remote.server",)),
    ("remote.server", (), ("remote.client",)),
]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def wing_violations(path: Path, source: str | None = None) -> list[str]:
    """The imports of ``path`` that cross a wall between rooms of one package (``WINGS``)."""
    module = _module_name(path)
    if path.name == "__init__.py" and module.count(".") == 0:
        return []  # a package's public face gathers its rooms
    text = path.read_text() if source is None else source
    bad: list[str] = []
    for who, exempt, forbidden in WINGS:
        if not _within(module, who) or any(_within(module, e) for e in exempt):
            continue
        for target in imported_modules(text, module, path.name == "__init__.py"):
            if any(_within(target, f) for f in forbidden):
                bad.append(f"{module} imports {target} (a {who} module may not import {forbidden})")
    return bad


def test_rooms_inside_a_package_import_only_downward() -> None:
    bad = [v for path in _sources(LIBRARIES) for v in wing_violations(path)]
    assert not bad, "a wall inside a package is crossed:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("collectives/_x.py", "from .backends.cpu._shm import Segment"),
        ("remote/client/_x.py", "from ..server._ops import OPS"),
        ("remote/server/_x.py", "from remote.client import _session"),
        ("remote/_x.py", "from .server import _worker"),
        ("collectives/_x.py", "def f():\n    from .launch._spawn import spawn"),
        ("collectives/_store/_x.py", "from ..backends import nccl"),
        ("collectives/backends/cpu/_x.py", "from ...launch._launcher import free_port"),
        ("collectives/backends/_x.py", "from collectives.run import main"),
        ("collectives/_x.py", "from .distributed import DistributedContext"),
        ("collectives/backends/nccl/_x.py", "from ...distributed._engines import Completion"),
    ],
)
def test_the_wing_check_catches_an_upward_import(where: str, line: str) -> None:
    assert wing_violations(ROOT / where, line + "\n"), (where, line)


def test_the_wing_check_allows_downward_imports() -> None:
    ok = [
        ("collectives/launch/_x.py", "from ..backends.cpu._shm import remove_run_segments"),
        ("collectives/backends/nccl/_x.py", "from ..._setup_wait import SetupWatch"),
        ("collectives/run.py", "from .launch._args import parse_args"),
        ("collectives/__init__.py", "from .launch._spawn import spawn"),
        ("remote/client/_x.py", "from .. import _wire\nfrom .._conn import Connection"),
        ("remote/__init__.py", "from .client import devices\nfrom .server import serve"),
        ("collectives/distributed/_x.py", "from ..backends._reduce import reduce_in_order"),
    ]
    for where, source in ok:
        assert wing_violations(ROOT / where, source + "\n") == [], (where, source)


def _oversized() -> list[str]:
    out = []
    for path in _sources(LIBRARIES):
        text = path.read_text()
        name = path.relative_to(ROOT)
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            out.append(f"{name} has {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    out.append(f"{name}:{node.lineno} {node.name}() spans {span} lines")
    return out


def test_no_library_module_or_function_is_oversized() -> None:
    big = _oversized()
    assert not big, "split these along their concepts:\n" + "\n".join(big)
