"""The API's key check (batchline.contrib._plumbing._auth) over real uvicorn and Redis: the
static key and the tenant store's keys, the three headers, the 401 in each route family's
shape, the caller each key names, a revoke on two replicas, a burst of wrong keys, and no
key in any log line."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from fastapi import FastAPI, Request
from pydantic import SecretStr
from starlette.testclient import TestClient

from batchline.config import WebSettings
from batchline.contrib._plumbing import KeyTable
from batchline.contrib._plumbing._auth import uvicorn_host
from batchline.contrib._plumbing._caller import caller_of
from batchline.contrib.fastapi import create_app
from batchline.keys import TenantKeys
from batchline.transport import KeyRecord, TenantStore, TenantTable, connect, key_hash

from .openai.test_openai import assert_error, client_for
from .test_fastapi import MODEL, Serve, serve
from tests.support.service import WorkerThread, wait_until

openai = pytest.importorskip("openai")

__all__ = ["serve"]  # a fixture, used here

STATIC = "static-key-" + uuid.uuid4().hex
OPENAI_401 = {"type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


@pytest.fixture
def prefix() -> str:
    """A namespace of its own: this test's tenant store and queue keys."""
    return f"k{uuid.uuid4().hex[:10]}"


MakeApp = Callable[..., FastAPI]


@pytest.fixture
def make_app(redis_url: str, queue: str, prefix: str) -> MakeApp:
    """``make_app(**settings)``: the app for this test's queue and store, with a route
    ``/whoami`` answering the caller its key names."""

    def make(**settings: Any) -> FastAPI:
        settings.setdefault("embedding_queue", queue)
        app = create_app(
            WebSettings(redis_url=SecretStr(redis_url), queue=queue, prefix=prefix, **settings),
            timeout_s=30,
        )

        async def whoami(request: Request) -> dict[str, Any]:
            caller = caller_of(request)
            return {"tenant": caller.tenant, "admin": caller.admin, "key_id": caller.key_id}

        app.add_api_route("/whoami", whoami, methods=["GET"])
        return app

    return make


class Keys:
    """The test's tenant store, from the test's thread."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.settings = WebSettings(redis_url=SecretStr(redis_url), prefix=prefix)
        self.keys = TenantKeys(prefix)

    def _run(self, call: Callable[[TenantStore], Any]) -> Any:
        async def run() -> Any:
            client = connect(self.settings)
            try:
                return await call(TenantStore(client, self.keys))
            finally:
                await client.aclose()

        return asyncio.run(run())

    def create(self, tenant: str, **options: Any) -> tuple[str, KeyRecord]:
        key, record, _ = self._run(lambda store: store.create(tenant, **options))
        return key, record

    def revoke(self, key_id: str) -> int:
        """Revoke; the store's version after it."""
        self._run(lambda store: store.revoke(key_id))
        return int(self._run(lambda store: store.table()).version)

    def version(self) -> int:
        return int(self._run(lambda store: store.table()).version)

    def rotate(self, key_id: str, grace_s: float) -> tuple[str, KeyRecord]:
        key, record = self._run(lambda store: store.rotate(key_id, grace_s=grace_s))
        return key, record


@pytest.fixture
def store(redis_url: str, prefix: str) -> Keys:
    return Keys(redis_url, prefix)


def table_of(app: FastAPI) -> KeyTable:
    table = app.state.keys
    assert isinstance(table, KeyTable)
    return table


def holds(app: FastAPI, version: int) -> None:
    """Wait until the app's key table holds the store's ``version``: the refresh checks
    every 0.5 s, so a change holds within a second; the bound here is looser, as this
    machine's timing is shared."""
    wait_until(
        lambda: table_of(app).version >= version, f"key table version {version}", timeout_s=10
    )


# -- the static key --------------------------------------------------------------------------


def test_the_static_key_in_each_header_and_none_or_a_wrong_one_is_401(
    make_app: MakeApp, serve: Serve
) -> None:
    app = make_app(api_key=SecretStr(STATIC))
    http = serve(app)
    assert table_of(app).client is None  # a static key reads no store
    for headers in (
        {"Authorization": f"Bearer {STATIC}"},
        {"authorization": f"bearer {STATIC}"},
        {"x-api-key": STATIC},
        {"api-key": STATIC},
    ):
        response = http.get("/whoami", headers=headers)
        assert response.status_code == 200, (headers, response.text)
        assert response.json() == {"tenant": "default", "admin": True, "key_id": None}
        assert http.get("/v1/models", headers=headers).status_code == 200

    for headers in ({}, {"Authorization": f"Basic {STATIC}"}, {"Authorization": "Bearer"}):
        response = http.get("/v1/models", headers=headers)
        error = assert_error(response, 401, **OPENAI_401)
        assert "didn't provide an API key" in error["message"]
        assert response.headers["www-authenticate"] == "Bearer"
    for wrong in (STATIC + "x", STATIC[:-1], "bl-00000000-" + "A" * 43):
        response = http.get("/v1/models", headers={"Authorization": f"Bearer {wrong}"})
        error = assert_error(response, 401, **OPENAI_401)
        assert error["message"] == "Incorrect API key provided."


def test_every_route_family_takes_a_key_in_its_own_shape_and_health_stays_open(
    make_app: MakeApp, serve: Serve
) -> None:
    http = serve(make_app(api_key=SecretStr(STATIC)))
    wrong = {"x-api-key": "nope-" + uuid.uuid4().hex}
    openai_routes = [
        ("POST", "/v1/embeddings", {"model": "m", "input": "x"}),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": []}),
        ("GET", "/v1/files", None),
        ("GET", "/v1/batches", None),
        ("POST", "/v1/rerank", {"query": "q", "documents": ["d"]}),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/rerank", {"query": "q", "texts": ["d"]}),  # (its errors: OpenAI's shape)
    ]
    for method, path, body in openai_routes:
        response = http.request(method, path, json=body, headers=wrong)
        assert_error(response, 401, **OPENAI_401)
    native_routes = [
        ("POST", "/embed", {"text": "x"}),
        ("POST", "/jobs", {"text": "x"}),
        ("GET", f"/jobs/{uuid.uuid4().hex}", None),
        ("POST", "/generate", {"inputs": "x"}),
        ("POST", "/generate_stream", {"inputs": "x"}),
        ("POST", "/", {"inputs": "x"}),
    ]
    for method, path, body in native_routes:
        response = http.request(method, path, json=body, headers=wrong)
        assert response.status_code == 401, (path, response.text)
        assert response.json() == {
            "detail": "Incorrect API key provided.",
            "error": "Incorrect API key provided.",
            "error_type": "authentication",
        }
        assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/healthz", "/docs", "/openapi.json", "/v1/openapi.json"):
        assert http.get(path).status_code == 200, path


def test_an_open_api_checks_nothing(make_app: MakeApp, serve: Serve) -> None:
    http = serve(make_app())
    response = http.get("/whoami", headers={"x-api-key": "anything"})
    assert response.json() == {"tenant": None, "admin": True, "key_id": None}


def test_a_short_static_key_is_refused_without_showing_it() -> None:
    with pytest.raises(ValueError, match="at least 16") as caught:
        WebSettings(api_key=SecretStr("hunter2"))
    assert "hunter2" not in str(caught.value)


# -- the tenant store's keys -----------------------------------------------------------------


@pytest.mark.slow
def test_two_tenants_keys_with_the_official_client(
    make_app: MakeApp,
    serve: Serve,
    store: Keys,
    start_worker: Callable[..., WorkerThread],
    queue: str,
    prefix: str,
) -> None:
    start_worker(MODEL, prefix=prefix)
    key_a, record_a = store.create("acme", config={"weight": 2.0})
    key_b, record_b = store.create("globex", admin=True)
    app = make_app(api_keys=True)
    http = serve(app)
    for key, record in ((key_a, record_a), (key_b, record_b)):
        client = client_for(http).with_options(api_key=key)
        answer = client.embeddings.create(model=queue, input=["one", "two"])
        assert len(answer.data) == 2
        who = http.get("/whoami", headers={"Authorization": f"Bearer {key}"}).json()
        assert who == {"tenant": record.tenant, "admin": record.admin, "key_id": record.id}
    with pytest.raises(openai.AuthenticationError) as caught:
        client_for(http).with_options(api_key=key_a[:-1] + "x").embeddings.create(
            model=queue, input="x"
        )
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"

    key_c, _ = store.create("initech")  # made while the app runs: accepted once it reloads
    holds(app, store.version())
    assert http.get("/whoami", headers={"api-key": key_c}).json()["tenant"] == "initech"


@pytest.mark.slow
def test_a_key_rotated_with_a_grace_period_is_refused_once_it_ends(
    make_app: MakeApp, serve: Serve, store: Keys
) -> None:
    """``keys rotate --grace-s``: the old key keeps working on the API until its grace
    period ends, then is refused with no further change to the store; the new one works at
    once."""
    old, record = store.create("acme")
    app = make_app(api_keys=True)
    http = serve(app)

    def status(key: str) -> int:
        return int(http.get("/whoami", headers={"x-api-key": key}).status_code)

    assert status(old) == 200
    grace_s = 4.0
    rotated_at = time.monotonic()
    new, _ = store.rotate(record.id, grace_s)
    holds(app, store.version())
    version = table_of(app).version
    assert status(new) == 200
    if time.monotonic() - rotated_at < grace_s - 0.5:  # (a machine this slow: not shown)
        assert status(old) == 200
    wait_until(lambda: status(old) == 401, "the grace period's end", timeout_s=30)
    assert time.monotonic() - rotated_at >= grace_s - 0.1
    assert (table_of(app).version, status(new)) == (version, 200)


def test_the_store_and_the_static_key_together(
    make_app: MakeApp, serve: Serve, store: Keys
) -> None:
    key, _ = store.create("acme")
    http = serve(make_app(api_keys=True, api_key=SecretStr(STATIC)))
    assert http.get("/whoami", headers={"x-api-key": key}).json()["tenant"] == "acme"
    assert http.get("/whoami", headers={"x-api-key": STATIC}).json()["tenant"] == "default"


def test_redis_unreachable_before_the_first_read_is_503_not_401(serve: Serve, queue: str) -> None:
    app = create_app(
        WebSettings(redis_url=SecretStr("redis://127.0.0.1:1/0"), queue=queue, api_keys=True)
    )
    http = serve(app)
    response = http.get("/v1/models", headers={"x-api-key": "bl-00000000-" + "A" * 43})
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"]


class _Counting:
    """A stand-in for a Redis client that counts every use (and has nothing to give)."""

    def __init__(self) -> None:
        self.uses = 0

    def __getattr__(self, name: str) -> Any:
        self.uses += 1
        raise AssertionError(f"the key check used Redis ({name})")


async def test_a_wrong_key_costs_no_redis_call() -> None:
    table = KeyTable(store=lambda: connect(WebSettings()))
    table.install(TenantTable(1, {"0" * 64: KeyRecord("00000000", "acme")}, {}))
    counting = _Counting()
    table.client = counting  # type: ignore[assignment]
    for i in range(10_000):
        assert table.lookup(f"bl-{i:08x}-" + "A" * 43) is None
    assert counting.uses == 0


@pytest.mark.slow
def test_a_burst_of_wrong_keys_is_refused_while_valid_requests_are_served(
    make_app: MakeApp, serve: Serve, store: Keys, rclient: redis.Redis
) -> None:
    key, _ = store.create("acme")
    http = serve(make_app(api_keys=True))
    valid = {"Authorization": f"Bearer {key}"}
    assert http.get("/whoami", headers=valid).status_code == 200
    before = _calls(rclient)
    wrong = 600

    def attack(i: int) -> int:
        headers = {"Authorization": f"Bearer bl-{i:08x}-" + "B" * 43}
        return http.get("/whoami", headers=headers).status_code

    served: list[int] = []
    done = threading.Event()

    def use() -> None:
        while not done.is_set():
            served.append(http.get("/whoami", headers=valid).status_code)

    user = threading.Thread(target=use)
    user.start()
    with ThreadPoolExecutor(8) as pool:
        refused = list(pool.map(attack, range(wrong)))
    done.set()
    user.join()
    assert refused == [401] * wrong
    assert served
    assert set(served) == {200}
    # The app's Redis calls in that time: the table's version checks (two a second), not
    # one per wrong key.
    assert _calls(rclient) - before < wrong // 4


def _calls(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in ("cmdstat_info",))


# -- no key in any log line ------------------------------------------------------------------


@pytest.fixture
def every_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every log line at DEBUG, uvicorn's access log (which does not propagate) included."""
    access = logging.getLogger("uvicorn.access")
    levels = {name: logging.getLogger(name).level for name in ("uvicorn.access", "uvicorn.error")}
    caplog.set_level(logging.DEBUG)
    access.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        access.removeHandler(caplog.handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_no_key_appears_in_the_logs(
    make_app: MakeApp, serve: Serve, store: Keys, every_log: pytest.LogCaptureFixture
) -> None:
    key, _ = store.create("acme")
    http = serve(make_app(api_keys=True, api_key=SecretStr(STATIC)))
    for name in ("uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    wrong = "bl-0badc0de-" + "C" * 43
    for presented in (key, STATIC, wrong, "not-a-key-" + uuid.uuid4().hex):
        for header in ("Authorization", "x-api-key", "api-key"):
            value = f"Bearer {presented}" if header == "Authorization" else presented
            http.get("/v1/models", headers={header: value})
            http.post("/jobs", json={"text": "x"}, headers={header: value})
    text = "\n".join(
        f"{r.name} {r.getMessage()} {r.args!r} {r.exc_text or ''}" for r in every_log.records
    )
    assert "GET /v1/models" in text  # the access log was captured
    assert "key id 0badc0de not known" in text  # what names a key refused: its id
    for secret in (key, key.split("-", 2)[2], STATIC, wrong[12:]):  # the secret may hold "-"
        assert secret not in text


# -- an open API on a reachable address; Redis gone after the first read --------------------


def test_an_open_api_warns_once_when_reached_over_an_address_not_loopback(
    make_app: MakeApp, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app()
    caplog.set_level(logging.WARNING, logger="batchline.contrib._plumbing._auth")
    with TestClient(app, base_url="http://127.0.0.1") as local:
        assert local.get("/whoami").status_code == 200
    assert not [r for r in caplog.records if "is open" in r.getMessage()]
    with TestClient(app, base_url="http://10.1.2.3:8000") as exposed:
        for _ in range(3):
            assert exposed.get("/whoami").status_code == 200
    warned = [r for r in caplog.records if "is open" in r.getMessage()]
    assert len(warned) == 1
    assert "10.1.2.3" in warned[0].getMessage()
    assert "BATCHLINE_API_KEYS" in warned[0].getMessage()


@pytest.mark.parametrize(
    ("argv", "environ", "host"),
    [
        (["/usr/local/bin/uvicorn", "m:app", "--host", "0.0.0.0"], {}, "0.0.0.0"),
        (["/venv/bin/uvicorn", "m:app", "--host=::"], {}, "::"),
        (["/x/site-packages/uvicorn/__main__.py", "m:app", "--port", "80"], {}, "127.0.0.1"),
        (["/venv/bin/uvicorn", "m:app"], {"UVICORN_HOST": "10.0.0.2"}, "10.0.0.2"),
        (["/venv/bin/uvicorn", "m:app", "--uds", "/run/api.sock"], {}, None),
        (["/venv/bin/gunicorn", "-k", "uvicorn.workers.UvicornWorker"], {}, None),
        (["/venv/bin/pytest"], {}, None),
    ],
)
def test_the_address_the_uvicorn_command_binds(
    argv: list[str], environ: dict[str, str], host: str | None
) -> None:
    assert uvicorn_host(argv, environ) == host


def test_an_open_api_started_by_uvicorn_on_all_addresses_warns_at_start(
    make_app: MakeApp, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["/venv/bin/uvicorn", "m:app", "--host", "0.0.0.0"])
    caplog.set_level(logging.WARNING, logger="batchline.contrib._plumbing._auth")
    with TestClient(make_app(), base_url="http://10.1.2.3") as exposed:
        warned = [r for r in caplog.records if "is open" in r.getMessage()]
        assert len(warned) == 1  # at start, before any request
        assert "0.0.0.0" in warned[0].getMessage()
        exposed.get("/whoami")
    assert len([r for r in caplog.records if "is open" in r.getMessage()]) == 1
    with TestClient(make_app(api_key=SecretStr(STATIC))):
        pass  # keys: no warning
    assert len([r for r in caplog.records if "is open" in r.getMessage()]) == 1


class _Gone:
    """A Redis client whose server went away."""

    async def get(self, name: str) -> bytes:
        raise redis.ConnectionError("Connection refused")

    async def aclose(self) -> None:
        return None


async def test_redis_gone_at_a_refresh_keeps_the_table_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = "bl-0123abcd-" + "D" * 43
    table = KeyTable(store=lambda: connect(WebSettings()))
    table.install(TenantTable(7, {key_hash(key): KeyRecord("0123abcd", "acme")}, {}))
    table.client = _Gone()  # type: ignore[assignment]
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        await table.refresh()
    caller = table.lookup(key)
    assert caller is not None
    assert (caller.tenant, table.version) == ("acme", 7)
    warned = [r for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(warned) == 1
    assert "version 7" in warned[0].getMessage()
