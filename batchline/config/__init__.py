"""Settings of the Redis service, read from ``BATCHLINE_*`` environment variables.

Every component (producer, worker, ``batchline`` commands) reads its settings through these
pydantic-settings classes: a value given in code wins over the environment, which wins over
the default. An unknown ``BATCHLINE_*`` variable or an invalid value is an error at start-up
that names the setting. The Redis URL is a secret: it never appears in a repr or a log line
(:func:`redact_url` shows it without its password).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from batchline.config._producer import ProducerSettings, WebSettings
from batchline.config._service import ENV_PREFIX, MAX_PER_CALL, ServiceSettings, redact_url
from batchline.config._worker import WorkerSettings

__all__ = [
    "ENV_PREFIX",
    "MAX_PER_CALL",
    "ProducerSettings",
    "ServiceSettings",
    "WebSettings",
    "WorkerSettings",
    "check_environment",
    "redact_url",
]


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise ValueError naming any ``BATCHLINE_*`` variable no settings class knows."""
    env = os.environ if environ is None else environ
    known = {
        ENV_PREFIX + name.upper()
        for cls in (WebSettings, WorkerSettings)
        for name in cls.model_fields
    }
    known.add(ENV_PREFIX + "CACHE_DIR")  # where converted and exported models are kept
    known.add(ENV_PREFIX + "OTEL")  # tracing on or off (batchline.tracing reads it)
    unknown = sorted(k for k in env if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
