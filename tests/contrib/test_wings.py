"""contrib/'s rooms, as docs/architecture.md draws them: one face (``fastapi.py``), batchline's
own routes (``_routes.py``), a wing per API (``openai/``, ``hf/``, ``batches/``,
``anthropic/``) and the plumbing they share (``_plumbing/``), on the import graph of
tests/test_layers.py.

A room is a top-level entry of contrib/ (a module, or a folder with everything in it). Each
has a row: the rooms it may import. The wings may use the OpenAI wing (its routes, errors and
bodies: Hugging Face's and Anthropic's routes run on its queues, the Batch API runs each line
through it) and the plumbing, never each other otherwise; nothing in a wing or the plumbing
imports the face or the own routes; the plumbing imports no wing. A room is entered through
its face (its ``__init__``), never through one of its private modules. At most 8 rooms, on
at most 4 floors (the rooms on the longest chain of imports between them)."""

from __future__ import annotations

from functools import cache

import pytest

from tests.test_layers import MODULES, PACKAGE, _cycles, _graph

CONTRIB = "batchline.contrib"
MAX_ROOMS = 8
MAX_FLOORS = 4

ROWS: dict[str, set[str]] = {
    "__init__": set(),
    "_plumbing": set(),
    "openai": {"_plumbing"},
    "hf": {"_plumbing", "openai"},
    "batches": {"_plumbing", "openai"},
    "anthropic": {"_plumbing", "openai"},
    "_routes": {"_plumbing"},
    "fastapi": {"_plumbing", "_routes", "openai", "hf", "batches", "anthropic"},
}


def _room(module: str) -> str:
    """The room of a module of contrib (the package's own ``__init__`` is one)."""
    rest = module.removeprefix(CONTRIB).lstrip(".")
    return rest.split(".")[0] if rest else "__init__"


def _contrib() -> dict[str, set[str]]:
    """contrib's modules and the modules of contrib each imports."""
    graph = _graph()
    inside = [m for m in MODULES if m == CONTRIB or m.startswith(CONTRIB + ".")]
    return {m: {i for i in graph[m] if i in inside} for m in inside}


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The rooms each room imports (itself left out)."""
    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        rooms.setdefault(_room(module), set()).update(_room(m) for m in imported)
    return {room: others - {room} for room, others in rooms.items()}


def _floors(rooms: dict[str, set[str]]) -> int:
    """The most rooms on one chain of imports (the graph has no circle)."""

    @cache
    def height(room: str) -> int:
        return 1 + max((height(r) for r in rooms.get(room, ())), default=0)

    return max((height(r) for r in rooms), default=0)


def test_every_room_has_a_row() -> None:
    entries = {
        p.stem if p.suffix == ".py" else p.name
        for p in (PACKAGE / "contrib").iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert entries == set(ROWS), (
        f"rooms without a row: {sorted(entries - set(ROWS))}; "
        f"rows without a room: {sorted(set(ROWS) - entries)}"
    )
    assert len(entries) <= MAX_ROOMS


@pytest.mark.parametrize("room", sorted(ROWS))
def test_a_room_imports_only_the_rooms_of_its_row(room: str) -> None:
    for module, imported in sorted(_contrib().items()):
        if _room(module) == room:
            stray = {_room(m) for m in imported} - ROWS[room] - {room}
            assert not stray, f"{module} imports contrib's {sorted(stray)}"


def test_a_room_is_entered_through_its_face() -> None:
    for module, imported in sorted(_contrib().items()):
        for other in sorted(imported):
            room = _room(other)
            if room != _room(module):
                assert other == f"{CONTRIB}.{room}", f"{module} imports {other}, not its face"


def test_no_circle_and_at_most_four_floors() -> None:
    rooms = _rooms(_contrib())
    assert _cycles(rooms) == []
    assert _cycles(_contrib()) == []
    assert _floors(rooms) <= MAX_FLOORS, rooms


def test_the_floors_count_the_rooms_on_the_longest_chain() -> None:
    # The count itself: face -> wing -> wing -> plumbing is 4, beside a chain of 2.
    rooms = {"face": {"hf", "own"}, "hf": {"openai"}, "openai": {"plumbing"}, "own": {"plumbing"}}
    assert _floors(rooms) == 4
    assert _floors({"a": set()}) == 1
