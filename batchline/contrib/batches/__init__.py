"""The Batch API's wing: OpenAI's ``/v1/files`` and ``/v1/batches``, the files kept in Redis,
the batches driven by every API replica (the manual's page: The Batch API).

- :mod:`._routes`: ``/v1/batches`` (:class:`BatchApi`, which adds ``/v1/files`` too);
- :mod:`._files`: ``/v1/files``, the files in Redis;
- :mod:`._uploads`: an upload read as it arrives, off the event loop; the uploads' budget;
- :mod:`._lines`: lines, checks, statuses and answers (no I/O);
- :mod:`._run`: one batch on the queue, each line run by its route;
- :mod:`._output`: a batch's window, counted in inputs, and its answers encoded within the
  output limits;
- :mod:`._driver`: leases, and the loop every replica runs;
- :mod:`._process` (and its child, :mod:`._driver_child`): that loop in a child process of
  the API.

It builds on the OpenAI wing's face (:mod:`batchline.contrib.openai`: its routes run each
line, its errors and bodies are the Batch API's) and the plumbing, never on Hugging Face's.
"""

from batchline.contrib.batches._routes import BatchApi

__all__ = ["BatchApi"]
