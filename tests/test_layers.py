"""The package's layers, as docs/architecture.md draws them, and no import circle.

Every part of ``batchline`` (a subpackage or a top-level module) has a row below: the parts
it may import. Every import counts, wherever it stands (a function's lazy import and an
``if TYPE_CHECKING:`` one included), relative ones resolved. Then the whole graph of modules,
and the graph of parts, must have no cycle."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "batchline"

# The wire format (no I/O) -> settings -> the Redis transport -> producer and worker -> what
# is built on them. core/ (pure) -> drivers/ (in process) and generation/ beside them.
WIRE = {"errors", "_json_depth", "keys", "codec", "tenants"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_json_depth": {"errors"},
    "core": {"errors"},
    "drivers": {"core", "errors"},
    "aio": {"drivers"},
    "inference": {"drivers"},
    "__init__": {"aio", "core", "drivers", "errors", "inference"},
    "devices": set(),
    "deterministic": set(),
    "_llguidance": {"errors"},
    "_response_format": {"_json_depth", "_llguidance", "errors"},
    "_tools": {"_llguidance", "_response_format", "errors"},
    "_tool_calls": {"_tools"},
    "generation": {
        "_llguidance",
        "_response_format",
        "_tool_calls",
        "_tools",
        "core",
        "deterministic",
        "devices",
        "errors",
    },
    "keys": set(),
    "tenants": set(),
    "codec": {"_json_depth", "errors", "keys", "tenants"},
    "acl": {"keys", "tenants"},
    "redis_url": set(),
    "_specs": set(),
    "_heap": set(),
    "config": WIRE | {"_specs", "devices", "drivers", "redis_url"},
    "transport": WIRE | {"config", "redis_url"},
    "tracing": set(),
    "logs": set(),
    "producer": WIRE | {"config", "redis_url", "tracing", "transport"},
    "worker": WIRE
    | {
        "_heap",
        "_tool_calls",
        "config",
        "core",
        "deterministic",
        "devices",
        "drivers",
        "generation",
        "redis_url",
        "tracing",
        "transport",
    },
    "contrib": WIRE
    | {"_heap", "_response_format", "_tool_calls", "_tools", "config", "producer", "transport"},
    "demo": WIRE | {"config", "devices", "drivers", "producer", "transport", "worker"},
    "cli": WIRE | {"acl", "config", "demo", "logs", "transport", "worker"},
    "__main__": {"cli"},
}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """The batchline modules ``name`` imports: ``from m import x`` counts as ``m.x`` where
    that is a module, else as ``m``; relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                yield sub if sub in MODULES else module


def _graph() -> dict[str, set[str]]:
    return {
        name: {m for m in _imports(name, path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_part_has_a_row() -> None:
    parts = {_part(m) for m in MODULES}
    assert parts == set(ALLOWED), (
        f"parts without a row: {sorted(parts - set(ALLOWED))}; "
        f"rows without a part: {sorted(set(ALLOWED) - parts)}"
    )


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_a_part_imports_only_the_parts_below_it(part: str) -> None:
    graph = _graph()
    for module in sorted(m for m in MODULES if _part(m) == part):
        stray = {_part(m) for m in graph[module]} - ALLOWED[part] - {part}
        assert not stray, f"{module} imports batchline.{sorted(stray)}"


def test_no_import_circle_between_modules() -> None:
    assert _cycles(_graph()) == []


def test_no_import_circle_between_parts() -> None:
    parts: dict[str, set[str]] = {}
    for module, imported in _graph().items():
        parts.setdefault(_part(module), set()).update(
            _part(m) for m in imported if _part(m) != _part(module)
        )
    assert _cycles(parts) == []


def test_the_cycle_check_finds_a_circle() -> None:
    # The check itself, on a graph with one: a -> b -> c -> a, and d alone.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_wire_modules_do_no_redis_io() -> None:
    for module in sorted(m for m in MODULES if _part(m) in ("keys", "codec", "acl")):
        assert not any(m.startswith("redis") for m in _imports(module, MODULES[module])), module


@pytest.mark.parametrize("part", ["transport", "producer"])
def test_other_parts_reach_a_part_through_its_face(part: str) -> None:
    # batchline.transport exports what the producer, the worker, contrib and the CLI use
    # (only its public submodule, status, may be named besides); batchline.producer what
    # users and contrib use: what contrib shares with the producer below that (Redis
    # failures as typed errors, a cache hit's result, the timeout that names a queue) lives
    # in the transport.
    graph = _graph()
    private = {
        (module, m)
        for module, imported in graph.items()
        if _part(module) != part
        for m in imported
        if m.startswith(f"batchline.{part}._")
    }
    assert private == set(), f"imports of the {part}'s private modules: {sorted(private)}"


#: Where docs/architecture.md says its two branches (in process; over Redis) meet: each part
#: that imports across them, and what it imports there.
MEETINGS = {
    "config": {"drivers", "devices", "_specs"},
    "worker": {"core", "drivers", "generation"},
    "cli": {"demo"},
}


def test_the_page_names_where_the_branches_meet() -> None:
    """The page's layers paragraph says what the table allows across its floors: each part
    of ``MEETINGS`` has a clause of its own naming what it imports there."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    paragraph = " ".join(page[page.index("The tree reads in layers") :].split("\n\n")[0].split())
    clauses = [c.strip() for c in re.split(r"[.;:] ", paragraph)]
    for part, uses in MEETINGS.items():
        assert uses <= ALLOWED[part], (part, sorted(uses - ALLOWED[part]))
        clause = next((c for c in clauses if c.startswith(f"`{part}/`")), "")
        for used in sorted(uses):
            assert re.search(rf"(?<!\w){used}(?!\w)", clause), (part, used, clause)


def test_the_core_does_no_io() -> None:
    """The page's promise: no Redis, no sockets or files, no asyncio, no thread of its own."""
    banned = ("asyncio", "io", "os", "pathlib", "redis", "socket", "subprocess")
    for module in sorted(m for m in MODULES if _part(m) == "core"):
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in banned for n in names), (module, names)
            used = getattr(node, "attr", None) or getattr(node, "id", None)
            assert used not in ("Thread", "open"), (module, ast.unparse(node))
