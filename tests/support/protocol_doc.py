"""docs/protocol.md as the wire tests read it: its fenced blocks, and the ACL lines it quotes
(``batchline acl``'s, which tests/wire/conftest.py makes users of)."""

from __future__ import annotations

import re
import shlex
from typing import Any

import redis

from batchline.acl import ROLES

from .service import REPO

DOC = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")


def doc_block(language: str, after: str) -> str:
    """The first fenced block of ``language`` in docs/protocol.md after the text ``after``."""
    found = re.search(re.escape(after) + r".*?```" + language + r"\n(.*?)```", DOC, flags=re.DOTALL)
    assert found is not None, f"no {language} block after {after!r} in docs/protocol.md"
    return found.group(1)


def documented_lines() -> dict[str, list[str]]:
    """The doc's ``ACL SETUSER batchline-<role> ...`` lines, split as a shell would."""
    block = doc_block("acl", "exactly as `batchline acl` prints them")
    lines = {shlex.split(line)[2]: shlex.split(line) for line in block.splitlines()}
    assert set(lines) == {f"batchline-{role}" for role in ROLES}, block
    return {role: lines[f"batchline-{role}"] for role in ROLES}


def acl_denials(client: redis.Redis, *urls: str) -> list[Any]:
    """The ``ACL LOG`` entries of the users these URLs log in as."""
    users = {url.split("//")[1].split(":", maxsplit=1)[0] for url in urls}
    return [e for e in client.acl_log() if e.get("username") in users]
