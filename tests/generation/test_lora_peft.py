"""LoRA adapters made and saved by peft itself, served per row by batchline (which never
imports peft): greedy tokens equal peft's merged model's, logits equal peft's unmerged
model's, in float32, for Llama (Linear) and GPT-2 (Conv1D, fan_in_fan_out) targets."""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from batchline.errors import AdapterError  # noqa: E402
from batchline.generation import Generator  # noqa: E402
from batchline.generation._lora import AdapterSet, load_adapter, rows_adapters  # noqa: E402

from tests.support.tiny import alone, tiny_model  # noqa: E402

# peft calls a transformers method that transformers 5 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

# Per architecture: adapters (name, seed, LoraConfig fields), all different in rank, scale,
# targets; one with rsLoRA's alpha / sqrt(r). init_lora_weights=False: B random, not zero.
LLAMA = [
    ("a", 1, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
    (
        "b",
        2,
        {
            "r": 8,
            "lora_alpha": 4,
            "use_rslora": True,
            "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"],
        },
    ),
    ("c", 3, {"r": 2, "lora_alpha": 6, "target_modules": ["k_proj", "gate_proj", "up_proj"]}),
]
GPT2 = [
    ("a", 1, {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_proj", "c_fc"]}),
    ("b", 2, {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": ["c_attn"]}),
]
ADAPTERS = {"llama": LLAMA, "gpt2": GPT2}
PROMPTS = [[5, 9, 11, 20], [7], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [12, 60]]
NEW_TOKENS = 12  # long enough that the chunked prompts decode beside the others


def peft_models(kind: str, base: Any, tmp_path: Path) -> dict[str, Any]:
    """Per adapter name, peft's unmerged PeftModel (in eval mode), its adapter saved by peft's
    ``save_pretrained`` to ``tmp_path / name``."""
    models = {}
    for name, seed, fields in ADAPTERS[kind]:
        torch.manual_seed(seed)
        config = peft.LoraConfig(init_lora_weights=False, fan_in_fan_out=kind == "gpt2", **fields)
        model = peft.get_peft_model(copy.deepcopy(base), config).eval()
        model.save_pretrained(str(tmp_path / name))
        assert (tmp_path / name / "adapter_model.safetensors").is_file()
        models[name] = model
    return models


def merged(model: Any) -> Any:
    """peft's merged model: the adapter's weights folded into a copy of the base's."""
    return copy.deepcopy(model).merge_and_unload().eval()


async def generate_together(gen: Generator, requests: list[tuple[list[int], str | None]]) -> Any:
    """The results of ``requests`` (prompt, adapter), all submitted before the model's first
    forward ends (it waits for them), and each forward's number of rows."""
    gate = threading.Event()
    rows: list[int] = []

    def hold(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        gate.wait(60)  # on the model thread: until every request is in
        rows.append(kwargs["input_ids"].shape[0])

    hook = gen.engine.model.register_forward_pre_hook(hold, with_kwargs=True)
    try:
        tasks = [
            asyncio.ensure_future(
                gen.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, model=adapter)
            )
            for prompt, adapter in requests
        ]
        await asyncio.sleep(0)  # each task runs to its first wait: its request is submitted
        gate.set()
        results = await asyncio.gather(*tasks)
    finally:
        hook.remove()
    return results, rows


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("deterministic", [False, True])
async def test_one_batch_of_adapters_generates_what_peft_merged_models_do(
    tmp_path: Path, kind: str, deterministic: bool
) -> None:
    """Every prompt under every adapter and under none, in one continuous batch, generates
    greedily the tokens of peft's merged model for that adapter (the base model for none)."""
    base = tiny_model(kind, torch.float32)
    models = peft_models(kind, base, tmp_path)
    references = {name: merged(model) for name, model in models.items()} | {None: base}
    requests = [(prompt, name) for prompt in PROMPTS for name in references]
    want = [alone(references[name], prompt, NEW_TOKENS) for prompt, name in requests]
    # The adapters change the tokens: a wrong delta (or none) cannot pass unnoticed.
    by_name = {name: [w for (_, n), w in zip(requests, want) if n == name] for name in references}
    assert len({str(tokens) for tokens in by_name.values()}) == len(references), by_name
    async with Generator(
        copy.deepcopy(base),
        dtype="float32",
        deterministic=deterministic,
        max_prefill_tokens=8,  # the longest prompts are prefilled in chunks, 2 tokens a step
        adapters={name: tmp_path / name for name in models},
    ) as gen:
        results, rows = await generate_together(gen, requests)
    # The long prompts' last chunk let them join the others decoding: one forward of all.
    assert len(requests) in rows, rows
    for (prompt, name), result, tokens in zip(requests, results, want, strict=True):
        assert list(result.token_ids) == tokens, (kind, prompt, name)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_mixed_rows_logits_equal_peft_unmerged_models(tmp_path: Path, kind: str) -> None:
    """One forward whose rows use different adapters (and one none) gives, row by row, the
    logits of peft's PeftModel for that row's adapter (of the base model for none)."""
    base = tiny_model(kind, torch.float32)
    models = peft_models(kind, base, tmp_path)
    names: list[str | None] = [*models, None, *reversed(models)]
    ids = torch.randint(4, 97, (len(names), 6), generator=torch.Generator().manual_seed(0))
    served = copy.deepcopy(base)
    adapters = AdapterSet(served)
    for name in models:
        adapters.add(load_adapter(name, tmp_path / name))
    with torch.no_grad(), rows_adapters(adapters.rows(names)):
        logits = served(ids).logits
    with torch.no_grad():
        for row, name in enumerate(names):
            reference = models[name] if name is not None else base
            want = reference(ids[row : row + 1]).logits
            torch.testing.assert_close(logits[row : row + 1], want, rtol=1e-5, atol=1e-5)
            if name is not None:  # the adapter moves the logits well past that tolerance
                assert not torch.allclose(want, base(ids[row : row + 1]).logits, atol=1e-2)


def test_activated_lora_is_refused(tmp_path: Path) -> None:
    """peft's aLoRA adds the delta only from its invocation tokens on (its tensors are plain
    LoRA's): served as plain LoRA its outputs would be silently wrong, so it is refused."""
    base = tiny_model("llama", torch.float32)
    config = peft.LoraConfig(
        r=4,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
        alora_invocation_tokens=[40, 41],
        init_lora_weights=False,
    )
    peft.get_peft_model(base, config).save_pretrained(str(tmp_path / "x"))
    with pytest.raises(AdapterError, match="alora_invocation_tokens"):
        load_adapter("x", tmp_path / "x")
