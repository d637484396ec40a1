"""``POST /tokenize`` and ``/detokenize`` (vLLM's shapes), end to end over uvicorn, Redis and
real workers, with raw HTTP (the ``openai`` client has no method for them).

The worker tokenizes with its model's own tokenizer (docs/protocol.md, Tokenize and
detokenize): the answers are compared with that tokenizer called directly. The app runs no
tokenizer: a test runs it in a process of its own and checks that torch never loads there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from batchline.keys import QueueKeys

from ..test_fastapi import Serve, serve
from .test_openai import MakeApp, assert_error, gen_queue, make_app
from .test_openai_embeddings import idle_app, publish
from tests.support import web_models
from tests.support.app_process import app_in_process
from tests.support.models_for_tests import ByteTokenizer
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, queued, subprocess_env
from tests.worker.test_generate import CHAT, TINY

__all__ = ["gen_queue", "idle_app", "make_app", "serve"]  # fixtures, used here

#: (the body's change, the parameter the 400 names).
BAD_TOKENIZE: list[tuple[dict[str, Any], str]] = [
    ({}, "prompt"),  # neither prompt nor messages
    ({"prompt": "x", "messages": CHAT}, "prompt"),  # both
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x" * 20_001}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.[0].role"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ({"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ({"prompt": "x", "return_token_strs": True}, "return_token_strs"),
    ({"prompt": "x", "model": 5}, "model"),
]
BAD_DETOKENIZE: list[tuple[dict[str, Any], str]] = [
    ({}, "tokens"),
    ({"tokens": "1 2"}, "tokens"),
    ({"tokens": [1, -1]}, "tokens.[1]"),
    ({"tokens": [1, 2**31]}, "tokens.[1]"),
    ({"tokens": [1.0]}, "tokens.[0]"),
    ({"tokens": [1], "other": 1}, "other"),
]


def test_bad_bodies_are_400s_naming_the_parameter_and_nothing_is_queued(
    idle_app: httpx.Client, rclient: redis.Redis, keys: QueueKeys, queue: str
) -> None:
    http = idle_app
    publish(rclient, keys)  # the embedding queue's facts: it tokenizes
    wrong = []
    for path, cases in (("/tokenize", BAD_TOKENIZE), ("/detokenize", BAD_DETOKENIZE)):
        for change, param in cases:
            response = http.post(path, json={"model": queue, **change})
            try:
                assert_error(response, 400, param=param, type="invalid_request_error")
            except AssertionError as exc:
                wrong.append(f"{path} {change}: {exc}")
    assert not wrong, "\n".join(wrong)
    assert_error(http.post("/tokenize", content="{", headers={"Content-Type": "x"}), 400)
    error = assert_error(
        http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}), 404, param="model"
    )
    assert error["code"] == "model_not_found"
    publish(rclient, keys, tokenize=False)  # a module:callable model has no tokenizer
    assert_error(http.post("/tokenize", json={"model": queue, "prompt": "x"}), 400, param="model")
    rclient.delete(keys.facts)  # no worker: nothing says whether it tokenizes
    response = http.post("/detokenize", json={"model": queue, "tokens": [1]})
    assert_error(response, 503, code="service_unavailable")
    assert response.headers["Retry-After"]
    assert queued(rclient, keys) == 0


def test_a_body_over_the_limit_is_a_413_in_openais_shape(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    queue: str,
) -> None:
    http = serve(make_app(max_body_bytes=1000))
    response = http.post("/tokenize", json={"model": queue, "prompt": "x" * 2000})
    assert_error(response, 413)


@pytest.fixture
def tokenizers(start_worker: Callable[..., WorkerThread], gen_queue: str) -> dict[str, Any]:
    """A sentence-transformers worker (all-MiniLM-L6-v2, a Hugging Face tokenizer) on the
    embedding queue and the tiny Llama (a byte tokenizer) on the generation queue: each
    queue's tokenizer."""
    minilm = start_worker("sentence-transformers", device="cpu").worker.model
    start_worker("generate", model_path=TINY, queue=gen_queue)
    return {"minilm": minilm.tokenizer, "llama": ByteTokenizer()}


def post(http: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.slow
def test_every_served_model_tokenizes_with_its_own_tokenizer(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    tokenizers: dict[str, Any],
    queue: str,
    gen_queue: str,  # noqa: F811
) -> None:
    http = serve(make_app())
    text = "Tokenize me, héllo"
    for model, tokenizer, limit in [
        (queue, tokenizers["minilm"], 256),
        (gen_queue, tokenizers["llama"], 512),
    ]:
        ids = [int(i) for i in tokenizer(text)["input_ids"]]
        got = post(http, "/tokenize", model=model, prompt=text)
        assert got == {"count": len(ids), "max_model_len": limit, "tokens": ids}
        bare = post(http, "/tokenize", model=model, prompt=text, add_special_tokens=False)
        assert bare["tokens"] == [
            int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]
        ]
        back = post(http, "/detokenize", model=model, tokens=bare["tokens"])["prompt"]
        assert back == tokenizer.decode(bare["tokens"], skip_special_tokens=False)
        assert back.lower().startswith("tokenize me, h")  # (MiniLM is uncased)
    # Chat messages through the generation model's chat template, as generating renders them.
    chat = post(http, "/tokenize", model=gen_queue, messages=CHAT)
    assert chat["tokens"] == tokenizers["llama"].apply_chat_template(CHAT)
    # No truncation: a text longer than the model takes is counted whole.
    long = post(http, "/tokenize", model=queue, prompt="word " * 400)
    assert long["count"] > long["max_model_len"] == 256
    # What the worker refuses names the parameter: an id outside the vocabulary.
    response = http.post("/detokenize", json={"model": queue, "tokens": [1, 10**9]})
    error = assert_error(response, 400, param="tokens")
    assert "tokens[1]" in error["message"]


@pytest.mark.slow
def test_the_app_never_imports_torch(
    redis_url: str,
    start_worker: Callable[..., WorkerThread],
    queue: str,
    gen_queue: str,  # noqa: F811
) -> None:
    start_worker(f"{web_models.__name__}:embed")  # a batch function: no tokenizer
    start_worker("generate", model_path=TINY, queue=gen_queue)
    env = subprocess_env(
        {
            "BATCHLINE_REDIS_URL": redis_url,
            "BATCHLINE_QUEUE": queue,
            "BATCHLINE_EMBEDDING_QUEUE": queue,
            "BATCHLINE_GENERATION_QUEUE": gen_queue,
        }
    )
    with app_in_process(env) as (proc, url):
        assert proc.stdin is not None
        assert proc.stdout is not None
        with httpx.Client(base_url=url, timeout=RESULT_TIMEOUT_S) as http:
            tokens = post(http, "/tokenize", model=gen_queue, messages=CHAT)["tokens"]
            assert post(http, "/detokenize", model=gen_queue, tokens=tokens)["prompt"]
            post(http, "/v1/embeddings", model=queue, input="x")
            post(http, "/v1/chat/completions", model=gen_queue, messages=CHAT, max_tokens=2)
        proc.stdin.write("check\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == []
