"""Padded-tensor batching on a worker thread: ``batchline.inference.dynamically``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Unpack, overload

from batchline.drivers._decorators import make_inference
from batchline.drivers._inference import InferenceBatcher
from batchline.drivers._options import InferenceOptions

__all__ = ["InferenceBatcher", "dynamically"]


@overload
def dynamically(fn: Callable[..., Any], /) -> InferenceBatcher: ...


@overload
def dynamically(
    fn: None = None, /, **options: Unpack[InferenceOptions]
) -> Callable[[Callable[..., Any]], InferenceBatcher]: ...


def dynamically(
    fn: Callable[..., Any] | None = None, /, **options: Unpack[InferenceOptions]
) -> Any:
    """Batch an inference function over padded features on a worker thread.

    The function takes ``dict[str, Feature]`` (numpy arrays, torch tensors, or lists of
    them, batch first) and returns a Feature or a list, tuple or dict of Features. Callers
    pass their own features (``f(features)`` or ``f(**features)``, or ``await f.acall(...)``)
    and get back the outputs for their own rows, trimmed to their own lengths.

    Args:
        fn: the inference function (when used bare).
        **options: those of :func:`batchline.dynamically` but ``length_fn`` (a row's length
            is the first dimension of its first feature, which ``max_tokens`` counts), and
            ``pad_token``, ``pad_tokens``, ``padding_side``, ``spread_kwargs``:
            :class:`batchline.InferenceOptions` says what each does and its default.
    """
    return make_inference(fn, options)
