"""The ``BATCHLINE_*`` variables no setting knows (:func:`check_environment`), and the
settings of a class made in code (:func:`given_or_read`); the public module is
:mod:`batchline.config`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar

from batchline.config._producer import WebSettings
from batchline.config._service import ENV_PREFIX, ServiceSettings
from batchline.config._worker import WorkerSettings

__all__ = ["check_environment", "given_or_read"]

S = TypeVar("S", bound=ServiceSettings)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise ValueError naming any ``BATCHLINE_*`` variable that is neither a setting nor
    one of those read elsewhere (docs/configuration.md, Not a setting)."""
    env = os.environ if environ is None else environ
    known = {
        ENV_PREFIX + name.upper()
        for cls in (WebSettings, WorkerSettings)
        for name in cls.model_fields
    }
    known.add(ENV_PREFIX + "CACHE_DIR")  # where converted and exported models are kept
    known.add(ENV_PREFIX + "OTEL")  # tracing on or off (batchline.tracing reads it)
    known.add(ENV_PREFIX + "EXTRAS")  # scripts/setup.sh's: the extras it installs
    known.add(ENV_PREFIX + "TORCH_INDEX")  # scripts/setup.sh's: where torch comes from
    unknown = sorted(k for k in env if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


def given_or_read(cls: type[S], settings: S | None, overrides: Mapping[str, Any]) -> S:
    """``settings``, else ``cls`` from the environment (checked first) and ``overrides``.

    Raises:
        TypeError: both ``settings`` and ``overrides`` are given (one would be dropped).
        ValueError: an unknown ``BATCHLINE_*`` variable, or an invalid value.
    """
    if settings is None:
        check_environment()
        return cls(**overrides)
    if overrides:
        raise TypeError(f"give settings or single settings, not both: {sorted(overrides)}")
    return settings
