"""``POST /v1/embeddings`` as clients call it: ``encoding_format``, ``dimensions`` and
``usage``, with the model facts the workers publish (docs/protocol.md, Model facts).

The fast tests publish the facts by hand (as a worker would) and start no worker: what they
refuse must be refused before anything is queued. The slow ones run a real
sentence-transformers worker (all-MiniLM-L6-v2, offline) in this process, called with the
official ``openai`` client over uvicorn and Redis.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from batchline.keys import QueueKeys

from ..test_fastapi import MODEL, Serve, poll_job, serve, submit_job
from .test_openai import MakeApp, assert_error, client_for, gen_queue, make_app
from tests.support.service import WorkerThread, queued
from tests.support.web_models import NOT_FINITE, vector

openai = pytest.importorskip("openai")

__all__ = ["gen_queue", "make_app", "serve"]  # fixtures, used here

FACTS = {
    "kind": "embedding",
    "dimensions": 8,
    "matryoshka": False,
    "matryoshka_dimensions": None,
    "max_model_len": 16,
    "tokenize": True,
}


def publish(client: redis.Redis, keys: QueueKeys, **facts: Any) -> None:
    """The facts a worker of the queue would publish."""
    client.set(keys.facts, json.dumps({**FACTS, **facts}), ex=60)


def embed(http: httpx.Client, model: str, **params: Any) -> httpx.Response:
    return http.post("/v1/embeddings", json={"model": model, "input": "x", **params})


@pytest.fixture
def idle_app(make_app: MakeApp, serve: Serve) -> httpx.Client:  # noqa: F811 (imported above)
    """The app under uvicorn, timing out after 2 s: with no worker, a request let through
    would be a 504."""
    return serve(make_app(timeout_s=2))


def test_dimensions_the_model_cannot_give_are_refused_before_anything_is_queued(
    idle_app: httpx.Client, rclient: redis.Redis, keys: QueueKeys, queue: str
) -> None:
    http = idle_app
    # No worker has published its facts: nothing to check dimensions against, retry later.
    error = assert_error(embed(http, queue, dimensions=4), 503, code="service_unavailable")
    assert "facts" in error["message"]

    publish(rclient, keys)
    for dimensions, words in [
        (9, "above the model's size, 8"),
        (4, "not trained for truncated (Matryoshka)"),
    ]:
        error = assert_error(embed(http, queue, dimensions=dimensions), 400, param="dimensions")
        assert words in error["message"], error
    for bad in (0, -1, "4", 4.0, True):
        assert_error(embed(http, queue, dimensions=bad), 400, param="dimensions")
    publish(rclient, keys, matryoshka=True, matryoshka_dimensions=[2, 4])
    error = assert_error(embed(http, queue, dimensions=3), 400, param="dimensions")
    assert "[2, 4]" in error["message"]
    publish(rclient, keys, dimensions=None)  # a model that does not say its size
    assert_error(embed(http, queue, dimensions=3), 400, param="dimensions")
    assert queued(rclient, keys) == 0

    # The official client gets the same 400.
    publish(rclient, keys)
    with pytest.raises(openai.BadRequestError) as refused:
        client_for(http).embeddings.create(model=queue, input="x", dimensions=2)
    assert refused.value.param == "dimensions"
    assert queued(rclient, keys) == 0


def test_the_models_list_shows_the_published_facts(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    rclient: redis.Redis,
    keys: QueueKeys,
    queue: str,
    gen_queue: str,  # noqa: F811
) -> None:
    client = client_for(serve(make_app(timeout_s=2)))
    publish(rclient, keys, matryoshka=True)
    models = {m.id: m.model_dump() for m in client.models.list()}
    assert models[queue]["dimensions"] == 8
    assert models[queue]["matryoshka"] is True
    assert models[queue]["max_model_len"] == 16
    assert "dimensions" not in models[gen_queue]  # no worker: no facts
    assert client.models.retrieve(queue).model_dump()["kind"] == "embedding"


@pytest.fixture
def http(make_app: MakeApp, serve: Serve) -> httpx.Client:  # noqa: F811
    """The app (its default timeout) under uvicorn."""
    return serve(make_app())


@pytest.fixture
def minilm(start_worker: Callable[..., WorkerThread]) -> Callable[..., Any]:
    """``minilm(queue=..., **settings)``: a sentence-transformers worker (all-MiniLM-L6-v2)
    started on the queue; returns its model (its tokenizer counts the tokens)."""

    def start(**settings: Any) -> Any:
        settings.setdefault("batch_size", 8)
        return start_worker("sentence-transformers", device="cpu", **settings).worker.model

    return start


def unit(vector: Any) -> np.ndarray[Any, Any]:
    v = np.asarray(vector, dtype=np.float64)
    return v / np.linalg.norm(v)


@pytest.mark.slow
def test_a_real_embedding_model_in_float_and_base64_with_its_token_counts(
    minilm: Callable[..., Any], http: httpx.Client, queue: str
) -> None:
    model = minilm()
    client = client_for(http)
    texts = ["The cat sat on the mat.", "Dynamic batching of a transformer model"]
    floats = client.embeddings.create(model=queue, input=texts, encoding_format="float")
    # The client's default asks for base64 and decodes it: the same float32 values.
    packed = client.embeddings.create(model=queue, input=texts)
    for a, b in zip(floats.data, packed.data, strict=True):
        assert len(a.embedding) == 384
        np.testing.assert_array_equal(np.float32(a.embedding), np.float32(b.embedding))
    raw = http.post(
        "/v1/embeddings", json={"model": queue, "input": texts[0], "encoding_format": "base64"}
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vector, np.float32(floats.data[0].embedding))

    # usage: the model's own tokenizer's count, special tokens included.
    want = sum(len(ids) for ids in model.tokenizer(texts)["input_ids"])
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == want
    assert raw["usage"]["prompt_tokens"] == len(model.tokenizer(texts[0])["input_ids"])

    # Not trained for truncation (and not allowed by its worker): a clear 400.
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=queue, input="x", dimensions=128)
    assert refused.value.param == "dimensions"
    assert "Matryoshka" in str(refused.value)
    listed = client.models.retrieve(queue).model_dump()
    facts = (listed["dimensions"], listed["matryoshka"], listed["max_model_len"])
    assert facts == (384, False, 256)


@pytest.mark.slow
def test_a_worker_that_allows_dimensions_gives_the_renormalized_prefix(
    minilm: Callable[..., Any], http: httpx.Client, queue: str
) -> None:
    minilm(matryoshka=True)
    client = client_for(http)
    assert client.models.retrieve(queue).model_dump()["matryoshka"] is True
    text = "Matryoshka dolls nest inside each other"
    full = client.embeddings.create(model=queue, input=text, encoding_format="float")
    for encoding in ("float", openai.NOT_GIVEN):  # (not given: base64, decoded)
        cut = client.embeddings.create(
            model=queue, input=[text, text], dimensions=64, encoding_format=encoding
        )
        for row in cut.data:
            assert len(row.embedding) == 64
            np.testing.assert_allclose(
                row.embedding, unit(full.data[0].embedding[:64]), rtol=1e-5, atol=1e-6
            )
            assert np.linalg.norm(row.embedding) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=queue, input=text, dimensions=385)
    assert refused.value.param == "dimensions"


@pytest.mark.slow
def test_vectors_over_http_are_unit_length_in_the_default_dtype(
    minilm: Callable[..., Any], http: httpx.Client, queue: str
) -> None:
    """all-MiniLM-L6-v2 in the worker's default dtype (bfloat16 on a CPU that computes it
    natively): every route's vectors have norm 1 within 1e-6, as JSON floats and as base64."""
    from batchline.demo.sentences import sentences

    minilm()
    client = client_for(http)
    texts = sentences(64, seed=13)

    def assert_unit(vectors: Any) -> None:
        norms = np.linalg.norm(np.asarray(vectors, dtype=np.float64), axis=1)
        np.testing.assert_allclose(norms, 1.0, rtol=0, atol=1e-6)

    floats = client.embeddings.create(model=queue, input=texts, encoding_format="float")
    assert_unit([row.embedding for row in floats.data])
    packed = client.embeddings.create(model=queue, input=texts)  # base64, decoded
    assert_unit([row.embedding for row in packed.data])
    # dimensions at the model's own size: renormalized, the same unit vectors.
    full = client.embeddings.create(model=queue, input=texts[:4], dimensions=384)
    assert_unit([row.embedding for row in full.data])
    # TEI's /embed, normalized by the route or not; the app's own /embed as it is.
    for normalize in (True, False):
        got = http.post("/embed", json={"inputs": texts, "normalize": normalize})
        assert got.status_code == 200, got.text
        assert_unit(got.json())
    assert_unit(http.post("/embed", json={"texts": texts}).json()["embeddings"])


@pytest.mark.slow
def test_a_vector_with_nan_fails_its_own_request_on_every_route(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
) -> None:
    """A model that overflows (a NaN and an infinity in one input's vector) fails that
    request alone, with each API's error shape and no traceback: JSON cannot carry the
    numbers, and base64 would hand the client garbage. The others are answered."""
    start_worker(MODEL)
    http = serve(make_app(generation_queue=None))

    for body in ({"text": NOT_FINITE}, {"texts": ["fine", NOT_FINITE]}):
        response = http.post("/embed", json=body)
        assert response.status_code == 500, response.text
        error = response.json()
        assert error["error_type"] == "NonFiniteOutput", error
        assert "which JSON cannot carry" in error["error_message"], error
    job = poll_job(http, submit_job(http, {"text": NOT_FINITE}))
    assert job.status_code == 500, job.text
    assert job.json()["error_type"] == "NonFiniteOutput"

    for encoding in ("float", "base64"):
        response = http.post(
            "/v1/embeddings",
            json={"model": queue, "input": ["fine", NOT_FINITE], "encoding_format": encoding},
        )
        error = assert_error(response, 500, type="server_error")
        assert "nan at [1][0]" in error["message"], error

    response = http.post("/embed", json={"inputs": [NOT_FINITE], "normalize": False})
    assert response.status_code == 500, response.text
    assert "nan at [0][0]" in response.text

    # The worker and the app serve on: the neighbours' answers are whole.
    assert http.post("/embed", json={"text": "fine"}).json()["embedding"] == vector("fine")
    answer = client_for(http).embeddings.create(model=queue, input="fine", encoding_format="float")
    assert answer.data[0].embedding == vector("fine")
