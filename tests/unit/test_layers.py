"""The package layers (swarmtrain/testing/layers.py) hold over the whole code base, and the checker catches a
wrong import and a cycle in a tree made for it."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

from swarmtrain.testing.layers import LAYERS, cycles, import_edges, layer_of, violations

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "swarmtrain"


def test_every_import_points_to_a_lower_layer() -> None:
    found = [str(v) for v in violations(import_edges(ROOT))]
    assert not found, "\n".join(found)


def test_the_package_graph_has_no_cycle() -> None:
    assert cycles(import_edges(ROOT)) == []


def test_every_package_has_exactly_one_layer() -> None:
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py"}
    placed = [name for layer in LAYERS for name in layer]
    assert len(placed) == len(set(placed)), "a package is in two layers"
    assert packages <= set(placed), f"packages without a layer: {sorted(packages - set(placed))}"
    assert all(layer_of(name) is not None for name in packages)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "swarmtrain"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for d in {p.parent for p in root.rglob("*.py")}:
        (d / "__init__.py").touch()
    return root


LOW_HIGH = (("low",), ("mid",), ("high",))


def test_an_upward_import_is_caught_wherever_it_hides(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "low/a.py": "def f():\n    from swarmtrain.high import b\n",  # deferred, inside a function
        "mid/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from swarmtrain.high.b import X\n",
        "high/b.py": "from swarmtrain.low.a import f\nfrom ..mid import c\n",  # down: fine, relative included
    })
    found = violations(import_edges(root), LOW_HIGH)
    assert sorted(str(v) for v in found) == [
        "low/a.py:2 imports high (upward: low is in layer 0, high in layer 2)",
        "mid/c.py:3 imports high (upward: mid is in layer 1, high in layer 2)",
    ]
    assert {(e.source, e.target) for e in import_edges(root)} == {("low", "high"), ("mid", "high"),
                                                                  ("high", "low"), ("high", "mid")}


def test_a_cycle_and_a_same_layer_import_and_an_unplaced_package_are_caught(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "low/a.py": "from swarmtrain import mid\n",
        "mid/b.py": "import swarmtrain.low.a\nfrom swarmtrain.stray import x\n",
        "stray/x.py": "",
    })
    edges = import_edges(root)
    assert cycles(edges) == [["low", "mid"]]
    reasons = sorted(v.why for v in violations(edges, (("low", "mid"),)))
    assert reasons == ["low and mid are both in layer 0: neither imports the other",
                       "mid and low are both in layer 0: neither imports the other",
                       "package 'stray' has no layer in swarmtrain/testing/layers.py"]


def test_the_root_package_names_are_the_lowest_layer(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"low/a.py": "from swarmtrain import __version__\n", "__init__.py": ""})
    assert [(e.source, e.target) for e in import_edges(root)] == [("low", "swarmtrain")]


def _mentioned(doc: str, name: str) -> bool:
    """`name` (a module file or a subpackage) appears in a package map, by name or by a glob such as cmd_*.py."""
    tokens = set(re.findall(r"[\w*]+(?:\.py|/)", doc))
    return name in tokens or any("*" in t and fnmatch.fnmatch(name, t) for t in tokens)


def test_every_package_map_names_each_module_and_nothing_that_is_gone() -> None:
    """Each package's docstring is its map: every module and subpackage in it is named there, and every
    module it names exists (in the package, or at the path it gives)."""
    wrong = []
    for init in sorted(ROOT.rglob("__init__.py")):
        pkg = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        members = [p.name for p in pkg.glob("*.py") if p.name != "__init__.py"]
        members += [f"{p.name}/" for p in pkg.iterdir() if (p / "__init__.py").is_file()]
        wrong += [f"{pkg.relative_to(ROOT.parent)}: {m} is not in the map" for m in members if not _mentioned(doc, m)]
        for named in set(re.findall(r"(?<![\w/.*])(\w+\.py)\b", doc)):
            if not (pkg / named).exists():
                wrong.append(f"{pkg.relative_to(ROOT.parent)}: the map names {named}, which is not in the package")
        for path in set(re.findall(r"swarmtrain/([\w/]+\.py)", doc)):
            if not (ROOT / path).exists():
                wrong.append(f"{pkg.relative_to(ROOT.parent)}: the map names swarmtrain/{path}, which does not exist")
    assert not wrong, "\n".join(wrong)


def test_the_type_checker_fails_on_a_wrong_type_against_the_package(tmp_path: Path) -> None:
    """mypy with the project's configuration (what CI runs) rejects a call that passes the wrong type to the
    package, and accepts the right one."""
    api = pytest.importorskip("mypy.api")
    config = ROOT.parent / "pyproject.toml"
    good = tmp_path / "good.py"
    bad = tmp_path / "bad.py"
    call = 'from swarmtrain.round.group import Member\nm = Member(peer_id="a", endpoint="h:1", lag_s={})\n'
    good.write_text(call.format("0.5"), encoding="utf-8")
    bad.write_text(call.format('"late"'), encoding="utf-8")
    args = ["--config-file", str(config), "--follow-imports", "silent", "--no-error-summary"]
    out, _, status = api.run([*args, str(good)])
    assert status == 0, out
    out, _, status = api.run([*args, str(bad)])
    assert status == 1 and 'Argument "lag_s" to "Member" has incompatible type "str"' in out, out
