"""Text generation on a continuous-batching scheduler, in process.

``Generator`` (asyncio) and ``SyncGenerator`` (threads) run a causal LM over one batch that
requests join and leave between decode steps (``batchline.core.scheduler`` decides who joins);
the default model is SmolLM2-135M-Instruct from the ``generate`` extra::

    async with Generator() as gen:
        result = await gen.generate(messages=[{"role": "user", "content": "Hi"}])
        async for delta in gen.stream("Once upon a time", max_new_tokens=32):
            print(delta.text, end="")
"""

from batchline.generation._engine import Engine, StepOutput
from batchline.generation._generators import GenerationOptions, Generator, SyncGenerator
from batchline.generation._loop import GenerationLoop
from batchline.generation._model import DEFAULT_MODEL, load_causal_lm
from batchline.generation._types import (
    FinishReason,
    GenerationDelta,
    GenerationParams,
    GenerationResult,
)

__all__ = [
    "DEFAULT_MODEL",
    "Engine",
    "FinishReason",
    "GenerationDelta",
    "GenerationLoop",
    "GenerationOptions",
    "GenerationParams",
    "GenerationResult",
    "Generator",
    "StepOutput",
    "SyncGenerator",
    "load_causal_lm",
]
