"""LoRA adapters as models of their own: the adapters a generation queue's workers publish
in their facts (docs/protocol.md, Model facts) are listed by ``GET /v1/models`` beside the
base model, and a request names one by ``model``, OpenAI's convention: the adapter's own
name or ``<base>:<adapter>``. The request then carries ``adapter`` to the worker."""

from __future__ import annotations

from typing import Any

__all__ = ["adapter_cards", "adapter_named"]


def _served_adapters(facts: dict[str, Any] | None) -> list[str]:
    names = facts.get("adapters") if facts is not None else None
    return [n for n in names if isinstance(n, str) and n] if isinstance(names, list) else []


def adapter_named(base: str, model: str, facts: dict[str, Any] | None) -> str | None:
    """The adapter ``model`` names on the queue serving ``base`` (its workers' ``facts``),
    or None where it names none of them."""
    name = model[len(base) + 1 :] if model.startswith(base + ":") else model
    return name if name in _served_adapters(facts) else None


def adapter_cards(
    base: str, facts: dict[str, Any] | None, base_card: dict[str, Any]
) -> list[dict[str, Any]]:
    """A model object per adapter the queue serving ``base`` publishes, shaped as the base
    model's (``base_card``) with its own ``id`` and ``parent``, the base model."""
    return [{**base_card, "id": name, "parent": base} for name in _served_adapters(facts)]
