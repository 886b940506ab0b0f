"""The package layers of swarmtrain and a checker of them over the import graph (ast: nothing is imported).

A package (a directory under swarmtrain/, or a top-level module) may import only packages of a lower layer;
two packages of one layer import neither each other. Every import counts: module level, inside functions
(deferred) and under `if TYPE_CHECKING:`, since each is a dependency a reader has to follow. With every edge
pointing down, the package graph has no cycle; `cycles` finds any that a wrong table would let through.

The order, low to high (docs/architecture.md draws it):
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LAYERS", "Edge", "Violation", "cycles", "import_edges", "layer_of", "violations"]

LAYERS: tuple[tuple[str, ...], ...] = (
    # pure leaves: the package root, optional extras, process trees, generated wire code, run membership, the
    # round's state machine and group types, the config sections and the named model shapes
    ("swarmtrain", "extras", "proctree", "wire", "trust", "round", "config_sections", "config_presets"),
    ("config_model", "config_pipeline"),
    ("config",),
    ("data", "compress"),  # tokens and bytes
    ("models",),
    ("diloco",),  # the outer loop, pure torch, and the Averager protocol it averages through
    ("discovery", "rpc"),  # the DHT and gRPC: the only importers of hivemind and grpc
    ("sync",),  # state transfer and checkpoints
    ("averaging",),  # matchmaking, the all-reduce, the round's decision
    ("telemetry",),
    ("driver", "process"),  # the round driver; OS processes (signals, children)
    ("peer",),  # the services every role is composed from
    ("pipeline",),  # pipelined models: compute, routing, the stage server's rules
    ("roles",),  # the DiLoCo worker, the stage server, the trainer; a role as a process
    ("testbed", "dashboard"),  # the namespace testbed, the HTTP dashboard
    ("daemon",),  # the CLI
    ("__main__", "testing"),
)

__doc__ += "\n".join(f"    {i:2d}  {', '.join(layer)}" for i, layer in enumerate(LAYERS)) + "\n"


@dataclass(frozen=True)
class Edge:
    """One import of package `target` by a module of package `source`."""

    source: str
    target: str
    module: str  # the importing file, relative to the package root (e.g. "roles/worker.py")
    line: int


@dataclass(frozen=True)
class Violation:
    edge: Edge
    why: str

    def __str__(self) -> str:
        e = self.edge
        return f"{e.module}:{e.line} imports {e.target} ({self.why})"


def layer_of(package: str, layers: Sequence[Sequence[str]] = LAYERS) -> int | None:
    for i, layer in enumerate(layers):
        if package in layer:
            return i
    return None


def _package_of(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _targets(node: ast.AST, rel: Path, root: Path) -> list[str]:
    """swarmtrain packages an import statement names (relative imports resolved against `rel`)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            here = list(rel.with_suffix("").parts)
            base = here[: len(here) - node.level]  # level 1: the package the file is in (its own for __init__)
            dotted = ".".join(["swarmtrain", *base, *([node.module] if node.module else [])])
            names = [dotted] if node.module else [f"{dotted}.{a.name}" for a in node.names]
        elif node.module == "swarmtrain":
            names = [f"swarmtrain.{a.name}" for a in node.names]
        else:
            names = [node.module or ""]
    else:
        return []
    out = []
    for name in names:
        parts = name.split(".")
        if parts[0] != "swarmtrain":
            continue
        if len(parts) == 1:
            out.append("swarmtrain")
            continue
        sub = parts[1]
        is_module = (root / sub).is_dir() or (root / f"{sub}.py").is_file()
        out.append(sub if is_module else "swarmtrain")  # `from swarmtrain import __version__`: the root
    return out


def import_edges(root: Path) -> list[Edge]:
    """Every import of one swarmtrain package by another under `root` (the swarmtrain/ directory)."""
    edges = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        source = _package_of(rel)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            for target in _targets(node, rel, root):
                if target != source:
                    edges.append(Edge(source, target, rel.as_posix(), getattr(node, "lineno", 0)))
    return edges


def violations(edges: Iterable[Edge], layers: Sequence[Sequence[str]] = LAYERS) -> list[Violation]:
    """Edges that do not point to a strictly lower layer, and packages the table does not place."""
    out = []
    for e in edges:
        src, dst = layer_of(e.source, layers), layer_of(e.target, layers)
        if src is None or dst is None:
            missing = e.source if src is None else e.target
            out.append(Violation(e, f"package {missing!r} has no layer in swarmtrain/testing/layers.py"))
        elif dst == src:
            out.append(Violation(e, f"{e.source} and {e.target} are both in layer {src}: neither imports the other"))
        elif dst > src:
            out.append(Violation(e, f"upward: {e.source} is in layer {src}, {e.target} in layer {dst}"))
    return out


def cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """The package graph's strongly connected components of more than one package (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    return [sorted(c) for c in _components(graph) if len(c) > 1]


def _components(graph: Mapping[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:  # iterative: no recursion limit on a deep graph
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found
