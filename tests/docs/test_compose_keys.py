"""docker/compose.yaml's API takes API keys (``BATCHLINE_API_KEYS: "true"``): every curl to
it that a reader copies, from compose.yaml's own comments and from the blocks of README.md and
docs/ that start it, carries a key (an ``x-api-key`` or ``Authorization`` header), or the
reader's first request answers 401 (README's once had none)."""

from __future__ import annotations

import re

import pytest
import yaml

from .pages import pages, parse
from tests.support.service import REPO

COMPOSE = REPO / "docker" / "compose.yaml"
_KEY = re.compile(r"""-H\s*["'](?:x-api-key|authorization)\s*:""", re.I)
_TO_THE_API = re.compile(r"\bcurl\b.*\b(?:localhost|127\.0\.0\.1):")


def _curls(shell: str) -> list[str]:
    """The curl commands to a local port in a piece of shell, continued lines joined."""
    commands = re.sub(r"\s*\\\n\s*", " ", shell).splitlines()
    return [command for command in commands if _TO_THE_API.search(command)]


def _comment_curls() -> list[str]:
    """The curls of compose.yaml's comments (its header shows the commands)."""
    lines = COMPOSE.read_text(encoding="utf-8").splitlines()
    comments = [line.strip()[1:] for line in lines if line.strip().startswith("#")]
    return _curls("\n".join(comments))


def _page_curls() -> dict[str, list[str]]:
    """Per page, the curls of its shell blocks that start docker/compose.yaml."""
    found: dict[str, list[str]] = {}
    for page in pages():
        for example in parse(page):
            block = example.parsed
            if block.kind == "shell" and "-f docker/compose.yaml" in block.source:
                name = str(page.relative_to(REPO))
                found.setdefault(name, []).extend(_curls(block.source))
    return found


def test_every_curl_to_the_compose_api_carries_a_key() -> None:
    api = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]["api"]
    if api["environment"].get("BATCHLINE_API_KEYS") != "true":
        pytest.skip("compose.yaml's API takes no keys")
    curls = {"docker/compose.yaml's comments": _comment_curls(), **_page_curls()}
    assert curls["docker/compose.yaml's comments"], curls
    assert curls.get("README.md"), curls
    for where, commands in curls.items():
        for command in commands:
            assert _KEY.search(command), f"{where}: {command}"


def test_the_check_finds_a_curl_without_a_key() -> None:
    shell = 'curl -s localhost:8000/embed \\\n    -d \'{"text": "hello"}\'\n'
    assert _curls(shell) == ['curl -s localhost:8000/embed -d \'{"text": "hello"}\'']
    assert not _KEY.search(_curls(shell)[0])
    assert _KEY.search("""curl localhost:8000/embed -H "x-api-key: $KEY" -d x""")
