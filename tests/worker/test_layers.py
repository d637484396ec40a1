"""The worker's own layers: its CPU threading and its metrics at the bottom, its models,
then what the serving path and the upkeep both use (``worker/shared/``), then those two side by side, neither importing the
other, then the runner (the ``Worker``, its assembly and its process) above them all.

Every import counts, as in tests/test_layers.py (whose graph this reads)."""

from __future__ import annotations

import pytest

from tests.test_layers import MODULES, _cycles, _graph

#: The runner: the Worker, the assembly of its parts, its process and what it prints.
RUNNER = {"__init__", "_worker", "_assembly", "_supervisor", "_ready"}

# Each row: the parts of batchline.worker that a part may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "_cpu_threads": set(),
    "metrics": set(),
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


def _worker_graph() -> dict[str, set[str]]:
    graph = _graph()
    return {m: {i for i in graph[m] if i in WORKER} for m in WORKER}


def test_every_module_of_the_worker_has_a_row() -> None:
    rows = {_row(m) for m in WORKER}
    assert rows == set(ALLOWED), (
        f"modules without a row: {sorted(rows - set(ALLOWED))}; "
        f"rows without a module: {sorted(set(ALLOWED) - rows)}"
    )


@pytest.mark.parametrize("row", sorted(ALLOWED))
def test_a_part_of_the_worker_imports_only_the_parts_below_it(row: str) -> None:
    graph = _worker_graph()
    for module in (m for m in WORKER if _row(m) == row):
        stray = {_row(m) for m in graph[module]} - ALLOWED[row] - {row}
        assert not stray, f"{module} imports the worker's {sorted(stray)}"


def test_serving_and_upkeep_meet_only_below_them() -> None:
    # The layer holds something real: both sides use it, and neither reaches the other.
    graph = _worker_graph()
    uses = {
        row: {_row(i) for m in WORKER if _row(m) == row for i in graph[m]}
        for row in ("serving", "upkeep")
    }
    assert "shared" in uses["serving"]
    assert "shared" in uses["upkeep"]
    assert "upkeep" not in uses["serving"]
    assert "serving" not in uses["upkeep"]


def test_no_import_circle_between_the_parts_of_the_worker() -> None:
    parts: dict[str, set[str]] = {}
    for module, imported in _worker_graph().items():
        parts.setdefault(_row(module), set()).update(
            _row(m) for m in imported if _row(m) != _row(module)
        )
    assert _cycles(parts) == []
