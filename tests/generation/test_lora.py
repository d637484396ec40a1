"""LoRA adapters per row (batchline/generation/_lora.py): rows with different adapters in
one forward equal, row by row, the model with that adapter's weights merged in."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.deterministic import make_deterministic  # noqa: E402
from batchline.errors import AdapterError, UnknownAdapter  # noqa: E402
from batchline.generation._lora import AdapterSet, load_adapter, rows_adapters  # noqa: E402

from tests.support.tiny import tiny_model  # noqa: E402

TARGETS = ("q_proj", "v_proj")


def save_adapter(folder: Path, model: Any, *, seed: int, r: int = 4, **config: Any) -> Path:
    """A random adapter in peft's on-disk format (key names and config as peft writes them)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            prefix = f"base_model.model.{name}"
            a = torch.randn(r, module.in_features, generator=gen) * 0.1
            b = torch.randn(module.out_features, r, generator=gen) * 0.1
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    body = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(TARGETS)}
    body.update(config)
    (folder / "adapter_config.json").write_text(json.dumps(body))
    return folder


def merged(model: Any, folder: Path) -> Any:
    """``model`` with the adapter's ``scale * B @ A`` added to its weights."""
    adapter = load_adapter("m", folder)
    out = copy.deepcopy(model)
    modules = dict(out.named_modules())
    for name, (a, b) in adapter.weights.items():
        modules[name].weight.data += adapter.scale * (b @ a)
    return out


@pytest.mark.parametrize("deterministic", [False, True])
def test_mixed_rows_equal_merged_models(tmp_path: Path, deterministic: bool) -> None:
    base = tiny_model("llama", torch.float32)
    folders = [
        save_adapter(tmp_path / "a", base, seed=1),
        save_adapter(tmp_path / "b", base, seed=2, r=8, use_rslora=True),
        save_adapter(tmp_path / "c", base, seed=3),
    ]
    expected = [merged(base, f)(torch.tensor([[5, 9, 11, 20]])).logits for f in folders]
    expected.append(base(torch.tensor([[5, 9, 11, 20]])).logits)
    model = copy.deepcopy(base)
    if deterministic:
        make_deterministic(model)
    adapters = AdapterSet(model)
    for name, folder in zip("abc", folders, strict=True):
        adapters.add(load_adapter(name, folder))
    rows = adapters.rows(["a", "b", "c", None])
    with rows_adapters(rows):
        logits = model(torch.tensor([[5, 9, 11, 20]] * 4)).logits
    for i, want in enumerate(expected):
        torch.testing.assert_close(logits[i : i + 1], want, rtol=1e-4, atol=1e-4)
    # The adapters change the output: the rows differ from each other.
    assert not torch.allclose(logits[0], logits[3])
    # Outside the block, no row gets a delta.
    torch.testing.assert_close(model(torch.tensor([[5, 9, 11, 20]])).logits, expected[3])


def test_unknown_adapter_is_typed(tmp_path: Path) -> None:
    adapters = AdapterSet(tiny_model("llama", torch.float32))
    with pytest.raises(UnknownAdapter, match="nope"):
        adapters.rows(["nope"])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_dora", True),
        ("bias", "lora_only"),
        ("modules_to_save", ["lm_head"]),
        ("alora_invocation_tokens", [40, 41]),
        ("use_qalora", True),
        ("layer_replication", [[0, 2], [1, 2]]),
        ("use_bdlora", {"target_modules_bd_a": ["q_proj"]}),
        ("arrow_config", {"top_k": 2}),
        ("kasa_config", {"beta": 0.001}),
        ("monteclora_config", {"monteclora_n": 4}),
    ],
)
def test_unsupported_config_is_refused_by_field(tmp_path: Path, field: str, value: Any) -> None:
    folder = save_adapter(tmp_path / "x", tiny_model("llama"), seed=1, **{field: value})
    with pytest.raises(AdapterError, match=field):
        load_adapter("x", folder)


def test_bin_adapter_is_refused_without_unpickling(tmp_path: Path) -> None:
    folder = save_adapter(tmp_path / "x", tiny_model("llama"), seed=1)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="safetensors"):
        load_adapter("x", folder)


def test_engine_mixes_adapters_in_one_continuous_batch(tmp_path: Path) -> None:
    """Rows of three adapters and none, arriving at staggered steps with prefill forced into
    chunks and the prefix cache on (twins: one prompt under each adapter), each generate
    greedily what that adapter's merged model generates alone."""
    from batchline.core.scheduler import SchedulerConfig
    from batchline.generation import Engine, GenerationLoop, GenerationParams, GenerationResult
    from batchline.generation._types import Sequence_

    from tests.support.stepping import Clock
    from tests.support.tiny import alone

    base = tiny_model("llama", torch.float32)
    folders = [save_adapter(tmp_path / n, base, seed=i + 1) for i, n in enumerate("abc")]
    wanted_models = [merged(base, f) for f in folders] + [base]
    model = copy.deepcopy(base)
    engine = Engine(model, max_prefill_tokens=4, adapters=dict(zip("abc", folders, strict=True)))
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    plan = [  # (step, prompt, adapter index)
        (0, shared, 0),
        (0, shared, 1),
        (0, shared, -1),
        (1, shared, 2),
        (1, shared, 0),
        (2, [20, 21, 22], 1),
        (3, shared + [30], -1),
        (3, shared + [30], 2),
    ]
    clock = Clock()
    loop = GenerationLoop(engine, SchedulerConfig(max_batch_size=8), clock=clock)
    events: list[list[Any]] = [[] for _ in plan]
    for step in range(200):
        clock.now = float(step)
        for (at, prompt, adapter), got in zip(plan, events, strict=True):
            if at == step:
                seq = Sequence_(prompt, GenerationParams(max_new_tokens=8), clock.now, got.append)
                seq.adapter = adapter
                loop.submit(seq)
        loop.run_once()
        if step >= 3 and loop.idle:
            break
    for (_, prompt, adapter), got in zip(plan, events, strict=True):
        assert isinstance(got[-1], GenerationResult), got[-1]
        want = alone(wanted_models[adapter], prompt, 8)
        assert list(got[-1].token_ids) == want, (prompt, adapter)


def test_generator_routes_by_model_and_fails_an_unknown_adapter_alone(tmp_path: Path) -> None:
    from batchline.generation import SyncGenerator

    from tests.support.tiny import alone

    base = tiny_model("llama", torch.float32)
    a = save_adapter(tmp_path / "a", base, seed=1)
    save_adapter(tmp_path / "dir" / "b", base, seed=2)
    want_a = alone(merged(base, a), [5, 6, 7], 6)
    want_b = alone(merged(base, tmp_path / "dir" / "b"), [5, 6, 7], 6)
    want_base = alone(base, [5, 6, 7], 6)
    with SyncGenerator(
        copy.deepcopy(base), dtype="float32", adapters={"a": a}, adapter_dir=tmp_path / "dir"
    ) as gen:
        got_a = gen.generate(prompt_ids=[5, 6, 7], max_new_tokens=6, model="a")
        got_b = gen.generate(prompt_ids=[5, 6, 7], max_new_tokens=6, model="base:b")
        got_base = gen.generate(prompt_ids=[5, 6, 7], max_new_tokens=6)
        with pytest.raises(UnknownAdapter, match="nope"):
            gen.generate(prompt_ids=[5, 6, 7], max_new_tokens=6, model="nope")
    assert list(got_a.token_ids) == want_a
    assert list(got_b.token_ids) == want_b
    assert list(got_base.token_ids) == want_base
    assert want_a != want_base
