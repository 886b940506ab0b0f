"""Package boundaries from STYLE.md, enforced on the import graph (ast, no imports executed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "swarmtrain"
NETWORKING = {"grpc", "hivemind", "socket", "http", "urllib", "requests", "aiohttp", "asyncio"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules() -> list[tuple[str, set[str]]]:
    return [(p.relative_to(ROOT).as_posix(), _imports(p)) for p in sorted(ROOT.rglob("*.py"))]


def _top(name: str) -> str:
    return name.split(".")[0]


def test_pure_packages_import_no_networking() -> None:
    for rel, imports in _modules():
        if rel.startswith(("diloco/", "compress/")):
            bad = {i for i in imports if _top(i) in NETWORKING
                   or (i.startswith("swarmtrain.") and i.split(".")[1] in {"rpc", "discovery", "daemon", "sync",
                                                                            "averaging"})}
            assert not bad, f"{rel} imports networking code: {sorted(bad)}"


def test_grpc_only_in_rpc_and_wire() -> None:
    for rel, imports in _modules():
        if not rel.startswith(("rpc/", "wire/")):
            assert not {i for i in imports if _top(i) == "grpc"}, f"{rel} imports grpc outside rpc/"


def test_hivemind_only_in_discovery() -> None:
    for rel, imports in _modules():
        if not rel.startswith("discovery/"):
            assert not {i for i in imports if _top(i) == "hivemind"}, f"{rel} imports hivemind outside discovery/"


def test_library_never_imports_testing() -> None:
    for rel, imports in _modules():
        if not rel.startswith("testing/"):
            assert not {i for i in imports if i.startswith("swarmtrain.testing")}, f"{rel} imports swarmtrain.testing"


def test_test_modules_have_unique_names() -> None:
    """tests/ has no __init__.py, so pytest imports test modules by basename: two alike stop collection."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_round_package_is_pure() -> None:
    """The round state machine has no I/O, threads or clock of its own: it is driven and tested by hand."""
    impure = NETWORKING | {"time", "threading", "torch", "subprocess", "os"}
    for rel, imports in _modules():
        if rel.startswith("round/"):
            bad = {i for i in imports if _top(i) in impure
                   or (i.startswith("swarmtrain.") and not i.startswith("swarmtrain.round"))}
            assert not bad, f"{rel} imports {sorted(bad)}"


def test_trust_package_is_pure() -> None:
    """Run membership proofs take their times as arguments and touch no socket: every check is a unit test."""
    impure = NETWORKING | {"time", "threading", "torch", "subprocess"}
    for rel, imports in _modules():
        if rel.startswith("trust/"):
            bad = {i for i in imports if _top(i) in impure
                   or (i.startswith("swarmtrain.") and not i.startswith("swarmtrain.trust"))}
            assert not bad, f"{rel} imports {sorted(bad)}"
