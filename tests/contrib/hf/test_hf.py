"""Hugging Face's native routes (TGI's generation API, TEI's ``/embed``) of the FastAPI
backend, end to end.

The app runs under uvicorn (test_fastapi's ``serve``) and is called with the real
``huggingface_hub.InferenceClient`` (and AsyncInferenceClient) pointed at a model's base URL,
and with raw httpx; requests go through the session's redis-server to real workers (threads
of this process): ``web_models.embed`` on the embedding queue and the tiny random Llama on
the generation queue. Generated texts and tokens are compared with the in-process generator
on the same model (test_generate's ``reference``), token for token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from batchline.keys import QueueKeys

from ..openai.test_openai import HangUp, MakeApp, gen_queue, hang_up, make_app, sse_events, workers
from ..test_fastapi import MODEL, Serve, serve
from tests.support.service import WorkerThread, cancelled_ids, wait_until
from tests.support.web_models import BAD_INPUT, MODEL_FAILURE, vector
from tests.worker.test_generate import reference

hf = pytest.importorskip("huggingface_hub")
hf_errors = pytest.importorskip("huggingface_hub.errors")

__all__ = [
    "gen_queue",
    "hang_up",
    "make_app",
    "reference",
    "serve",
    "workers",
]  # fixtures, used here


def in_process(gen: Any, prompt: str, **options: Any) -> Any:
    """What the in-process generator answers for one prompt, alone (16 tokens unless told,
    as the ``workers`` fixture's default)."""
    options.setdefault("max_new_tokens", 16)
    return gen.generate(prompt, **options)


def base_url(http: httpx.Client, model: str | None = None) -> str:
    root = str(http.base_url).rstrip("/")
    return root if model is None else f"{root}/models/{model}"


def assert_tgi_error(response: httpx.Response, status: int, error_type: str) -> str:
    """The response is TGI's error object with this status and type; its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"}, body
    assert body["error_type"] == error_type, body
    return str(body["error"])


def field(token: Any, name: str) -> Any:
    """A field of one of ``top_tokens``' tokens (the client leaves nested lists as dicts)."""
    return token[name] if isinstance(token, dict) else getattr(token, name)


def tgi_reason(reason: str) -> str:
    return {"eos": "eos_token", "stop": "stop_sequence"}.get(reason, reason)


@pytest.mark.slow
def test_the_inference_client_generates_whole_with_details_and_streamed(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811 (the fixture imported above)
    workers: Callable[..., None],  # noqa: F811
    gen_queue: str,  # noqa: F811
    reference: Any,  # noqa: F811
) -> None:
    workers()
    http = serve(make_app())
    client = hf.InferenceClient(base_url=base_url(http, gen_queue))
    prompt = "Über straße"  # multi-byte characters: a token may complete no text
    want = in_process(reference, prompt, max_new_tokens=9)

    assert client.text_generation(prompt, max_new_tokens=9) == want.text

    out = client.text_generation(prompt, max_new_tokens=9, details=True)
    assert out.generated_text == want.text
    info = out.details
    assert info.finish_reason == tgi_reason(want.finish_reason)
    assert info.generated_tokens == len(want.token_ids)
    assert [t.id for t in info.tokens] == list(want.token_ids)
    assert "".join(t.text for t in info.tokens) == want.text
    assert (info.seed, info.prefill, info.top_tokens) == (None, [], None)
    # Each token's log probability is the engine's (float64 here, both ways).
    scored = in_process(reference, prompt, max_new_tokens=9, logprobs=3)
    assert [t.logprob for t in info.tokens] == pytest.approx(
        [e.logprob for e in scored.logprobs], abs=1e-9
    )
    top = client.text_generation(prompt, max_new_tokens=9, details=True, top_n_tokens=3)
    assert top.details is not None
    assert top.details.top_tokens is not None
    steps = [[field(t, "id") for t in step] for step in top.details.top_tokens]
    assert steps == [[i for i, _ in e.top] for e in scored.logprobs]
    first = field(top.details.top_tokens[0][0], "logprob")
    assert first == pytest.approx(scored.logprobs[0].top[0][1], abs=1e-9)

    # Streamed: one event per token, their texts joined are the text; the last event has
    # the whole text and (asked) the details.
    texts = list(client.text_generation(prompt, max_new_tokens=9, stream=True))
    assert "".join(texts) == want.text
    assert len(texts) == len(want.token_ids)
    events = list(client.text_generation(prompt, max_new_tokens=9, stream=True, details=True))
    assert [e.token.id for e in events] == list(want.token_ids)
    assert [e.token.logprob for e in events] == pytest.approx(
        [e.logprob for e in scored.logprobs], abs=1e-9
    )
    assert all(e.top_tokens is None for e in events)  # top_n_tokens not asked
    streamed_top = list(
        client.text_generation(prompt, max_new_tokens=9, stream=True, top_n_tokens=2, details=True)
    )
    assert [[field(t, "id") for t in e.top_tokens] for e in streamed_top] == [
        [i for i, _ in e.top[:2]] for e in scored.logprobs
    ]
    assert [e.index for e in events] == list(range(1, len(events) + 1))
    assert [e.generated_text for e in events[:-1]] == [None] * (len(events) - 1)
    last = events[-1]
    assert last.generated_text == want.text
    assert last.details.finish_reason == tgi_reason(want.finish_reason)
    assert last.details.generated_tokens == len(want.token_ids)
    assert last.details.input_length == want.prompt_tokens

    # Sampling follows TGI's rule: do_sample, or a parameter that changes the distribution
    # (top_k alone samples at temperature 1); the seed reaches the worker.
    sampled = client.text_generation(
        prompt, max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.95, seed=7, details=True
    )
    want = in_process(reference, prompt, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    assert sampled.generated_text == want.text
    assert sampled.details.seed == 7
    top_k = client.text_generation(prompt, max_new_tokens=12, top_k=5, seed=3)
    assert (
        top_k
        == in_process(reference, prompt, max_new_tokens=12, temperature=1.0, top_k=5, seed=3).text
    )
    greedy = client.text_generation(prompt, max_new_tokens=12, temperature=1.0, seed=3)
    assert greedy == in_process(reference, prompt, max_new_tokens=12).text

    # A stop sequence ends the text before it; return_full_text puts the prompt first.
    full = in_process(reference, "abc").text
    stop = full[5:7]
    cut = client.text_generation("abc", stop=[stop], details=True)
    assert cut.generated_text == full[: full.index(stop)]
    assert cut.details.finish_reason == "stop_sequence"
    assert client.text_generation("abc", return_full_text=True) == "abc" + full


@pytest.mark.slow
async def test_the_async_client_and_the_routes_of_tgi_itself(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    workers: Callable[..., None],  # noqa: F811
    reference: Any,  # noqa: F811
) -> None:
    workers()
    http = serve(make_app(embedding_queue=None))
    want = in_process(reference, "Once upon a time", max_new_tokens=7)

    # The server's own URL: "/" is the generation model's.
    client = hf.AsyncInferenceClient(base_url=base_url(http))
    assert await client.text_generation("Once upon a time", max_new_tokens=7) == want.text
    texts = [
        t
        async for t in await client.text_generation(
            "Once upon a time", max_new_tokens=7, stream=True
        )
    ]
    assert "".join(texts) == want.text

    def post(path: str, body: Any, **kw: Any) -> httpx.Response:
        return httpx.post(base_url(http) + path, json=body, timeout=60, **kw)

    # /generate answers one object, "/" a list of one (as TGI's routes do).
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 7}}
    got = await asyncio.to_thread(post, "/generate", body)
    assert got.json() == {"generated_text": want.text}
    got = await asyncio.to_thread(post, "/", body)
    assert got.json() == [{"generated_text": want.text}]

    def stream(path: str, body: Any) -> list[dict[str, Any]]:
        with httpx.stream("POST", base_url(http) + path, json=body, timeout=60) as response:
            return [json.loads(e) for e in sse_events(response)]

    events = await asyncio.to_thread(stream, "/generate_stream", body)
    assert "".join(e["token"]["text"] for e in events) == want.text
    assert events[-1]["generated_text"] == want.text
    assert events[-1]["details"] is None  # not asked
    events = await asyncio.to_thread(stream, "/", {**body, "stream": True})
    assert events[-1]["generated_text"] == want.text

    # The seed's body: {"prompt", "max_tokens"} answered {"generated"}.
    got = await asyncio.to_thread(
        post, "/generate", {"prompt": "Once upon a time", "max_tokens": 7}
    )
    assert got.json() == {"generated": want.text}


@pytest.mark.slow
def test_the_inference_client_embeds_and_embed_takes_both_bodies(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    start_worker(MODEL)
    http = serve(make_app(generation_queue=None))

    def unit(text: str) -> list[float]:
        v = np.asarray(vector(text), dtype=np.float32)
        return (v / np.linalg.norm(v)).astype(float).tolist()

    for url in (base_url(http, queue), base_url(http)):  # "/": no generation model here
        client = hf.InferenceClient(base_url=url)
        one = client.feature_extraction("hello")
        assert one.dtype == np.float32
        np.testing.assert_allclose(one, [unit("hello")], rtol=1e-6)
        several = client.feature_extraction(["a", "two words"], normalize=False, truncate=True)
        np.testing.assert_array_equal(several, [vector("a"), vector("two words")])

    # TEI's body on /embed: a list of vectors; the app's own bodies answer as before.
    got = http.post("/embed", json={"inputs": "hello"})
    assert got.status_code == 200, got.text
    np.testing.assert_allclose(got.json(), [unit("hello")], rtol=1e-6)
    got = http.post("/embed", json={"inputs": ["a"], "normalize": False})
    assert got.json() == [vector("a")]
    assert http.post("/embed", json={"text": "hello"}).json()["embedding"] == vector("hello")
    old = http.post("/embed", json={"texts": ["a", "bb"]}).json()
    assert old["embeddings"] == [vector("a"), vector("bb")]
    assert http.post("/embed", json={"text": "a", "inputs": "b"}).status_code == 422  # TEI's
    assert http.post("/embed", json={"text": 3}).json()["detail"][0]["loc"] == ["body", "text"]

    # Refused, naming the parameter: the workers always truncate.
    client = hf.InferenceClient(base_url=base_url(http, queue))
    with pytest.raises(hf_errors.HfHubHTTPError) as caught:
        client.feature_extraction("hello", truncate=False)
    assert caught.value.response.status_code == 422
    message = assert_tgi_error(caught.value.response, 422, "validation")
    assert message.startswith("truncate:"), message
    for name, value in [
        ("prompt_name", "query"),
        ("dimensions", 2),
        ("truncation_direction", "left"),
    ]:
        response = http.post("/embed", json={"inputs": "x", name: value})
        assert assert_tgi_error(response, 422, "validation").startswith(f"{name}:")
    # The worker's errors: the input's 422, the model's 500.
    assert_tgi_error(http.post("/embed", json={"inputs": BAD_INPUT}), 422, "validation")
    assert_tgi_error(http.post("/embed", json={"inputs": [MODEL_FAILURE]}), 500, "backend")


@pytest.mark.slow
def test_bad_requests_get_tgi_errors(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    workers: Callable[..., None],  # noqa: F811
    gen_queue: str,  # noqa: F811
) -> None:
    workers(max_new_tokens_limit=50, max_batch_tokens=100)
    http = serve(make_app())
    url = f"/models/{gen_queue}"
    body = {"inputs": "x"}

    # Parameters batchline lacks are refused unless at their no-op value, never ignored.
    for name, value in [
        ("best_of", 2),
        ("watermark", True),
        ("decoder_input_details", True),
        ("repetition_penalty", 1.2),
        ("frequency_penalty", 0.5),
        ("typical_p", 0.5),
        ("top_n_tokens", 21),
        ("truncate", 10),
        ("grammar", {"type": "json", "value": {}}),
        ("adapter_id", "lora"),
        ("temperature", 0),
        ("top_p", 1.5),
        ("max_new_tokens", "10"),
        ("foo", 1),
    ]:
        response = http.post(url, json={**body, "parameters": {name: value}})
        message = assert_tgi_error(response, 422, "validation")
        assert message.startswith(f"parameters.{name}:"), message
    for name, value in [("best_of", 1), ("repetition_penalty", 1.0), ("watermark", False)]:
        response = http.post(
            "/generate", json={**body, "parameters": {name: value, "max_new_tokens": 2}}
        )
        assert response.status_code == 200, response.text
    assert_tgi_error(http.post(url, json={"inputs": ""}), 422, "validation")
    huge = http.post("/generate", json={"inputs": "x" * (3 << 20)})  # over max_body_bytes
    assert huge.status_code == 413
    assert huge.json()["error_type"] == "validation"
    assert_tgi_error(http.post(url, content=b"{"), 422, "validation")
    assert "stream" in assert_tgi_error(
        http.post("/generate", json={**body, "stream": True}), 422, "validation"
    )

    # The client raises TGI's typed errors for these answers.
    client = hf.InferenceClient(base_url=base_url(http, gen_queue))
    with pytest.raises(hf_errors.ValidationError, match="best_of"):
        client.text_generation("x", best_of=2)
    with pytest.raises(hf_errors.ValidationError, match="max_new_tokens_limit"):
        client.text_generation("x", max_new_tokens=51)  # the worker's refusal
    with pytest.raises(hf_errors.ValidationError):
        client.text_generation("x" * 200, stream=True)  # too long: before the first token

    # An unknown model, and a route whose queue is not set.
    assert "'gpt-4o'" in assert_tgi_error(http.post("/models/gpt-4o", json=body), 404, "not_found")
    bare = serve(make_app(generation_queue=None, embedding_queue=None))
    message = assert_tgi_error(bare.post("/generate", json=body), 404, "not_found")
    assert "generation_queue" in message
    assert_tgi_error(bare.post("/", json=body), 404, "not_found")


def test_a_full_queue_is_429_and_no_answer_in_time_is_504_and_cancelled(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    gen_queue: str,  # noqa: F811
    rclient: redis.Redis,
) -> None:
    # No worker: what is queued stays queued.
    http = serve(make_app(timeout_s=None, request_timeout_s=0.5))
    keys = QueueKeys(gen_queue)
    body = {"inputs": "x"}
    message = assert_tgi_error(http.post("/generate", json=body), 504, "timeout")
    assert "no live worker serves that queue" in message
    assert len(cancelled_ids(rclient, keys)) == 1  # nobody waits for it any more
    assert_tgi_error(http.post("/generate_stream", json=body), 504, "timeout")
    wait_until(lambda: len(cancelled_ids(rclient, keys)) == 2, "the stream's cancel")
    details = {**body, "parameters": {"details": True}}
    assert_tgi_error(http.post("/generate", json=details), 504, "timeout")
    wait_until(lambda: len(cancelled_ids(rclient, keys)) == 3, "the cancel of a details request")

    # A queue that holds its max_queue_depth already (what the timeouts left).
    full = serve(make_app(max_queue_depth=1))
    response = full.post("/generate", json=body)
    assert_tgi_error(response, 429, "overloaded")
    assert response.headers["retry-after"] == "1"
    client = hf.InferenceClient(base_url=base_url(full, gen_queue))
    with pytest.raises(hf_errors.OverloadedError):
        client.text_generation("x")


@pytest.mark.parametrize("stream", [False, True], ids=["details", "streamed"])
@pytest.mark.slow
def test_a_client_that_hangs_up_cancels_its_request(hang_up: HangUp, stream: bool) -> None:
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 200, "details": True}}
    # Streamed: hang up after a token (sent once the next one came).
    hang_up("/generate_stream" if stream else "/generate", body, 1 if stream else 0)
