"""Build batchline's images and run them on a real Docker engine: the deployment, checked.

    python3 -m checks.containers                 # build, run, check, tear down (~10 min fresh)
    python3 -m checks.containers --keep-images   # keep the worker and API images afterwards

Needs a running dockerd and, the first time, debootstrap (`.ci/run` installs Debian's
docker.io and debootstrap and starts dockerd). It needs no image registry: the bases are local
stand-ins for the official images, built once and kept (``batchline-standin/*``):

- Python 3.11 (Debian bookworm's, like ``python:3.11-slim-bookworm``): debootstrap minbase with
  python3, pip, ``python-is-python3``, the host's CA bundle (pip reaches the registries only
  through this host's TLS-intercepting proxy) and pip allowed to install system-wide (stand-in
  only: the official image has no externally managed Python);
- Redis 7 (Debian's redis-server, like ``redis:7-bookworm``).

The worker and API images are built from docker/Dockerfile and docker/Dockerfile.api with
those bases by build argument; the torch wheel pinned on the host (pip's find-links) is served
to the build from 127.0.0.1, as pip's ``PIP_FIND_LINKS``. Then the services of
docker/compose.yaml (its commands, environment, health checks, grace periods, read-only root
filesystems and tmpfs mounts) run as containers: Redis, 2 workers, the API on 127.0.0.1. Checked: every health check passes; 300
embeddings through the API match a local encode (cosine >= 0.999); one worker killed (SIGKILL)
mid-load loses nothing and answers nothing twice (each answered request's result key written
exactly once, no other written: Redis's keyspace notifications, counted per request id);
`docker stop` (SIGTERM) drains a worker mid-load, exit 0. deploy/kubernetes/redis.yaml's Redis command and probe run as its pod runs
them (non-root, read-only root filesystem): AOF on, the default user off, the ACL user held
to its keys. Everything it creates carries the label ``batchline.containers`` and is
removed at the end, also on failure, and at the start (leftovers of an interrupted run).

The engine is driven through the Docker SDK for Python (``docker``, installed here): Debian's
and PyPI's docker-compose 1.29 predate the compose spec that docker/compose.yaml follows
(top-level ``name``, ``deploy.replicas``), and the SDK gives per-container kill/stop, bounded
waits and label-based cleanup without parsing CLI output.
"""

# The parts live beside this file: the names, log and checks they share in _common.py;
# cleanup, the stand-in bases, the images and their checks in _images.py; the compose services
# as containers in _stack.py; the load, the answers' checks and the kill and SIGTERM phases in
# _load.py.

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import docker

from checks.containers._common import log
from checks.containers._images import (
    build_images,
    check_cpu_only,
    check_kubernetes_redis,
    cleanup,
    ensure_python_base,
    ensure_redis_base,
)
from checks.containers._load import exercise, local_encoder
from checks.containers._stack import Stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-images", action="store_true", help="keep the worker/API images")
    parser.add_argument("--report", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    # `timeout` (CI) sends SIGTERM: exit through the finally below, which tears down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    client = docker.from_env(timeout=600)
    client.ping()
    started = time.monotonic()
    cleanup(client, images=False)  # leftovers of an interrupted run
    figures: dict[str, Any] = {}
    try:
        figures["standin_python_s"] = round(ensure_python_base(client))
        figures["standin_redis_s"] = round(ensure_redis_base(client))
        figures["images"] = build_images(client)
        figures["torch"] = check_cpu_only(client)
        check_kubernetes_redis(client)
        encode = local_encoder()
        stack = Stack(client, workers=2)
        up_started = time.monotonic()
        stack.up()
        figures["up_s"] = round(time.monotonic() - up_started)
        figures.update(exercise(stack, encode))
    finally:
        log("tearing down")
        cleanup(client, images=not args.keep_images)
    figures["total_s"] = round(time.monotonic() - started)
    log("figures: " + json.dumps(figures))
    if args.report:
        args.report.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
