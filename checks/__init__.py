"""Operational checks of the service: each runs real processes, judges what happened and
exits non-zero when a promise did not hold. Run from a checkout's root; not part of the wheel.

Faults:

- ``python -m checks.chaos``: workers killed, redis-server restarted, every reply counted
  (``chaos/``: its processes, producers, analysis).
- ``python -m checks.failover``: a replicated Redis failed over under load, per durability.
- ``python -m checks.hung_model``: a model that hangs on one input, default settings.

Memory:

- ``python -m checks.soak``: a steady load for a long time; memory must not keep growing.
- ``python -m checks.hostile_memory``: a worker's memory under hostile writers.

Deployment:

- ``python -m checks.containers``: the images built and the compose stack run on a real
  Docker engine (``containers/``: images, stack, load).
- ``python -m checks.keda_sim``: deploy/kubernetes/keda.yaml's scaling policy replayed
  against a real Redis and real workers.

The house:

- ``python -m checks.request_path``: the modules one request passes through Redis, each
  with its number of calls (a map of the serving path, and its length held by a test).

They start their processes with the benchmarks' harness (``benchmarks.harness``).
"""
