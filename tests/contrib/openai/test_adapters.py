"""LoRA adapters through a worker: ``batchline worker --model generate --adapters NAME=PATH
--adapter-dir DIR`` serves the base model and each adapter in one continuous batch; the
HTTP API lists the adapters in ``/v1/models`` and routes by ``model`` (the adapter's name or
``<base>:<adapter>``); a raw producer names one by ``adapter``. Each request's tokens are
the ones the adapter's merged-weights model generates greedily alone (float64: exact)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import huggingface_hub as hf
import openai
import pytest
import redis

from batchline.errors import InferenceError
from batchline.keys import QueueKeys
from batchline.producer import Producer

from ..batches.test_batches import MakeApp, file_lines, finished, jsonl, make_app, upload
from ..test_fastapi import Serve, serve
from .test_openai import client_for
from tests.support.models_for_tests import tiny_llama
from tests.support.service import REPO, WorkerThread, subprocess_env, wait_until
from tests.worker.test_generate import TINY

torch = pytest.importorskip("torch")

from tests.generation.test_lora import merged, save_adapter  # noqa: E402
from tests.support.tiny import alone  # noqa: E402

__all__ = ["make_app", "serve"]  # fixtures, used here

PROMPTS = ["The sea is", "A cat sat on", "Rust and tea", "Paris in the snow at night"]
NEW = 8


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, Path]:
    """Adapters ``a`` (named at start) and ``b``, ``c`` (in the adapter directory)."""
    model, _ = tiny_llama()
    return {
        "a": save_adapter(tmp_path / "named" / "a", model, seed=1),
        "b": save_adapter(tmp_path / "dir" / "b", model, seed=2),
        "c": save_adapter(tmp_path / "dir" / "c", model, seed=3, r=2),
    }


@pytest.fixture
def worker(redis_url: str, queue: str, adapters: dict[str, Path]) -> Iterator[str]:
    """A ``batchline worker`` process serving the generation queue ``<queue>-gen``."""
    gen_queue = f"{queue}-gen"
    command = [
        sys.executable, "-m", "batchline", "worker", "--model", "generate",
        "--model-path", TINY, "--adapters", f"a={adapters['a']}",
        "--adapter-dir", str(adapters["b"].parent), "--max-restarts-per-min", "0",
        "--timeout-ms", "20", "--heartbeat-s", "0.2",
    ]  # fmt: skip
    env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": gen_queue}
    proc = subprocess.Popen(
        command, env=subprocess_env({**env, "BATCHLINE_PREFIX": queue}), cwd=REPO
    )
    client = redis.Redis.from_url(redis_url)
    keys = QueueKeys(gen_queue, prefix=queue)
    try:
        wait_until(lambda: client.exists(keys.facts) or proc.poll() is not None, "the worker")
        assert proc.poll() is None, "the worker exited"
        yield gen_queue
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        client.close()


def expected(adapters: dict[str, Path]) -> dict[tuple[str | None, str], list[int]]:
    """Each prompt's greedy tokens under each adapter's merged model, and the base's."""
    model, tokenizer = tiny_llama()
    models: dict[str | None, Any] = {n: merged(model, f) for n, f in adapters.items()}
    models[None] = model
    return {
        (name, p): alone(m, tokenizer(p)["input_ids"], NEW)
        for name, m in models.items()
        for p in PROMPTS
    }


def raw(redis_url: str, queue: str, worker: str, values: list[Any]) -> list[Any]:
    """The results of ``values`` submitted together by a raw producer."""
    with Producer(redis_url=redis_url, queue=worker, prefix=queue) as producer:
        handles = [producer.submit(v) for v in values]
        return [producer.wait(h, 60) for h in handles]


@pytest.mark.slow
def test_adapters_served_by_name_mixed_in_one_batch(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    worker: str,
    adapters: dict[str, Path],
    redis_url: str,
    queue: str,
) -> None:
    want = expected(adapters)
    assert len({tuple(want[(n, PROMPTS[0])]) for n in ("a", "b", "c", None)}) == 4  # they differ

    # The raw path: every adapter and the base at once (one continuous batch), by ``adapter``.
    plan = [(name, p) for name in ("a", "b", "c", None) for p in PROMPTS]
    values = [{"prompt": p, "adapter": n, "max_new_tokens": NEW} for n, p in plan]
    outputs = [r.unwrap() for r in raw(redis_url, queue, worker, values)]
    for (name, prompt), output in zip(plan, outputs, strict=True):
        assert output["token_ids"] == want[(name, prompt)], (name, prompt)
    text = {key: output["text"] for key, output in zip(plan, outputs, strict=True)}

    # Over HTTP, by ``model``: the adapter's name or <base>:<adapter>, all at once.
    http = serve(make_app(embedding_queue=None, generation_queue=worker))
    client = client_for(http)
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert set(listed) == {worker, "a", "b", "c"}
    assert all(listed[n]["parent"] == worker and listed[n]["kind"] == "generation" for n in "abc")
    assert "parent" not in listed[worker]
    assert client.models.retrieve(f"{worker}:b").model_dump()["parent"] == worker
    calls = [(m, p) for m in ("a", f"{worker}:b", "c", worker) for p in PROMPTS]

    def complete(call: tuple[str, str]) -> str:
        done = client.completions.create(
            model=call[0], prompt=call[1], max_tokens=NEW, temperature=0
        )
        assert done.model == call[0]
        return done.choices[0].text

    with ThreadPoolExecutor(len(calls)) as pool:
        got = list(pool.map(complete, calls))
    for (model, prompt), answer in zip(calls, got, strict=True):
        name = None if model == worker else model.rsplit(":", 1)[-1]
        assert answer == text[(name, prompt)], (model, prompt)

    # A Batch API line and a chat name adapters the same way.
    line = {"model": "c", "prompt": PROMPTS[1], "max_tokens": NEW, "temperature": 0}
    lines = [{"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": line}]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(lines)).id,
        endpoint="/v1/completions",
        completion_window="24h",
    )
    body = file_lines(client, finished(client, batch.id).output_file_id)["1"]["response"]["body"]
    assert (body["model"], body["choices"][0]["text"]) == ("c", text[("c", PROMPTS[1])])
    chat = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=NEW, temperature=0
    )
    assert chat.model == "b"
    messages = [{"role": "user", "content": "hi"}]
    reply = http.post("/v1/messages", json={"model": "b", "max_tokens": NEW, "messages": messages})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "b"
    response = client.responses.create(model="c", input=PROMPTS[1], max_output_tokens=NEW)
    assert (response.model, response.status) == ("c", "incomplete")  # max_output_tokens
    assert client.responses.retrieve(response.id).output_text == response.output_text
    assert (
        http.post(
            "/v1/messages", json={"model": "z", "max_tokens": 2, "messages": messages}
        ).status_code
        == 404
    )

    # TGI's routes take adapter_id, as TGI does (huggingface_hub's client sends it).
    tgi = hf.InferenceClient(base_url=f"{str(http.base_url).rstrip('/')}/models/{worker}")
    said = tgi.text_generation(PROMPTS[2], max_new_tokens=NEW, adapter_id="b")
    assert said == text[("b", PROMPTS[2])]
    streamed = tgi.text_generation(PROMPTS[2], max_new_tokens=NEW, adapter_id="b", stream=True)
    assert "".join(streamed) == said
    refused = http.post(
        f"/models/{worker}", json={"inputs": "x", "parameters": {"adapter_id": "nope"}}
    )
    assert refused.status_code == 422
    assert refused.json()["error"].startswith("parameters.adapter_id:")

    # An adapter that is not served is a 404 before anything is queued.
    for wrong in ("nope", f"{worker}:nope", "other:a"):
        with pytest.raises(openai.NotFoundError, match="model"):
            client.completions.create(model=wrong, prompt="x", max_tokens=2)


@pytest.mark.slow
def test_an_adapter_added_to_the_directory_is_listed_and_served(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    worker: str,
    adapters: dict[str, Path],
    redis_url: str,
    queue: str,
) -> None:
    client = client_for(serve(make_app(embedding_queue=None, generation_queue=worker)))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="d", prompt=PROMPTS[0], max_tokens=NEW)
    model, tokenizer = tiny_llama()
    folder = save_adapter(adapters["b"].parent / "d", model, seed=4)
    wait_until(lambda: "d" in {m.id for m in client.models.list()}, "the new adapter to be listed")
    done = client.completions.create(model="d", prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
    (result,) = raw(
        redis_url, queue, worker, [{"prompt": PROMPTS[0], "adapter": "d", "max_new_tokens": NEW}]
    )
    output = result.unwrap()
    assert output["text"] == done.choices[0].text
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert output["token_ids"] == alone(merged(model, folder), ids, NEW)


@pytest.mark.slow
def test_a_bad_adapter_fails_its_request_alone(
    worker: str, adapters: dict[str, Path], redis_url: str, queue: str
) -> None:
    want = expected(adapters)
    bad = adapters["b"].parent / "bad"  # a .bin adapter: refused, never unpickled
    save_adapter(bad, tiny_llama()[0], seed=5)
    (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    values: list[Any] = [
        {"prompt": PROMPTS[0], "adapter": "a", "max_new_tokens": NEW},
        {"prompt": PROMPTS[0], "adapter": "missing", "max_new_tokens": NEW},
        {"prompt": PROMPTS[0], "adapter": 7, "max_new_tokens": NEW},
        {"prompt": PROMPTS[0], "adapter": "bad", "max_new_tokens": NEW},
        {"prompt": PROMPTS[0], "max_new_tokens": NEW},
    ]
    results = raw(redis_url, queue, worker, values)
    assert results[0].unwrap()["token_ids"] == want[("a", PROMPTS[0])]
    for result, error_type in zip(
        results[1:4], ("UnknownAdapter", "BadGenerationParams", "AdapterError"), strict=True
    ):
        with pytest.raises(InferenceError) as caught:
            result.unwrap()
        assert caught.value.error_type == error_type
    assert results[4].unwrap()["token_ids"] == want[(None, PROMPTS[0])]


@pytest.mark.slow
def test_the_docs_example_names_an_adapter(
    make_app: MakeApp,
    serve: Serve,  # noqa: F811
    start_worker: Callable[..., WorkerThread],
    queue: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, _ = tiny_llama()
    sql = save_adapter(tmp_path / "sql", model, seed=1)
    chat = save_adapter(tmp_path / "chat", model, seed=2)
    start_worker(
        "generate",
        model_path=TINY,
        queue="generate",
        prefix=queue,
        adapters=f"sql={sql},chat={chat}",
    )
    http = serve(make_app(embedding_queue=None, generation_queue="generate"))
    page = (REPO / "docs" / "generation.md").read_text()
    found = re.search(
        r"test_the_docs_example_names_an_adapter -->\n```python\n(.*?)```", page, re.S
    )
    assert found is not None
    code = found.group(1).replace("http://localhost:8000", str(http.base_url).rstrip("/"))
    exec(compile(code, "docs/generation.md", "exec"), {})  # the page's own example
    listed, answer = capsys.readouterr().out.splitlines()
    assert listed == "['generate', 'chat', 'sql']"
    assert answer.startswith("sql '")
