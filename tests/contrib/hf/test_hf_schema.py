"""The bodies of Hugging Face's native routes (batchline.contrib.hf._schema), without a
server: what a TGI request asks the worker for, each token's text from a stream's chunks,
and TEI's vectors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from batchline.contrib.hf._schema import TEIEmbedRequest, TGIRequest, Token, TokenTexts, vectors
from batchline.producer import StreamChunk


def wire(**parameters: Any) -> dict[str, Any]:
    return TGIRequest.model_validate({"inputs": "x", "parameters": parameters}).wire()


def test_sampling_follows_tgis_rule() -> None:
    # Greedy unless do_sample or a parameter that changes the distribution, whatever the
    # worker's defaults; sampling at temperature 1 unless told.
    assert wire() == {"prompt": "x", "temperature": 0.0}
    assert wire(temperature=1.0, top_p=1.0, seed=3) == {"prompt": "x", "temperature": 0.0}
    assert wire(do_sample=True, seed=3) == {"prompt": "x", "temperature": 1.0, "seed": 3}
    assert wire(top_k=5) == {"prompt": "x", "temperature": 1.0, "top_k": 5}
    assert wire(top_p=0.9, temperature=0.7, max_new_tokens=4, stop=["\n"]) == {
        "prompt": "x",
        "max_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["\n"],
    }
    sampled = TGIRequest.model_validate({"inputs": "x", "parameters": {"top_k": 2, "seed": 9}})
    assert sampled.seed == 9
    greedy = TGIRequest.model_validate({"inputs": "x", "parameters": {"seed": 9}})
    assert greedy.seed is None  # details name the seed of a sampled request only


@pytest.mark.parametrize(
    ("name", "value"),
    [("best_of", 2), ("watermark", True), ("typical_p", 0.9), ("grammar", {}), ("top_k", 0)],
)
def test_parameters_batchline_lacks_are_refused_by_name(name: str, value: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        TGIRequest.model_validate({"inputs": "x", "parameters": {name: value}})
    assert caught.value.errors()[0]["loc"][:2] == ("parameters", name)


def chunk(text: str, *ids: int, result: dict[str, Any] | None = None) -> StreamChunk:
    return StreamChunk(text, list(ids), 0, None, result)


def test_a_chunks_text_goes_with_its_last_token_and_late_text_with_the_one_before() -> None:
    tokens = TokenTexts()
    assert tokens.take(chunk("Ü", 195, 156)) == [Token(195, "")]  # the last token is held
    assert tokens.take(chunk("", 98)) == [Token(156, "Ü")]
    assert tokens.take(chunk("ber")) == []  # text without a token: the held one's
    assert tokens.take(chunk("", 101, result={})) == [Token(98, "ber")]
    assert tokens.last() == Token(101, "")
    empty = TokenTexts()
    empty.take(chunk("", result={}))
    assert empty.last() == Token(0, "")


def test_a_tokens_logprob_goes_with_it_and_a_piece_of_a_character_shows_as_u_fffd() -> None:
    tokens = TokenTexts()
    first = [-0.5, [0xC3], [[7, -0.5, [0xC3]], [8, -1.0, "a"]]]
    second = [-0.25, [0xA9], []]
    got = tokens.take(StreamChunk("", [7, 9], 0, logprobs=[first, second]))
    assert got == [Token(7, "", first)]
    assert got[0].body() == {"id": 7, "text": "", "logprob": -0.5, "special": False}
    assert got[0].top() == [
        {"id": 7, "text": "\ufffd", "logprob": -0.5, "special": False},
        {"id": 8, "text": "a", "logprob": -1.0, "special": False},
    ]
    tokens.take(StreamChunk("é", [], 2))
    assert tokens.last() == Token(9, "é", second)
    assert Token(1, "x").body()["logprob"] is None
    assert Token(1, "x").top() is None


def test_tei_vectors_are_normalized_unless_told() -> None:
    output = np.asarray([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    assert vectors(output, 2, normalize=True) == [[0.6000000238418579, 0.800000011920929], [0, 0]]
    assert vectors(output, 2, normalize=False) == [[3.0, 4.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="for 3 texts"):
        vectors(output, 3, normalize=True)
    assert TEIEmbedRequest.model_validate({"inputs": "a", "truncate": True}).texts == ["a"]
    with pytest.raises(ValidationError, match="truncate"):
        TEIEmbedRequest.model_validate({"inputs": "a", "truncate": False})
