"""The worker's own layers: its CPU threading and its metrics (with the choice of their
tenant labels) at the bottom, its models,
then what the serving path and the upkeep both use (``worker/shared/``), then those two side
by side, neither importing the other, then the runner (the ``Worker``, its assembly and its
process) above them all.

Every import counts, as in tests/test_layers.py (whose graph this reads)."""

from __future__ import annotations

import pytest

from tests.test_layers import MODULES, _cycles, _graph

#: The runner: the Worker, the assembly of its parts, its process and what it prints.
RUNNER = {"__init__", "_worker", "_group", "_assembly", "_supervisor", "_ready"}

# Each row: the parts of batchline.worker that a part may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "_cpu_threads": set(),
    "_tenant_labels": set(),
    "metrics": {"_tenant_labels"},
    "models": {"_cpu_threads"},
    "shared": {"models"},
    "serving": {"models", "metrics", "shared"},
    "upkeep": {"models", "metrics", "shared"},
    "runner": {"_cpu_threads", "metrics", "models", "serving", "shared", "upkeep"},
}


def _row(module: str) -> str:
    """The row of a module of batchline.worker (``batchline.worker.serving._reader``:
    ``serving``)."""
    name = module.split(".")[2] if module.count(".") >= 2 else "__init__"
    return "runner" if name in RUNNER else name


WORKER = sorted(m for m in MODULES if m == "batchline.worker" or m.startswith("batchline.worker."))


def _parts() -> dict[str, dict[str, set[str]]]:
    """Per row, per row it imports, the modules that import it (within the worker)."""
    graph = _graph()
    parts: dict[str, dict[str, set[str]]] = {}
    for module in WORKER:
        row = parts.setdefault(_row(module), {})
        for imported in graph[module] & set(WORKER):
            if _row(imported) != _row(module):
                row.setdefault(_row(imported), set()).add(module)
    return parts


def test_every_module_of_the_worker_has_a_row() -> None:
    assert set(_parts()) == set(ALLOWED)


@pytest.mark.parametrize("row", sorted(ALLOWED))
def test_a_part_of_the_worker_imports_only_the_parts_below_it(row: str) -> None:
    stray = {
        part: sorted(by) for part, by in _parts().get(row, {}).items() if part not in ALLOWED[row]
    }
    assert not stray, f"{row} imports what it may not (part: its importers): {stray}"


def test_serving_and_upkeep_meet_only_below_them() -> None:
    # The layer holds something real: both sides use it, and neither reaches the other.
    parts = _parts()
    assert "shared" in parts["serving"]
    assert "shared" in parts["upkeep"]
    assert "upkeep" not in parts["serving"]
    assert "serving" not in parts["upkeep"]


def test_no_import_circle_between_the_parts_of_the_worker() -> None:
    assert _cycles({row: set(imported) for row, imported in _parts().items()}) == []
