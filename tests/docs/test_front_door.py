"""README.md is the front door, not the manual (STYLE.md 29-31): short, with the commands,
the examples and links into docs/; no page speaks of the project's history as "this round"."""

from __future__ import annotations

import re

import pytest

from batchline.cli._main import USAGE

from .pages import pages
from tests.support.service import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_at_most_150_lines() -> None:
    assert len(README.splitlines()) <= 150


def test_the_readme_keeps_the_test_command_ci_runs() -> None:
    assert "bash scripts/test.sh" in README
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_every_readme_link_into_docs_leads_to_a_page() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", README)
    assert links
    for link in links:
        assert (REPO / link).is_file(), link


def test_the_readme_links_every_page_of_the_manual() -> None:
    """Each page of the site's navigation but the home page and the API reference (the
    Batch API and tracing pages were once left out)."""
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    listed = re.findall(r"^\s+- [^:]+: ([\w-]+\.md)$", nav, re.M)
    assert "batches.md" in listed
    linked = set(re.findall(r"\]\(docs/([^)#]+)(?:#[^)]*)?\)", README))
    assert sorted(set(listed) - {"index.md"} - linked) == []


def test_each_figure_of_the_readme_has_its_date_and_command() -> None:
    table = re.search(
        r"^\| what \| figure \| date \| command \|\n\|.*\n((?:\|.*\n)+)", README, re.M
    )
    assert table is not None
    for row in table.group(1).splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[2]), row
        assert cells[3].startswith("`python"), row


HISTORY = re.compile(
    r"this round|an? (?:earlier|later|previous) round|not run yet|not yet run|since this round",
    re.I,
)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_speaks_of_rounds(page: object) -> None:
    text = page.read_text(encoding="utf-8")  # type: ignore[attr-defined]
    assert not HISTORY.findall(text), HISTORY.findall(text)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_counts_the_suites_tests(page: object) -> None:
    """A count of the tests is stale with the next test added: a page says how to count."""
    text = " ".join(page.read_text(encoding="utf-8").split())  # type: ignore[attr-defined]
    assert not re.findall(r"\b\d[\d,]* tests\b", text), re.findall(r"\d[\d,]* tests", text)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_says_ctrl_c_exits_0(page: object) -> None:
    """Ctrl-C ends every command with status 130 (``batchline --help``); SIGTERM drains a
    worker with status 0. A sentence (or clause) of a page that names Ctrl-C says 130."""
    text = " ".join(page.read_text(encoding="utf-8").split())  # type: ignore[attr-defined]
    for clause in re.split(r"(?<=[.;])\s", text):
        if "Ctrl-C" in clause:
            assert not re.search(r"\bexits?(?: with (?:exit )?status)? 0\b", clause), clause


def test_scripts_readme_names_every_benchmark_and_check() -> None:
    """Each runnable module of benchmarks/ and checks/ (a module or a package with a
    ``__main__``), as ``benchmarks.NAME``; five were once left out."""
    text = (REPO / "scripts" / "README.md").read_text(encoding="utf-8")
    for package in ("benchmarks", "checks"):
        root = REPO / package
        names = {
            p.stem for p in root.glob("*.py") if not p.name.startswith("_") and p.stem != "harness"
        } | {p.parent.name for p in root.glob("*/__main__.py")}
        assert names
        missing = sorted(n for n in names if f"{package}.{n}`" not in text)
        assert missing == [], f"scripts/README.md does not name {package}: {missing}"


def test_the_demo_takes_as_long_in_the_readme_the_help_and_getting_started() -> None:
    """One figure for `batchline demo`'s duration (they once said ~1 min, about 1 minute and
    about 20 s; it takes about 30 s)."""
    guide = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    said = [
        re.search(r"^batchline demo +#.*\(~(\d+ s)\)$", README, re.M),
        re.search(r"a rising load \(about (\d+ s)\)", USAGE),
        re.search(r"^`batchline demo` \(about (\d+ s) ", guide, re.M),
    ]
    assert all(said), said
    assert {found.group(1) for found in said if found} == {"30 s"}, said
