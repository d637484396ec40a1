"""The wire tests' own fixture: users made from the ACL lines docs/protocol.md quotes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from tests.support.protocol_doc import documented_lines


@pytest.fixture
def urls(acl_user: Callable[[list[str]], str], queue: str, rclient: redis.Redis) -> dict[str, str]:
    """A URL per role, logged in as a user made from the doc's line for that role, the
    doc's queue ``default`` replaced by the test's (Redis >= 7, else the test is skipped)."""
    version = str(rclient.info("server")["redis_version"])
    if int(version.split(".", maxsplit=1)[0]) < 7:
        pytest.skip(f"redis-server {version}: read-only key patterns and selectors need Redis 7")
    made = {}
    for role, words in documented_lines().items():
        assert words[3:5] == ["reset", "on"], words
        rules = [w.replace("{default}", "{" + queue + "}") for w in words[5:]]
        made[role] = acl_user(["on", ">PASSWORD", *rules])
    return made
