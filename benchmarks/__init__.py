"""batchline's benchmarks: one entry per benchmark, run from a checkout's root.

Not part of the wheel; nothing to install beyond batchline's own dependencies (and the
``bench`` extra for the in-process comparison). Each prints a markdown report; the figures
recorded, with date, machine and command, are on the documentation's Benchmarks page.

- ``python -m benchmarks.inprocess``: the in-process batchers against batched,
  fast-dynamic-batcher and no batching (``inprocess/``: its batch functions and batchers,
  throughput, latency and idle CPU, report).
- ``python -m benchmarks.queue``: the Redis service end to end, beside arq, and MiniLM served
  through Redis against the offline ceiling; CPU backends, a fixed offered rate, the GPU mode
  (``queue/``: one module per part, their load generators, the redis-server and workers they
  share, report).
- ``python -m benchmarks.generate``: generation in process against static batching and
  transformers' continuous batching, and through Redis and HTTP (``generate/``).
- ``python -m benchmarks.long_prompt``: what long prompts do to a stream beside them.
- ``python -m benchmarks.prefix``: prefill time with the shared-prefix cache and without.
- ``python -m benchmarks.structured``: structured output on SmolLM2, each answer validated
  against its schema, and the per-token cost of the masks.
- ``python -m benchmarks.tools``: function tools on SmolLM2 (``tool_choice: required``), each
  call validated against its function's schema, and the tool grammar's per-token cost beside
  structured output's.
- ``python -m benchmarks.models``: several queues served by one worker process against a
  worker each, a cold model's first request, and LoRA adapters mixed in one batch against a
  batch per adapter.
- ``python -m benchmarks.dtype``: ``dtype auto`` on this CPU, bfloat16 against float32; with
  ``--deterministic``, the cost of deterministic mode on embeddings.
- ``python -m benchmarks.invariance``: which kernels give a row a different result with the
  batch around it (linear, attention, norms), and MiniLM and SmolLM2 alone against batched,
  deterministic mode off and on.
- ``python -m benchmarks.cache``: the result cache on half-repeated texts.
- ``python -m benchmarks.batch_api``: a batch through ``/v1/batches`` against the same requests
  through the producer, and interactive latency while a batch runs.
- ``python -m benchmarks.batch_limits``: the Batch API's bounds: the batch driver's memory and
  Redis's against a batch's output size, and interactive latency beside a large upload.
- ``python -m benchmarks.schema_check``: bystanders' latency on the HTTP API while large
  ``response_format`` schemas are checked.
- ``python -m benchmarks.slo``: the latency-SLO mode against fixed settings.
- ``python -m benchmarks.admission``: admission through the queue's functions against the
  enqueue script.
- ``python -m benchmarks.lua``: what the queue's Lua costs Redis per request, function by
  function (its CPU, or its instructions under callgrind).
- ``python -m benchmarks.durability``: durability ``replicated`` against ``async``.
- ``python -m benchmarks.fairness``: tenants' fair share of the workers against first come,
  first served (a small tenant's p99 beside a large one, weights 3:1, a tenant's CPU).
- ``python -m benchmarks.tracing``: tracing off, on, and the version before it, on the no-op
  model's path through Redis.
- ``python -m benchmarks.grouping``: padding efficiency of the length grouping per read-ahead
  window (no model, no Redis).

``harness`` is what they share (processes, redis-server, CPU accounting, repeats, report
lines); the operational checks in ``checks/`` start their processes with it too.
"""
