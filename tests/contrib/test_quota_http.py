"""A tenant's quotas over HTTP (docs/http.md, Quotas): a refusal is 429 with ``Retry-After``,
``retry-after-ms`` and OpenAI's ``x-ratelimit-*`` headers, in each route family's shape
(OpenAI's ``rate_limit_exceeded`` under ``/v1``, as the official client reads it; TGI's on
its routes; ``/embed`` and ``/jobs``), whether the producer refused at once or the request's
result is the refusal; every answer to a limited caller carries the ``x-ratelimit-*``
headers. uvicorn, the official ``openai`` client (no retries), real Redis; the caller is
set as the key check sets it; the refusals come from a producer raising QuotaExceeded."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import redis
from fastapi import FastAPI
from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from batchline.codec import Result
from batchline.config import WebSettings
from batchline.contrib._plumbing._caller import Caller
from batchline.contrib._plumbing._ratelimit import reset_duration, retry_headers
from batchline.contrib.fastapi import create_app
from batchline.errors import QuotaExceeded
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.tenants import TenantConfig

from .test_fastapi import MODEL, Serve, serve
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread

openai = pytest.importorskip("openai")

__all__ = ["serve"]  # a fixture, used here

LIMITS = TenantConfig(requests_per_min=10, tokens_per_min=1000)
REFUSED = QuotaExceeded(
    "tenant acme: requests_per_min=10 reached", tenant="acme", limit="requests_per_min",
    retry_after_s=1.2,
)  # fmt: skip


class AsCaller:
    """What the key check does: the request's caller on its state."""

    def __init__(self, app: ASGIApp, caller: Caller) -> None:
        self.app, self.caller = app, caller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["caller"] = self.caller
        await self.app(scope, receive, send)


@pytest.fixture
def app_for(redis_url: str, queue: str) -> Callable[..., FastAPI]:
    def make(config: TenantConfig | None = LIMITS, **settings: Any) -> FastAPI:
        settings.setdefault("embedding_queue", queue)
        settings.setdefault("generation_queue", f"{queue}-gen")
        app = create_app(
            WebSettings(redis_url=SecretStr(redis_url), queue=queue, **settings),
            timeout_s=RESULT_TIMEOUT_S,
        )
        if config is not None:
            app.add_middleware(AsCaller, caller=Caller("acme", config=config))
        return app

    return make


@pytest.fixture
def counted(rclient: redis.Redis, keys: QueueKeys) -> Callable[[int, int], None]:
    """Set acme's counts of this minute and the next (so that a minute's turn changes
    nothing)."""

    def count(requests: int, tokens: int) -> None:
        minute = int(time.time() // 60)
        for m in (minute, minute + 1):
            rclient.set(keys.quota("acme", "r", m), requests, ex=180)
            rclient.set(keys.quota("acme", "t", m), tokens, ex=180)

    return count


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every submit and stream refused at once, as the enqueue function refuses a tenant
    over quota."""

    async def submit(*_args: Any, **_kwargs: Any) -> Any:
        raise REFUSED

    async def stream(*_args: Any, **_kwargs: Any) -> AsyncIterator[Any]:
        raise REFUSED
        yield  # (an async generator, as the producer's)

    monkeypatch.setattr(AsyncProducer, "submit", submit)
    monkeypatch.setattr(AsyncProducer, "stream", stream)


def client_for(http: httpx.Client) -> Any:
    base_url = f"{str(http.base_url).rstrip('/')}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def assert_limit_headers(headers: Any, remaining_requests: int, remaining_tokens: int) -> None:
    assert headers["x-ratelimit-limit-requests"] == "10"
    assert headers["x-ratelimit-remaining-requests"] == str(remaining_requests)
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == str(remaining_tokens)
    for kind in ("requests", "tokens"):
        assert re.fullmatch(r"\d+(\.\d+)?m?s", headers[f"x-ratelimit-reset-{kind}"])


def test_reset_durations_and_retry_headers_as_openai_writes_them() -> None:
    assert [reset_duration(s) for s in (0.25, 1, 1.5, 59.999, 360, 61.2)] == [
        "250ms", "1s", "1.5s", "59.999s", "6m0s", "1m1.2s",
    ]  # fmt: skip
    assert retry_headers(REFUSED) == {"Retry-After": "2", "retry-after-ms": "1200"}
    at_once = QuotaExceeded("x", tenant="a", limit="max_in_flight", retry_after_s=0)
    assert retry_headers(at_once)["Retry-After"] == "1"


def test_the_openai_client_sees_429_with_retry_after_and_the_rate_limit_headers(
    app_for: Callable[..., FastAPI],
    serve: Serve,  # noqa: F811 (the fixture imported above)
    counted: Callable[[int, int], None],
    refusing: None,
    queue: str,
) -> None:
    counted(10, 250)
    http = serve(app_for())
    client = client_for(http)
    with pytest.raises(openai.RateLimitError) as caught:
        client.embeddings.create(model=queue, input="x")
    response = caught.value.response
    assert response.status_code == 429
    assert caught.value.body == {
        "message": str(REFUSED),
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert "tenant acme: requests_per_min=10 reached" in caught.value.message
    assert response.headers["retry-after"] == "2"
    assert response.headers["retry-after-ms"] == "1200"
    assert_limit_headers(response.headers, 0, 750)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model=f"{queue}-gen", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.RateLimitError):  # streamed: refused before the stream opens
        client.chat.completions.create(
            model=f"{queue}-gen", messages=[{"role": "user", "content": "x"}], stream=True
        )
    with pytest.raises(openai.RateLimitError) as caught:  # a response: stored as failed
        client.responses.create(model=f"{queue}-gen", input="x")
    assert caught.value.body["type"] == "requests"
    assert caught.value.response.headers["retry-after"] == "2"
    assert_limit_headers(caught.value.response.headers, 10, 1000)  # the generation queue's
    # TGI's routes, TEI's /embed, and the app's own /embed and /jobs: 429 in their shapes
    for path in ("/generate", "/generate_stream"):
        tgi = http.post(path, json={"inputs": "x"})
        assert tgi.status_code == 429, path
        assert tgi.json() == {"error": str(REFUSED), "error_type": "rate_limit_exceeded"}
        assert tgi.headers["retry-after"] == "2"
        assert_limit_headers(tgi.headers, 10, 1000)  # the generation queue's counts: none
    tei = http.post("/embed", json={"inputs": "x"})
    assert (tei.status_code, tei.json()["error_type"]) == (429, "rate_limit_exceeded")
    for path in ("/embed", "/jobs"):
        own = http.post(path, json={"text": "x"})
        assert own.status_code == 429, own.text
        assert own.json() == {"detail": str(REFUSED)}
        assert own.headers["retry-after"] == "2"
        assert_limit_headers(own.headers, 0, 750)


def test_a_refusal_as_the_requests_result_is_429_too(
    app_for: Callable[..., FastAPI],
    serve: Serve,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    queue: str,
) -> None:
    """The admission refused it (the producer's look found room): its result says so."""

    async def wait(_self: Any, handle: Any, *_args: Any, **_kwargs: Any) -> Result:
        message = "tenant acme: tokens_per_min=1000 reached; retry in 2500 ms"
        return Result(handle.id, "error", None, "QuotaExceeded", message, retry_ms=2500)

    monkeypatch.setattr(AsyncProducer, "wait", wait)
    http = serve(app_for())
    with pytest.raises(openai.RateLimitError) as caught:
        client_for(http).embeddings.create(model=queue, input="x")
    assert caught.value.body["type"] == "tokens"
    assert caught.value.response.headers["retry-after"] == "3"
    assert caught.value.response.headers["retry-after-ms"] == "2500"
    own = http.post("/embed", json={"text": "x"})
    assert own.status_code == 429
    assert own.json()["error_type"] == "QuotaExceeded"
    assert own.headers["retry-after"] == "3"


@pytest.mark.slow
def test_answers_to_a_limited_caller_carry_the_rate_limit_headers(
    app_for: Callable[..., FastAPI],
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    counted: Callable[[int, int], None],
    queue: str,
) -> None:
    start_worker(MODEL)
    counted(3, 100)
    http = serve(app_for())
    raw = client_for(http).embeddings.with_raw_response.create(model=queue, input="x")
    assert raw.http_response.status_code == 200
    assert_limit_headers(raw.headers, 7, 900)
    own = http.post("/embed", json={"text": "x"})
    assert own.status_code == 200
    assert_limit_headers(own.headers, 7, 900)
    # a caller without limits, and the open API: no such headers
    for app in (app_for(TenantConfig()), app_for(None)):
        plain = serve(app).post("/embed", json={"text": "x"})
        assert plain.status_code == 200
        assert not [h for h in plain.headers if h.startswith("x-ratelimit")]
