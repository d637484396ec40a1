"""``logprobs`` / ``top_logprobs`` and ``n`` through the official client, uvicorn, Redis and
a real generation worker (a tiny random Llama in float64), against the in-process generator
on the same weights."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest

from ..test_fastapi import Serve, serve
from .test_openai import MakeApp, client_for, gen_queue, make_app, workers
from tests.generation.test_engine import forward_widths
from tests.support import web_models
from tests.support.service import WorkerThread
from tests.worker.test_generate import CHAT, TINY, reference

openai = pytest.importorskip("openai")

__all__ = ["gen_queue", "make_app", "reference", "serve", "workers"]  # fixtures, used here

PROMPT = "Once upon a time"


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=0, abs_tol=1e-9)


def check_against(expected: Any, entries: list[Any], top: int) -> None:
    """The API's chat logprobs entries against the in-process result's."""
    assert expected.logprobs is not None
    assert len(entries) == len(expected.token_ids) == len(expected.logprobs)
    for entry, want in zip(entries, expected.logprobs, strict=True):
        assert close(entry.logprob, want.logprob)
        assert len(entry.top_logprobs) == top
        assert all(
            close(a.logprob, w) for a, (_, w) in zip(entry.top_logprobs, want.top, strict=True)
        )
        try:
            assert bytes(entry.bytes).decode() == entry.token
        except UnicodeDecodeError:  # a piece of a character
            assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)


@pytest.mark.slow
def test_chat_logprobs_whole_and_streamed_are_the_engines(
    make_app: MakeApp,
    serve: Serve,
    workers: Callable[..., None],
    gen_queue: str,
    reference: Any,
) -> None:
    workers()
    client = client_for(serve(make_app()))
    expected = reference.generate(messages=CHAT, max_new_tokens=12, logprobs=5)

    answer = client.chat.completions.create(
        model=gen_queue, messages=CHAT, max_tokens=12, logprobs=True, top_logprobs=5
    )
    content = answer.choices[0].logprobs.content
    check_against(expected, content, 5)
    shown = "".join(e.token for e in content)
    assert shown.startswith(answer.choices[0].message.content)  # (an EOS token: its own text)
    for entry in content:  # greedy: the token taken is the likeliest
        assert entry.top_logprobs[0].token == entry.token

    streamed = client.chat.completions.create(
        model=gen_queue,
        messages=CHAT,
        max_tokens=12,
        logprobs=True,
        top_logprobs=5,
        stream=True,
    )
    entries = [
        e
        for chunk in streamed
        for c in chunk.choices
        for e in (c.logprobs.content if c.logprobs else [])
    ]
    check_against(expected, entries, 5)

    plain = client.chat.completions.create(model=gen_queue, messages=CHAT, max_tokens=3)
    assert plain.choices[0].logprobs is None
    only = client.chat.completions.create(
        model=gen_queue, messages=CHAT, max_tokens=3, logprobs=True
    )
    assert only.choices[0].logprobs.content[0].top_logprobs == []


@pytest.mark.slow
def test_completion_logprobs_in_the_legacy_shape(
    make_app: MakeApp,
    serve: Serve,
    workers: Callable[..., None],
    gen_queue: str,
    reference: Any,
) -> None:
    workers()
    client = client_for(serve(make_app()))
    expected = reference.generate(PROMPT, max_new_tokens=10, logprobs=3)
    answer = client.completions.create(model=gen_queue, prompt=PROMPT, max_tokens=10, logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert all(
        close(a, w.logprob) for a, w in zip(logprobs.token_logprobs, expected.logprobs, strict=True)
    )
    assert all(  # 3 alternatives, the token's own among them (some may look alike: one key)
        1 <= len(top) <= 4 and top[t] == lp
        for top, t, lp in zip(
            logprobs.top_logprobs, logprobs.tokens, logprobs.token_logprobs, strict=True
        )
    )
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets

    streamed = client.completions.create(
        model=gen_queue, prompt=PROMPT, max_tokens=10, logprobs=3, stream=True
    )
    pieces = [c.logprobs for chunk in streamed for c in chunk.choices if c.logprobs]
    assert [t for p in pieces for t in p.tokens] == logprobs.tokens
    assert [o for p in pieces for o in p.text_offset] == logprobs.text_offset


@pytest.mark.slow
def test_n_choices_whole_and_streamed(
    make_app: MakeApp,
    serve: Serve,
    workers: Callable[..., None],
    gen_queue: str,
    reference: Any,
) -> None:
    workers()
    client = client_for(serve(make_app()))
    greedy = client.chat.completions.create(model=gen_queue, messages=CHAT, max_tokens=8, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    one = reference.generate(messages=CHAT, max_new_tokens=8)
    assert {c.message.content for c in greedy.choices} == {one.text}  # greedy: all equal
    assert greedy.usage.prompt_tokens == one.prompt_tokens  # the prompt counted once
    assert greedy.usage.completion_tokens == 3 * len(one.token_ids)

    sampled = client.completions.create(
        model=gen_queue, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=11
    )
    for i, choice in enumerate(sampled.choices):  # choice i samples with seed + i
        alone = reference.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=11 + i)
        assert choice.text == alone.text

    streamed = client.completions.create(
        model=gen_queue,
        prompt=PROMPT,
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", ""]
    ends: list[int] = []
    usage = None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                ends.append(c.index)
        usage = chunk.usage or usage
    assert texts == [c.text for c in sampled.choices]
    assert sorted(ends) == [0, 1]
    assert usage is not None
    assert usage.completion_tokens == sampled.usage.completion_tokens


@pytest.mark.slow
def test_n_and_logprobs_refusals_name_their_parameter(
    make_app: MakeApp,
    serve: Serve,
    workers: Callable[..., None],
    gen_queue: str,
) -> None:
    workers()
    http = serve(make_app())
    chat = {"model": gen_queue, "messages": CHAT}
    for body, param in [
        ({"n": 17}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ]:
        response = http.post("/v1/chat/completions", json={**chat, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    response = http.post(
        "/v1/completions", json={"model": gen_queue, "prompt": "x", "logprobs": 21}
    )
    assert (response.status_code, response.json()["error"]["param"]) == (400, "logprobs")
    assert json.loads(response.text)["error"]["type"] == "invalid_request_error"


def test_a_piece_of_a_character_shows_its_bytes_and_offsets_count_characters() -> None:
    from batchline.contrib.openai._schema import chat_logprobs, completion_logprobs

    # "é" is two bytes, generated as two tokens; then "x".
    entries = [
        [-0.5, [0xC3], [[7, -0.5, [0xC3]], [8, -1.0, "a"]]],
        [-0.25, [0xA9], []],
        [-0.125, "x", [[9, -0.125, "x"]]],
    ]
    chat = chat_logprobs(entries)
    assert chat is not None
    first = chat["content"][0]
    assert (first["token"], first["bytes"]) == ("bytes:\\xc3", [0xC3])
    assert first["top_logprobs"][1] == {"token": "a", "logprob": -1.0, "bytes": [97]}
    legacy = completion_logprobs(entries, before=b"ab")
    assert legacy is not None
    assert legacy["tokens"] == ["bytes:\\xc3", "bytes:\\xa9", "x"]
    assert legacy["text_offset"] == [2, 2, 3]  # inside "é" the offset stays at its start
    assert legacy["top_logprobs"][1] == {"bytes:\\xa9": -0.25}  # the token's own, always
    assert chat_logprobs(None) is None
    assert completion_logprobs(None) is None


@pytest.mark.slow
def test_n_choices_reach_the_worker_together_and_share_one_prefill(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,
) -> None:
    worker = start_worker("generate", model_path=TINY, queue=gen_queue, prefix_cache_tokens=0)
    client = client_for(serve(make_app()))
    widths = forward_widths(worker.worker.model.engine.model)  # type: ignore[attr-defined]
    prompt = "A prompt that no other request sends"
    answer = client.completions.create(model=gen_queue, prompt=prompt, max_tokens=4, n=4)
    assert len({c.text for c in answer.choices}) == 1
    prefills = [rows for rows, tokens in widths if tokens > 1]
    assert prefills == [1]  # the four choices' prompt, fed once
    assert (4, 1) in widths  # then four rows decode


@pytest.mark.slow
def test_logprobs_that_do_not_match_their_tokens_are_a_500_not_a_wrong_answer(
    make_app: MakeApp,
    serve: Serve,
    start_worker: Callable[..., WorkerThread],
    gen_queue: str,
) -> None:
    start_worker(f"{web_models.__name__}:generation_bad_logprobs", queue=gen_queue)
    client = client_for(serve(make_app()))
    with pytest.raises(openai.InternalServerError, match="not an array of 2 entries"):
        client.chat.completions.create(model=gen_queue, messages=CHAT, logprobs=True)
    with pytest.raises(openai.InternalServerError, match="not an array of 2 entries"):
        # The worker streams nothing: its one answer comes first, an HTTP error.
        client.chat.completions.create(model=gen_queue, messages=CHAT, logprobs=True, stream=True)
