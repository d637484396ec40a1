"""The public path of :mod:`batchline.transport.acl`, where the module lives with the rest of
the Redis transport; this re-exports all of it (its ``__all__``)."""

from batchline.transport.acl import *  # noqa: F403
from batchline.transport.acl import __all__ as __all__
