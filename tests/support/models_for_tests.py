"""Batch functions for the service tests, served as ``module:callable`` by workers.

Workers in subprocesses import this module by name, so it has no test-only imports. Their
behaviour is steered by environment variables (not ``BATCHLINE_*``, which the settings
reject as unknown):

- ``BLTEST_RECORD_FILE``: ``record_batches``, ``slow``, ``crash``, ``abort``, ``hang`` and
  ``async_hang`` append each batch they are given to this file, one JSON list per line,
  before doing anything else with it;
- ``BLTEST_SLOW_S``: how long ``slow`` sleeps per batch; ``BLTEST_HANG_S``: how long
  ``hang`` and ``async_hang`` hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from batchline.worker import Prepared

CRASH_EXIT_CODE = 77


def _record(items: list[Any]) -> None:
    path = os.environ.get("BLTEST_RECORD_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(items, default=repr) + "\n")


def read_batches(path: Path) -> list[list[Any]]:
    """The batches recorded in ``path`` so far (none if it does not exist yet)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    # The last line may be half written by a process still running: keep whole lines only.
    return [json.loads(line) for line in lines if line.endswith("]")]


def echo(items: list[Any]) -> list[Any]:
    return items


def double(items: list[Any]) -> list[Any]:
    return [x * 2 for x in items]


def poison(items: list[Any]) -> list[Any]:
    """Raises ValueError for any batch holding "poison"; echoes the rest."""
    if "poison" in items:
        raise ValueError("poisoned input")
    return items


def record_batches(items: list[Any]) -> list[Any]:
    _record(items)
    return items


def slow(items: list[Any]) -> list[Any]:
    _record(items)
    time.sleep(float(os.environ.get("BLTEST_SLOW_S", "0")))
    return items


def slow_double(items: list[Any]) -> list[Any]:
    """``double``, recorded and slowed as ``slow`` is."""
    _record(items)
    time.sleep(float(os.environ.get("BLTEST_SLOW_S", "0")))
    return [x * 2 for x in items]


def timed(items: list[Any]) -> list[Any]:
    """Sleeps ``BLTEST_SLOW_S``, then records ``[start, end, *items]`` (monotonic clock)."""
    start = time.monotonic()
    time.sleep(float(os.environ.get("BLTEST_SLOW_S", "0")))
    _record([start, time.monotonic(), *items])
    return items


def crash(items: list[Any]) -> list[Any]:
    """Kills its whole process (no clean-up at all) when a batch holds "crash"."""
    _record(items)
    if "crash" in items:
        os._exit(CRASH_EXIT_CODE)
    return items


def wrong_length(items: list[Any]) -> list[Any]:
    return items[:-1]


def not_serializable(items: list[Any]) -> list[Any]:
    return [object() for _ in items]


class GatedModel:
    """A Model (the worker's protocol) that holds every batch until the test opens the gate.

    For workers running in the test process: ``entered`` is set when a batch reaches the
    model, which then waits for ``release`` (bounded, so a failing test cannot hang it).
    """

    heavy_preprocess = False

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any]] = echo) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[list[Any]] = []

    def load(self) -> None:
        return None

    def preprocess(self, value: Any) -> list[Prepared]:
        return [Prepared(value)]

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        self.batches.append(list(batch))
        self.entered.set()
        if not self.release.wait(60):
            raise TimeoutError("the test never opened the gate")
        return self.fn(batch)

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return outputs[0]


class HeavyEcho(GatedModel):
    """Echoes, its preprocessing declared heavy (the worker prepares on threads, as for a
    tokenizer model), its gate open."""

    heavy_preprocess = True

    def __init__(self) -> None:
        super().__init__()
        self.release.set()


class HangsOn:
    """A Model that echoes, except that a batch holding ``bad`` waits for ``release``
    (bounded, so a failing test cannot hang it): a hang on one input, for workers in the test
    process. It has an ``example``, so the worker times a warm-up batch when it starts;
    ``threads`` names the thread each hanging batch ran on."""

    heavy_preprocess = False
    example = "warm-up"

    def __init__(self, bad: str = "hang") -> None:
        self.bad = bad
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def load(self) -> None:
        return None

    def preprocess(self, value: Any) -> list[Prepared]:
        return [Prepared(value)]

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        if self.bad in batch:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            if not self.release.wait(120):
                raise TimeoutError("the test never opened the gate")
        return list(batch)

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return outputs[0]


def abort(items: list[Any]) -> list[Any]:
    """Aborts its whole process (SIGABRT, as a crash in native code would) when a batch holds
    "abort"; echoes the rest."""
    _record(items)
    if "abort" in items:
        os.abort()
    return items


def hang(items: list[Any]) -> list[Any]:
    """Never returns (well, after ``BLTEST_HANG_S``, default 600 s) when a batch holds
    "hang"; echoes the rest. Its ``example`` gives the worker a warm-up batch to time."""
    _record(items)
    if "hang" in items:
        time.sleep(float(os.environ.get("BLTEST_HANG_S", "600")))
    return items


hang.example = "warm-up"  # type: ignore[attr-defined]


async def async_hang(items: list[Any]) -> list[Any]:
    """``hang`` as a coroutine function: awaits (on the worker's event loop, which stays
    free) for ``BLTEST_HANG_S`` when a batch holds "hang"."""
    _record(items)
    if "hang" in items:
        await asyncio.sleep(float(os.environ.get("BLTEST_HANG_S", "600")))
    return items


async_hang.example = "warm-up"  # type: ignore[attr-defined]

#: How long each call of ``async_nap`` awaits.
NAP_S = 0.2


async def async_nap(items: list[Any]) -> list[Any]:
    """A coroutine function that awaits :data:`NAP_S`, then echoes; it has an ``example``."""
    await asyncio.sleep(NAP_S)
    return items


async_nap.example = "warm-up"  # type: ignore[attr-defined]


def hang_warming(items: list[Any]) -> list[Any]:
    """``hang``, whose warm-up batch (the worker's, at start) is the one that hangs."""
    _record(items)
    if "warm-up" in items:
        time.sleep(float(os.environ.get("BLTEST_HANG_S", "600")))
    return items


hang_warming.example = "warm-up"  # type: ignore[attr-defined]


def double_or_die(items: list[Any]) -> list[Any]:
    """``double``, except that a batch holding "crash" aborts the process and one holding
    "hang" never returns (checks.chaos's hostile inputs)."""
    if "crash" in items:
        os.abort()
    if "hang" in items:
        threading.Event().wait()
    return [x * 2 for x in items]


# -- generation: a tiny random Llama and a byte tokenizer (no download) ------------------------


class ByteTokenizer:
    """Token ``4 + b`` for each UTF-8 byte ``b``; 0 pads, 1 begins, 3 ends a sequence.

    What the generation engine asks of a tokenizer: encoding a prompt, a chat template,
    decoding. Enough to run a tiny random model end to end without a download.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 3
    vocab_size = 260

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [4 + b for b in text.encode()]
        return {"input_ids": [self.bos_token_id, *ids] if add_special_tokens else ids}

    def apply_chat_template(self, messages: list[dict[str, str]], **_options: Any) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self(text)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - 4 for i in ids if i >= 4)
        return data.decode("utf-8", "replace")


#: The layers of the tiny random models (this module's Llama, tests/support/tiny.py's).
TINY_LAYERS = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def tiny_llama(dtype: str = "float64") -> tuple[Any, ByteTokenizer]:
    """A 2-layer Llama with random weights (seed 0) and a byte tokenizer; float64 by default
    so that padding numerics never flip a greedy choice.

    ``BLTEST_STEP_S`` makes every forward pass sleep that long (a slow model);
    ``BLTEST_RECORD_FILE`` gets one line per forward pass (``["step"]``)."""
    import torch
    import transformers

    torch.manual_seed(0)
    tok = ByteTokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        **TINY_LAYERS,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    step_s = float(os.environ.get("BLTEST_STEP_S", "0"))
    if step_s or os.environ.get("BLTEST_RECORD_FILE"):

        def slow(_module: Any, _args: Any) -> None:
            _record(["step"])
            time.sleep(step_s)

        model.register_forward_pre_hook(slow)
    return model, tok


def char_tokenizer(*, newline: bool = False) -> Any:
    """A fast Hugging Face tokenizer of 97 tokens, one character each (ids 0-3: pad, bos, unk,
    EOS; then space and printable ASCII but for ` and ~): enough to write any JSON, so a tiny
    random model's constrained output (response_format) is all the mask's work. ``newline``:
    a 98th token, the newline (a tool call's wire format has some), and a chat template that
    renders tools (briefly: a tiny model's context is short)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3}
    for c in ["Ġ"] + [chr(i) for i in range(33, 127) if chr(i) not in "`~"]:  # Ġ: the space
        vocab[c] = len(vocab)
    if newline:
        vocab["Ċ"] = len(vocab)  # (byte-level's newline)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    if newline:
        tokenizer.chat_template = (
            "{% if tools %}T{{ tools | length }}{% endif %}{% for m in messages %}"
            "{{ m['role'][0] }}{{ m['content'] }}{% for c in m.get('tool_calls', []) %}"
            "{{ c['function']['name'] }}{% endfor %}\n{% endfor %}"
        )
    return tokenizer


def tiny_llama_tools() -> tuple[Any, Any]:
    """:func:`tiny_llama_chars` with the newline in its tokenizer (:func:`char_tokenizer`'s
    ``newline``): function tools' calls, constrained, all the mask's work."""
    return tiny_llama_chars(newline=True)


def tiny_llama_chars(*, newline: bool = False) -> tuple[Any, Any]:
    """A 2-layer Llama with random weights (seed 0, float64) and :func:`char_tokenizer`:
    a fast tokenizer, as constrained decoding needs."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=98 if newline else 97,
        **TINY_LAYERS,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=3,
        bos_token_id=1,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float64).eval()
    return model, char_tokenizer(newline=newline)


def tiny_llama_poisoned() -> tuple[Any, ByteTokenizer]:
    """:func:`tiny_llama` whose forward raises ValueError when it is fed a ``~`` (a hostile
    request: its prefill raises, whatever runs beside it)."""
    model, tok = tiny_llama()
    poison = tok("~", add_special_tokens=False)["input_ids"][0]

    def check(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        if bool((kwargs["input_ids"] == poison).any()):
            raise ValueError("poison token")

    model.register_forward_pre_hook(check, with_kwargs=True)
    return model, tok


class StepGate:
    """Lets forward passes of a model through one permit at a time (for in-process workers).

    Open (the default) lets everything through; :meth:`close` then :meth:`allow` counts
    permits; ``passes`` counts forward passes that went through. Waits are bounded.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.permits: int | None = None
        self.passes = 0

    def hook(self, _module: Any, _args: Any) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.permits != 0, timeout=60):
                raise TimeoutError("the test never let the step through")
            if self.permits is not None:
                self.permits -= 1
            self.passes += 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.permits = 0

    def allow(self, n: int) -> None:
        with self.cond:
            self.permits = (self.permits or 0) + n
            self.cond.notify_all()

    def open(self) -> None:
        with self.cond:
            self.permits = None
            self.cond.notify_all()

    def wait_passes(self, n: int, timeout_s: float = 60) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.passes >= n, timeout=timeout_s):
                raise AssertionError(f"only {self.passes} of {n} forward passes in {timeout_s} s")


GATE = StepGate()


def tiny_llama_gated() -> tuple[Any, ByteTokenizer]:
    """:func:`tiny_llama` whose forward passes go through :data:`GATE`."""
    model, tok = tiny_llama()
    model.register_forward_pre_hook(GATE.hook)
    return model, tok


#: Holds :func:`held_failing_lm` inside its load until set (for in-process workers).
LOAD_RELEASE = threading.Event()
#: Set once :func:`held_failing_lm` is inside its load.
LOAD_ENTERED = threading.Event()


def held_failing_lm() -> tuple[Any, Any]:
    """A generation model's ``module:callable`` whose load waits for :data:`LOAD_RELEASE`
    (bounded), then fails."""
    LOAD_ENTERED.set()
    LOAD_RELEASE.wait(60)
    raise RuntimeError("no weights today")
