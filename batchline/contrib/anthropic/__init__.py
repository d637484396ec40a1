"""Anthropic's wing: the Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), what
the ``anthropic`` client speaks, errors in Anthropic's shape.

- :mod:`._routes`: the routes (:class:`MessagesRoutes`), run on the OpenAI wing's generation
  queue and producer;
- :mod:`._schema`: the request and the answer;
- :mod:`._stream`: Anthropic's server-sent events;
- :mod:`._errors`: Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

It builds on the OpenAI wing's face (:mod:`batchline.contrib.openai`) and the plumbing, never
on another wing.
"""

from batchline.contrib.anthropic._errors import refused
from batchline.contrib.anthropic._routes import MESSAGES_PREFIX, MessagesRoutes

__all__ = ["MESSAGES_PREFIX", "MessagesRoutes", "refused"]
