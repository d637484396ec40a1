"""The package's layers, as docs/architecture.md draws them: core -> drivers ->
transport -> producer and worker. Each layer imports only itself, the layers before it, and
the shared ``errors`` and ``config`` modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "batchline"

ALLOWED = {
    "core": {"core", "errors"},
    "drivers": {"core", "drivers", "errors"},
    "transport": {"transport", "errors", "config"},
    "producer": {"producer", "transport", "errors", "config"},
    # and generation/, whose loop a --model generate worker drives
    "worker": {"worker", "transport", "drivers", "core", "errors", "config", "generation"},
}


def _imported_parts(path: Path) -> set[str]:
    """The first part under ``batchline`` of every batchline module ``path`` imports."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            split = name.split(".")
            if split[0] == "batchline" and len(split) > 1:
                parts.add(split[1])
    return parts


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_before_it(layer: str) -> None:
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"no modules under batchline/{layer}/"
    for path in files:
        stray = _imported_parts(path) - ALLOWED[layer]
        assert not stray, f"{path.relative_to(PACKAGE)} imports batchline.{sorted(stray)}"
