"""Signposts that a test keeps true: every module of the package is named in
docs/architecture.md, in the row of its own folder, and every ``:mod:``, ``:func:``,
``:class:``, ``:meth:``, ``:data:``, ``:attr:`` and ``:exc:`` reference in a docstring
names something that exists (the site's strict build sees only the public pages' ones)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "batchline"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
REFERENCE = re.compile(r":(mod|func|class|meth|data|attr|exc):`([^`]+)`")


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rows() -> list[list[str]]:
    """The cells of every row of the page's tables, each as the names in backticks."""
    rows = []
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            cells = line.strip().strip("|").split(" | ")
            rows.append([" ".join(re.findall(r"`([^`]+)`", cell)) for cell in cells])
    return rows


def _named(rows: list[list[str]], path: Path) -> bool:
    """Whether a row's first cell names ``path``, or the row of its folder (whose first
    cell names the folder) does."""
    rel = path.relative_to(ROOT).as_posix()
    folder = rel.rpartition("/")[0] + "/"
    for cells in rows:
        first = cells[0].split()
        if rel in first or any("/" in t and rel.endswith("/" + t) for t in first):
            return True  # a row of its own
        if folder == "batchline/":  # a top-level module: named in a first cell
            if path.name in first:
                return True
            continue
        if not any(t.endswith("/") and ("/" + folder).endswith("/" + t) for t in first):
            continue
        if path.name == "__init__.py":
            return True
        if any(t == path.name or rel.endswith("/" + t) for t in " ".join(cells).split()):
            return True
    return False


def test_every_module_is_named_in_the_architecture_page() -> None:
    rows = _rows()
    missing = [p.relative_to(ROOT).as_posix() for p in _files() if not _named(rows, p)]
    assert missing == [], f"docs/architecture.md names no row for: {missing}"


def test_the_page_check_finds_an_unnamed_module() -> None:
    rows = [["batchline/worker/serving/", "_reader.py (the reader)"]]
    assert _named(rows, PACKAGE / "worker/serving/_reader.py")
    assert not _named(rows, PACKAGE / "worker/serving/_writer.py")
    assert not _named(rows, PACKAGE / "worker/_reader.py")


def _modules() -> Iterator[tuple[str, Path]]:
    for path in _files():
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts[-1] != "__main__":  # importing it runs the command
            yield ".".join(parts), path


def _docstrings(tree: ast.Module) -> Iterator[tuple[str, str | None, int]]:
    """(docstring, the class it stands in or None, line) of a module, its classes and
    functions."""
    doc = ast.get_docstring(tree)
    if doc:
        yield doc, None, 1

    def visit(node: ast.AST, cls: str | None) -> Iterator[tuple[str, str | None, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = child.name if isinstance(child, ast.ClassDef) else cls
                doc = ast.get_docstring(child)
                if doc:
                    yield doc, inner, child.lineno
                yield from visit(child, inner)

    yield from visit(tree, None)


def _has(obj: Any, name: str) -> tuple[bool, Any]:
    """Whether ``obj`` has ``name``: an attribute, or for a class also a field declared
    without a default or an attribute its methods set (``self.name =``)."""
    if hasattr(obj, name):
        return True, getattr(obj, name)
    if isinstance(obj, type):
        if any(name in getattr(k, "__annotations__", {}) for k in obj.__mro__):
            return True, None
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            return False, None
        if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=]*)?=", source):
            return True, None
    return False, None


def _chain(obj: Any, names: list[str]) -> bool:
    for i, name in enumerate(names):
        found, obj = _has(obj, name)
        if not found or (obj is None and i < len(names) - 1):
            return False
    return True


def _resolves(role: str, target: str, module: ModuleType, cls: str | None) -> bool:
    explicit = re.fullmatch(r"(?s).*<(.+)>", target)  # `title <target>`
    target = (explicit.group(1) if explicit else target).lstrip("~").removesuffix("()")
    if target.startswith("."):  # relative to the module's package, as an import is
        dots = len(target) - len(target.lstrip("."))
        package = module.__name__ if hasattr(module, "__path__") else module.__package__ or ""
        base = package.split(".")[: len(package.split(".")) - (dots - 1)]
        target = ".".join([*base, target.lstrip(".")])
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return i == len(parts) if role == "mod" else _chain(found, parts[i:])
    if role == "mod":
        return False
    return _chain(module, parts) or (cls is not None and _chain(getattr(module, cls), parts))


MODULES = dict(_modules())


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_docstring_reference_resolves(name: str) -> None:
    module, path = importlib.import_module(name), MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    stale = [
        f"line {line} :{role}:`{target}`"
        for doc, cls, line in _docstrings(tree)
        for role, target in REFERENCE.findall(doc)
        if not _resolves(role, target, module, cls)
    ]
    assert stale == [], f"{name}: references to nothing: {stale}"


def test_the_reference_check_finds_a_stale_name() -> None:
    transport = importlib.import_module("batchline.transport._redis")
    assert _resolves("func", "connect", transport, None)
    assert _resolves("mod", "._errors", transport, None)
    assert _resolves("meth", "Backoff.retry", transport, None)
    assert not _resolves("func", "connect_to", transport, None)
    assert not _resolves("mod", "._nowhere", transport, None)
    assert not _resolves("meth", "Backoff.rerty", transport, None)
