"""``batchline keys`` against a real redis-server: a key printed once (alone on stdout),
listed by id and never shown again, rotated, revoked; a tenant's config set."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest

from batchline.cli import main
from batchline.transport import KEY_PATTERN

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def keys_cli(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Run:
    """``run(*args) -> (status, stdout, stderr)``: ``batchline keys ...`` on a store of its
    own."""
    monkeypatch.setenv("BATCHLINE_REDIS_URL", redis_url)
    monkeypatch.setenv("BATCHLINE_PREFIX", f"c{uuid.uuid4().hex[:10]}")

    def run(*args: str) -> tuple[int, str, str]:
        status = main(["keys", *args])
        out, err = capsys.readouterr()
        return status, out, err

    return run


def test_create_list_rotate_revoke(keys_cli: Run) -> None:
    run = keys_cli
    status, out, err = run(
        "create", "--tenant", "acme", "--weight", "3", "--requests-per-min", "60"
    )
    assert status == 0, err
    key = out.strip()
    match = KEY_PATTERN.fullmatch(key)
    assert match is not None, out
    key_id = match.group(1)
    assert "shown once" in err
    assert key not in err

    status, out, _ = run("create", "--tenant", "ops", "--admin", "--json")
    admin = json.loads(out)
    assert (admin["tenant"], admin["admin"]) == ("ops", True)
    assert KEY_PATTERN.fullmatch(admin["key"])

    status, out, _ = run("list", "--json")
    listing = json.loads(out)
    assert {(k["id"], k["tenant"], k["admin"]) for k in listing["keys"]} == {
        (key_id, "acme", False),
        (admin["id"], "ops", True),
    }
    assert listing["tenants"]["acme"]["weight"] == 3.0
    assert listing["tenants"]["acme"]["requests_per_min"] == 60
    status, text, _ = run("list")
    for shown in (out, text):
        assert key not in shown
        assert admin["key"] not in shown
        assert key.split("-", 2)[2] not in shown  # the secret (base64url: it may hold "-")
    assert key_id in text

    status, out, _ = run("set", "--tenant", "acme", "--over-quota", "idle")
    assert json.loads(out)["config"]["over_quota"] == "idle"
    assert json.loads(out)["config"]["weight"] == 3.0  # the rest kept

    status, out, _ = run("rotate", key_id, "--grace-s", "600", "--json")
    rotated = json.loads(out)
    assert rotated["tenant"] == "acme"
    assert rotated["id"] != key_id
    status, out, _ = run("list", "--json")
    old = next(k for k in json.loads(out)["keys"] if k["id"] == key_id)
    assert old["expires"] is not None  # still valid, for 600 s

    status, out, err = run("revoke", key_id)
    assert status == 0, err
    assert key_id in out
    status, out, err = run("revoke", key_id)
    assert status == 2
    assert f"no key with the id '{key_id}'" in err
    assert len(err.strip().splitlines()) == 1


def test_list_of_an_empty_store_says_how_to_make_a_key(keys_cli: Run) -> None:
    run = keys_cli
    status, out, _ = run("list")
    assert status == 0
    assert "batchline keys create --tenant NAME" in out


def test_a_rotated_key_is_shown_even_if_redis_fails_right_after(
    keys_cli: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rotation revokes the old key (no --grace-s): the new key, the only way in now, is
    printed before any further call to Redis, which may fail."""
    from batchline.transport import TenantStore

    run = keys_cli
    status, out, err = run("create", "--tenant", "acme", "--weight", "2", "--json")
    old = json.loads(out)
    rotate, table = TenantStore.rotate, TenantStore.table
    rotated: list[str] = []

    async def rotate_then_fail(store: TenantStore, key_id: str, **kw: float) -> object:
        made = await rotate(store, key_id, **kw)
        rotated.append(key_id)  # from now on, Redis "fails"
        return made

    async def failing_table(store: TenantStore) -> object:
        if rotated:
            raise ConnectionError("Redis went away")
        return await table(store)

    monkeypatch.setattr(TenantStore, "rotate", rotate_then_fail)
    monkeypatch.setattr(TenantStore, "table", failing_table)
    status, out, err = run("rotate", old["id"], "--json")
    assert (status, rotated) == (0, [old["id"]]), err
    new = json.loads(out)
    assert (new["tenant"], new["config"]["weight"]) == ("acme", 2.0)
    monkeypatch.setattr(TenantStore, "table", table)
    status, out, _ = run("list", "--json")
    assert [k["id"] for k in json.loads(out)["keys"]] == [new["id"]]  # the one shown
    match = KEY_PATTERN.fullmatch(new["key"])
    assert match is not None
    assert match.group(1) == new["id"]
