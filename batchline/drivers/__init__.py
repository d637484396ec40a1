"""The in-process drivers around the core: they move items between callers and
:mod:`batchline.core` and settle futures; no batching decision lives here.

- :mod:`._options`: every decorator option, declared once, with the defaults (``DEFAULTS``);
- :mod:`._base`: the validated settings (``BatchConfig``), a call and its items, and what the
  two drivers share;
- :mod:`._threads`: the thread driver (one worker thread per batcher, a condition variable);
- :mod:`._aio`: the asyncio driver (one task per batcher per loop, an event); the Redis worker
  drives the same one;
- :mod:`._inference`: the padded-tensor batchers on top of either;
- :mod:`._dynamically` (``batchline.dynamically``) and :mod:`._decorators` (the four built
  from one set of options): the ``dynamically`` decorators.

The public names are re-exported by :mod:`batchline`, :mod:`batchline.aio` and
:mod:`batchline.inference`.
"""
