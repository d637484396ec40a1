"""The Redis transport the producer and the worker share.

- ``keys``: every key name (public path :mod:`batchline.keys`);
- ``codec``: requests, results and values as they travel (public path :mod:`batchline.codec`);
- ``_scripts``: the Lua scripts (enqueue, complete); ``_redis``: clients, back-off, script
  calls; ``_errors``: what counts as Redis failing; ``_outbox``: coalesced writes;
  ``_cancels``: the cancel stream;
- ``status``: ``batchline status``'s figures; ``acl``: the ACL users (public path
  :mod:`batchline.acl`).

``docs/protocol.md`` is the contract these implement.
"""
