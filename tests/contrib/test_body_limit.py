"""The request body limit of the FastAPI backend (``max_body_bytes``), over real HTTP.

The app runs under uvicorn (test_fastapi's ``serve``), or in a uvicorn process of its own
where its memory is measured. A body that declares too large a ``Content-Length`` is sent
as headers alone, on a raw socket: the 413 comes without any of the body. A chunked body
comes from a generator (httpx sends it chunked), which counts what it gave.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis

from batchline.config import WebSettings
from batchline.contrib._plumbing._body_limit import LINGER_BYTES
from batchline.keys import QueueKeys

from .openai.test_openai import MakeApp, assert_error, client_for, gen_queue, make_app
from .test_fastapi import MODEL, Serve, serve
from tests.support.service import REPO, START_TIMEOUT_S, WorkerThread, subprocess_env, wait_until

openai = pytest.importorskip("openai")

__all__ = ["gen_queue", "make_app", "serve"]  # fixtures, used here

LIMIT = 64 << 10
MIB = 1 << 20

#: Each route that takes a body, and a valid body for it (``{queue}``: the embedding queue,
#: ``{gen}``: the generation queue).
ROUTES = {
    "/v1/embeddings": {"model": "{queue}", "input": "x"},
    "/v1/completions": {"model": "{gen}", "prompt": "x"},
    "/v1/chat/completions": {"model": "{gen}", "messages": [{"role": "user", "content": "x"}]},
    "/embed": {"text": "x"},
    "/jobs": {"text": "x"},
}


def padded(path: str, size: int, queue: str, gen: str) -> bytes:
    """A valid JSON body for ``path`` of exactly ``size`` bytes (spaces before its end)."""
    body = json.dumps(ROUTES[path]).replace("{queue}", queue).replace("{gen}", gen).encode()
    assert len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


def head_only(base_url: httpx.URL, path: str, declared: int) -> httpx.Response:
    """POST headers declaring ``declared`` bytes of body and asking for ``100 Continue``
    before it, send none, and read the answer until the server closes the connection (its
    first status line: a ``100 Continue`` would be the answer read)."""
    host, port = base_url.host, base_url.port
    assert port is not None
    with socket.create_connection((host, port), timeout=START_TIMEOUT_S) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        received = b""
        while data := sock.recv(65536):  # the server closes after its answer
            received += data
    head, _, body = received.decode().partition("\r\n\r\n")
    status_line, *lines = head.split("\r\n")
    headers = [tuple(line.split(": ", 1)) for line in lines]
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=body.encode())


def assert_refused(path: str, response: httpx.Response) -> None:
    """A 413 in the error shape of the route's API, closing the connection."""
    assert response.status_code == 413, response.text
    assert response.headers["connection"] == "close"
    if path.startswith("/v1/"):
        error = assert_error(response, 413, code="request_too_large", param=None)
        assert f"max_body_bytes={LIMIT}" in error["message"]
    else:
        assert f"max_body_bytes={LIMIT}" in response.json()["detail"]


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_declared_body_over_the_limit_is_refused_before_any_of_it_is_sent(
    make_app: MakeApp, serve: Serve, path: str
) -> None:
    http = serve(make_app(max_body_bytes=LIMIT))
    for declared in (LIMIT + 1, 10**12):
        response = head_only(http.base_url, path, declared)
        assert_refused(path, response)
        assert f"{declared} bytes (Content-Length)" in response.text


class Chunks:
    """A body of ``total`` bytes in 64 KiB chunks, counting what it gave."""

    def __init__(self, start: bytes, total: int) -> None:
        self.start, self.total, self.given = start, total, 0

    def __iter__(self) -> Iterator[bytes]:
        yield self.start
        self.given = len(self.start)
        while self.given < self.total:
            chunk = b" " * min(64 << 10, self.total - self.given)
            self.given += len(chunk)
            yield chunk


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_chunked_body_is_refused_once_it_passes_the_limit(
    make_app: MakeApp, serve: Serve, path: str, queue: str, gen_queue: str
) -> None:
    http = serve(make_app(max_body_bytes=LIMIT))
    chunks = Chunks(padded(path, 1024, queue, gen_queue)[:-1], 256 * MIB)
    response = http.post(path, content=chunks, headers={"Content-Type": "application/json"})
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert_refused(path, response)
    assert "received so far" in response.text
    # The server read (and dropped) at most LINGER_BYTES more before it closed: the client
    # sent that and what the sockets' buffers held, no more.
    assert chunks.given < LINGER_BYTES + 32 * MIB, chunks.given


@pytest.mark.slow
def test_a_body_of_the_limit_is_served_and_one_byte_more_is_not(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    queue: str,
    gen_queue: str,
) -> None:
    start_worker(MODEL)
    http = serve(make_app(max_body_bytes=LIMIT))
    for path in ("/v1/embeddings", "/embed"):
        for size, status in [(LIMIT, 200), (LIMIT + 1, 413)]:
            body = padded(path, size, queue, gen_queue)
            sized = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert sized.status_code == status, sized.text
            chunked = http.post(
                path, content=Chunks(body, size), headers={"Content-Type": "application/json"}
            )
            assert chunked.status_code == status, chunked.text

    # The official client's request is refused alike (413: its APIStatusError).
    client = client_for(http)
    with pytest.raises(openai.APIStatusError) as refused:
        client.embeddings.create(model=queue, input="x" * LIMIT)  # (413 before its 400)
    assert refused.value.status_code == 413
    assert refused.value.code == "request_too_large"
    assert client.embeddings.create(model=queue, input="x").data


# -- the API's memory, in a process of its own -----------------------------------------------------


@contextlib.contextmanager
def api_process(redis_url: str, gen_queue: str) -> Iterator[tuple[str, int]]:
    """``uvicorn batchline.contrib.fastapi:create_app --factory`` on a socket bound here,
    with its settings from the environment (the default ``max_body_bytes``): (base URL, pid).
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        env = {
            "BATCHLINE_REDIS_URL": redis_url,
            "BATCHLINE_GENERATION_QUEUE": gen_queue,
            "BATCHLINE_REQUEST_TIMEOUT_S": "5",
        }
        command = ["uvicorn", "batchline.contrib.fastapi:create_app", "--factory"]
        proc = subprocess.Popen(
            [sys.executable, "-m", *command, "--fd", str(sock.fileno()), "--log-level", "warning"],
            env=subprocess_env(env),
            cwd=REPO,
            pass_fds=[sock.fileno()],
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(base) or proc.poll() is not None, "the API to start")
        assert proc.poll() is None, "the API exited"
        yield base, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def peak_rss(pid: int) -> int:
    """The process's highest resident memory so far (the kernel's VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_eight_50_mb_bodies_at_once_leave_the_apis_memory_and_redis_alone(
    redis_url: str, gen_queue: str, rclient: redis.Redis
) -> None:
    limit = WebSettings.model_fields["max_body_bytes"].default
    prompt = 50_000_000
    start = json.dumps({"model": gen_queue, "prompt": ""})[:-2].encode()  # ... "prompt": "

    def post(chunked: bool) -> int:
        chunks = Chunks(start, prompt)
        with httpx.Client(timeout=START_TIMEOUT_S) as client:
            content: Any = chunks if chunked else b"".join(chunks)
            return client.post(f"{base}/v1/completions", content=content).status_code

    with api_process(redis_url, gen_queue) as (base, pid):
        assert [post(False), post(True)] == [413, 413]  # (warm: what the first request loads)
        before = peak_rss(pid)
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(post, [False, True] * 4))
        grown = peak_rss(pid) - before
    assert statuses == [413] * 8
    # Each chunked body is held up to the limit before its 413; 400 MB were sent at it.
    assert grown < 8 * limit + 16 * MIB, f"the API's peak memory grew {grown / MIB:.1f} MiB"
    assert not any(rclient.exists(s) for s in QueueKeys(gen_queue).streams)  # nothing queued


async def test_a_refused_body_is_read_and_dropped_until_its_end_or_the_linger_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 413 goes out first; then what the client still sends is read (and dropped) so
    that closing does not reset a connection the client is still sending on; a client that
    stalls is let go after LINGER_S."""
    import asyncio

    from batchline.contrib._plumbing import _body_limit

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app never sees a refused request")

    limit = _body_limit.BodyLimit(app, max_body_bytes=10)
    scope = {"type": "http", "path": "/embed", "headers": [(b"content-length", b"100")]}

    async def refuse(chunks: list[bytes], then_stall: bool) -> tuple[list[Any], int]:
        sent: list[Any] = []
        fed = iter(chunks)
        read = 0

        async def receive() -> dict[str, Any]:
            nonlocal read
            chunk = next(fed, None)
            if chunk is None:
                await asyncio.sleep(3600)  # a client that sends no more
            read += 1
            return {
                "type": "http.request",
                "body": chunk,
                "more_body": read < len(chunks) or then_stall,
            }

        async def send(message: Any) -> None:
            sent.append(message)

        await asyncio.wait_for(limit(scope, receive, send), 5)
        return sent, read

    sent, read = await refuse([b"x" * 25] * 4, then_stall=False)
    assert read == 4  # to the body's end
    assert sent[0]["status"] == 413
    assert b"max_body_bytes=10" in sent[1]["body"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    for bound in ("LINGER_S", "LINGER_IDLE_S"):  # either lets a stalled client go
        with monkeypatch.context() as patch:
            patch.setattr(_body_limit, bound, 0.2)
            started = asyncio.get_running_loop().time()
            sent, read = await refuse([b"x" * 25] * 2, then_stall=True)
            assert read == 2
            assert 0.15 < asyncio.get_running_loop().time() - started < 2
            assert sent[-1]["more_body"] is False
    # A client waiting for 100 Continue has sent none of its body, and is not invited to.
    scope["headers"] = [*scope["headers"], (b"expect", b"100-continue")]
    sent, read = await refuse([b"x" * 25] * 4, then_stall=False)
    assert (read, sent[0]["status"], sent[-1]["more_body"]) == (0, 413, False)


async def test_an_answer_given_before_the_body_ends_closes_after_reading_the_rest() -> None:
    """An app that answers part way through a body (an upload refused) has its answer
    carry ``Connection: close`` and end only once the client's body was read out; a
    request without a body keeps its connection."""
    from starlette.responses import JSONResponse

    from batchline.contrib._plumbing import _body_limit

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["method"] == "POST":
            await receive()  # one chunk of the body, then the answer
        await JSONResponse({"refused": True}, status_code=413)(scope, receive, send)

    limit = _body_limit.BodyLimit(app, max_body_bytes=10 << 20)

    async def call(method: str, chunks: int) -> tuple[list[Any], int]:
        sent: list[Any] = []
        read = 0

        async def receive() -> dict[str, Any]:
            nonlocal read
            read += 1
            return {"type": "http.request", "body": b"x" * 100, "more_body": read < chunks}

        async def send(message: Any) -> None:
            sent.append(message)

        headers = [(b"transfer-encoding", b"chunked")] if chunks else []
        scope = {"type": "http", "method": method, "path": "/v1/files", "headers": headers}
        await limit(scope, receive, send)
        return sent, read

    sent, read = await call("POST", 5)
    assert read == 5  # the rest of the body was read before the answer's end
    assert (b"connection", b"close") in sent[0]["headers"]
    assert b"refused" in sent[1]["body"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    sent, read = await call("GET", 0)
    assert read == 0
    assert all(k != b"connection" for k, _ in sent[0]["headers"])
    assert len(sent) == 2  # the app's answer as it gave it
