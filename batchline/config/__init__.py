"""Settings of the Redis service, read from ``BATCHLINE_*`` environment variables.

Every component (producer, worker, ``batchline`` commands) reads its settings through these
pydantic-settings classes: a value given in code wins over the environment, which wins over
the default. An unknown ``BATCHLINE_*`` variable or an invalid value is an error at start-up
that names the setting. The Redis URL is a secret: it never appears in a repr or a log line
(:func:`redact_url` shows it without its password).
"""

from __future__ import annotations

from batchline.config._environment import check_environment
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
