"""The documentation site as a reader's browser shows it: built with ``mkdocs build
--strict`` (no broken link, anchor or reference), served over HTTP, rendered by headless
Chromium (Debian's package ``chromium``); the DOM after its scripts ran has the navigation
and the content of the home page and of an API reference page."""

from __future__ import annotations

import functools
import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.service import REPO

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.slow,  # builds the site and renders it in headless Chromium
    pytest.mark.skipif(
        importlib.util.find_spec("mkdocs") is None,
        reason="mkdocs is not installed (the dev extra: pip install -e '.[dev]')",
    ),
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium to render the site with (apt-get install chromium; .ci/run "
        "installs it as root)",
    ),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site built strictly and served on a free loopback port: its base URL."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    handler = functools.partial(_QuietHandler, directory=str(out))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # the browser's requests are not the test's output


def rendered(url: str, profile: Path) -> str:
    """The page's DOM once Chromium has loaded it and run its scripts."""
    assert CHROMIUM is not None
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--window-size=1440,900",  # wide enough for the tabs and both sidebars
            "--virtual-time-budget=10000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "<html" in done.stdout, done.stderr[-3000:]
    return done.stdout


def text_of(dom: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))


def test_the_home_page_shows_its_navigation_and_content(site: str, tmp_path: Path) -> None:
    dom = rendered(site, tmp_path)
    text = text_of(dom)
    # The tabs across the top, one per section of the navigation.
    tabs = re.search(r'<nav class="md-tabs".*?</nav>', dom, re.S)
    assert tabs is not None, "no navigation tabs"
    for tab in ("Home", "Guide", "Guarantees", "Reference", "Contributing"):
        assert f" {tab} " in text_of(tabs.group(0)), tab
    assert "Dynamic batching for model inference in Python" in text
    assert "Getting started" in text
    # What the site's scripts add: a copy button on each code block, the search box.
    assert 'data-md-type="copy"' in dom, "no code copy buttons: the site's scripts did not run"
    assert 'class="md-search' in dom


def test_an_api_reference_page_shows_its_navigation_and_docstrings(
    site: str, tmp_path: Path
) -> None:
    dom = rendered(site + "reference/batchline.producer/", tmp_path)
    text = text_of(dom)
    active = re.findall(r'class="md-nav__link md-nav__link--active"[^>]*>(.*?)</a>', dom, re.S)
    assert any("batchline.producer" in text_of(a) for a in active), active
    assert re.search(r'<h\d id="batchline.producer.AsyncProducer"', dom), "no AsyncProducer"
    assert "Submit one request and return its output" in text  # AsyncProducer.infer's docstring
    assert "Enqueue one request; returns its handle at once" in text  # submit's
    # The rest of the API is a click away.
    for page in ("batchline.generation", "batchline.worker", "batchline.errors"):
        assert f'href="../{page}/"' in dom, page
