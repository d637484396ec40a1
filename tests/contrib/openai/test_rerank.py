"""``POST /v1/rerank`` and ``/rerank`` (Cohere's and Jina's shape), end to end over uvicorn,
Redis and a real ``--model cross-encoder`` worker, with raw HTTP (the ``openai`` client has
no rerank method).

The worker serves a tiny randomly initialised cross-encoder built from a config
(tests/support/tiny.py): its scores are compared with sentence-transformers'
``CrossEncoder.predict`` on the same directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from batchline.keys import QueueKeys
from batchline.worker import Worker

from ..hf.test_hf import assert_tgi_error
from ..test_fastapi import Serve, serve
from .test_openai import MakeApp, assert_error, gen_queue, make_app
from tests.support.service import WorkerThread, queued

__all__ = ["gen_queue", "make_app", "serve"]  # fixtures, used here

QUERY = "what is a cat"
DOCUMENTS = [
    "a cat is an animal",
    "paris is in france",
    "x",
    "cats and dogs",
    "the weather today is fine",
]
#: (the body's change, the parameter the 400 names).
BAD: list[tuple[dict[str, Any], str]] = [
    ({"documents": []}, "documents"),
    ({"documents": "a text"}, "documents"),
    ({"documents": ["x"] * 1001}, "documents"),
    ({"documents": ["ok", ""]}, "documents.[1]"),
    ({"documents": ["ok", 5]}, "documents.[1]"),
    ({"documents": [{"text": ""}]}, "documents.[0].text"),
    ({"documents": [{"text": "x", "title": "y"}]}, "documents.[0].title"),
    ({"query": ""}, "query"),
    ({"query": None}, "query"),
    *[({"top_n": v}, "top_n") for v in (0, -1, "2", 2.0, True)],
    ({"return_documents": "yes"}, "return_documents"),
    ({"max_chunks_per_doc": 2}, "max_chunks_per_doc"),
    ({"model": 5}, "model"),
]


@pytest.fixture
def rerank_queue(queue: str) -> str:
    return f"{queue}-rerank"


def rerank(http: httpx.Client, path: str = "/v1/rerank", **body: Any) -> httpx.Response:
    return http.post(path, json={"query": QUERY, "documents": DOCUMENTS, **body})


def test_bad_bodies_are_400s_naming_the_parameter_and_nothing_is_queued(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811 (the fixture imported above)
    rclient: redis.Redis,
    rerank_queue: str,
    queue: str,
) -> None:
    http = serve(make_app(rerank_queue=rerank_queue, timeout_s=2))  # no worker
    wrong = []
    for path in ("/v1/rerank", "/rerank"):
        for change, param in BAD:
            response = rerank(http, path, **{"model": rerank_queue, **change})
            try:
                assert_error(response, 400, param=param, type="invalid_request_error")
            except AssertionError as exc:
                wrong.append(f"{path} {change}: {exc}")
    assert not wrong, "\n".join(wrong)
    # Another served model is not a reranker; an unknown one does not exist.
    assert_error(rerank(http, model=queue), 400, param="model")
    error = assert_error(rerank(http, "/rerank", model="rerank-english-v3.0"), 404)
    assert error["code"] == "model_not_found"
    assert queued(rclient, QueueKeys(rerank_queue)) == 0


def test_without_a_rerank_queue_the_model_is_not_found(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
) -> None:
    http = serve(make_app(timeout_s=2))
    for path in ("/v1/rerank", "/rerank"):
        error = assert_error(rerank(http, path, model="any"), 404, param="model")
        assert error["code"] == "model_not_found"
        assert "rerank_queue" in error["message"]


@pytest.fixture
def cross_encoder(tmp_path: Path) -> str:
    """The tiny cross-encoder's directory."""
    from tests.support.tiny import tiny_cross_encoder

    return tiny_cross_encoder(tmp_path / "cross-encoder")


def predicted(directory: str, documents: list[str]) -> list[float]:
    """sentence-transformers' own scores of the pairs."""
    from sentence_transformers import CrossEncoder

    scores = CrossEncoder(directory, device="cpu").predict([(QUERY, d) for d in documents])
    return [float(s) for s in scores]


@pytest.fixture
def reranker(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    cross_encoder: str,
    rerank_queue: str,
) -> Callable[..., tuple[httpx.Client, Worker]]:
    """``reranker(**settings)``: a cross-encoder worker of the tiny model on the rerank queue
    and the app serving it: the app's client, the worker."""

    def start(**settings: Any) -> tuple[httpx.Client, Worker]:
        worker = start_worker(
            "cross-encoder", model_path=cross_encoder, queue=rerank_queue, device="cpu", **settings
        ).worker
        return serve(make_app(rerank_queue=rerank_queue)), worker

    return start


@pytest.mark.slow
def test_a_cross_encoder_worker_ranks_the_documents(
    reranker: Callable[..., tuple[httpx.Client, Worker]], cross_encoder: str, rerank_queue: str
) -> None:
    # Five pairs in batches of two: a request's pairs run in several batches.
    http, worker = reranker(dtype="float32", batch_size=2)
    want = predicted(cross_encoder, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])

    answer = rerank(http, model=rerank_queue).json()
    assert [r["index"] for r in answer["results"]] == order
    for r in answer["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    assert answer["model"] == rerank_queue
    assert answer["id"].startswith("rerank-")
    tokenizer = worker.model.tokenizer
    tokens = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    histogram = worker.stats()["batch_size_histogram"]
    assert max(histogram) <= 2
    assert sum(size * n for size, n in histogram.items()) >= len(DOCUMENTS)

    # /rerank is the same route; top_n, return_documents, documents as objects.
    short = rerank(
        http,
        "/rerank",
        model=rerank_queue,
        documents=[{"text": d} for d in DOCUMENTS],
        top_n=2,
        return_documents=False,
    ).json()
    assert [r["index"] for r in short["results"]] == order[:2]
    assert all("document" not in r for r in short["results"])
    assert len(rerank(http, model=rerank_queue, top_n=99).json()["results"]) == len(DOCUMENTS)


@pytest.mark.slow
def test_the_token_budget_bounds_each_batch_of_pairs(
    reranker: Callable[..., tuple[httpx.Client, Worker]], rerank_queue: str
) -> None:
    budget = 26
    http, worker = reranker(batch_size=8, max_tokens=budget)
    answer = rerank(http, model=rerank_queue)
    assert answer.status_code == 200, answer.text
    shortest = min(len(worker.model.tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    assert max(worker.stats()["batch_size_histogram"]) <= budget // shortest < len(DOCUMENTS)


# -- TEI's /rerank (``texts``), on the same route and at the rerank model's base URL ----------


def tei_rerank(http: httpx.Client, path: str = "/rerank", **body: Any) -> httpx.Response:
    return http.post(path, json={"query": QUERY, "texts": DOCUMENTS, **body})


def test_tei_bodies_batchline_cannot_serve_are_422s_in_tgis_shape_and_nothing_is_queued(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    rclient: redis.Redis,
    rerank_queue: str,
) -> None:
    http = serve(make_app(rerank_queue=rerank_queue, timeout_s=2))  # no worker
    for change, param in [
        ({"raw_scores": True}, "raw_scores"),
        ({"truncate": False}, "truncate"),
        ({"truncation_direction": "Left"}, "truncation_direction"),
        ({"texts": []}, "texts"),
        ({"texts": ["ok", ""]}, "texts"),
        ({"return_text": "yes"}, "return_text"),
        ({"top_n": 2}, "top_n"),  # Cohere's parameter in TEI's body
    ]:
        message = assert_tgi_error(tei_rerank(http, **change), 422, "validation")
        assert message.startswith(param), (change, message)
    assert queued(rclient, QueueKeys(rerank_queue)) == 0
    # Without a rerank queue: TEI's body is TGI's 404, Cohere's stays OpenAI's.
    bare = serve(make_app(timeout_s=2))
    assert "rerank_queue" in assert_tgi_error(tei_rerank(bare), 404, "not_found")
    assert_error(rerank(bare, "/rerank", model="any"), 404, param="model")


@pytest.mark.slow
def test_teis_rerank_ranks_the_texts_like_the_cohere_route(
    reranker: Callable[..., tuple[httpx.Client, Worker]], cross_encoder: str, rerank_queue: str
) -> None:
    http, _worker = reranker(dtype="float32", batch_size=2)
    want = predicted(cross_encoder, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])

    answer = tei_rerank(http).json()
    assert [r["index"] for r in answer] == order
    assert all(set(r) == {"index", "score"} for r in answer)
    for r in answer:
        assert r["score"] == pytest.approx(want[r["index"]], abs=1e-5)
    # return_text; the rerank model's base URL is TEI's /rerank.
    for path in ("/rerank", f"/models/{rerank_queue}"):
        response = tei_rerank(http, path, return_text=True)
        assert response.status_code == 200, (path, response.text)
        texts = response.json()
        assert [(r["index"], r["text"]) for r in texts] == [(i, DOCUMENTS[i]) for i in order]
    # Cohere's body on /rerank is still Cohere's route.
    cohere = rerank(http, "/rerank", model=rerank_queue).json()
    assert [r["index"] for r in cohere["results"]] == order
