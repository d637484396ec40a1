"""The public path of :mod:`batchline.transport.codec`, where the module lives with the rest of
the Redis transport; this re-exports all of it (its ``__all__``)."""

from batchline.transport.codec import *  # noqa: F403
from batchline.transport.codec import __all__ as __all__
