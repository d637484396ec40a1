"""The container check's compose stack: docker/compose.yaml's services run as containers, healthy.

Redis, the workers and the API, with compose.yaml's commands, environment, health checks,
grace periods, read-only root filesystems and tmpfs mounts (``${VAR}`` substituted as compose
does), on an internal network; the API also on an edge network, published on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

import docker
import yaml

from checks.containers._common import (
    API_IMAGE,
    LABEL,
    REDIS_BASE,
    ROOT,
    WORKER_IMAGE,
    log,
    wait_for,
)

PREFIX = "batchline-ci"


# ---------------------------------------------------------------- compose services

_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def substitute(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` in strings, recursively."""
    if isinstance(value, str):

        def one(match: re.Match[str]) -> str:
            name, kind, rest = match.groups()
            if env.get(name):
                return env[name]
            if kind == "?":
                raise KeyError(f"{name}: {rest}")
            return rest or ""

        return _VAR.sub(one, value)
    if isinstance(value, list):
        return [substitute(v, env) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, env) for k, v in value.items()}
    return value


def healthcheck(spec: dict[str, Any], *, interval_s: float) -> dict[str, Any]:
    """A compose healthcheck for the SDK, polled every ``interval_s`` (the test's pace)."""
    return {
        "test": spec["test"],
        "interval": int(interval_s * 1e9),
        "timeout": int(float(str(spec.get("timeout", "10s")).rstrip("s")) * 1e9),
        "retries": int(spec.get("retries", 3)),
        "start_period": int(300e9),
    }


def seconds(value: str) -> int:
    return int(str(value).rstrip("s"))


def filesystem(spec: dict[str, Any]) -> dict[str, Any]:
    """A compose service's ``read_only`` and ``tmpfs`` for the SDK: ``tmpfs`` (one path or a
    list, each ``path`` or ``path:options``) as a mapping of path to options."""
    mounts = spec.get("tmpfs", [])
    tmpfs: dict[str, str] = {}
    for mount in [mounts] if isinstance(mounts, str) else mounts:
        path, _, options = str(mount).partition(":")
        tmpfs[path] = options
    return {"read_only": bool(spec.get("read_only", False)), "tmpfs": tmpfs}


class Stack:
    """The services of docker/compose.yaml as containers: Redis, workers, the API."""

    def __init__(self, client: docker.DockerClient, *, workers: int) -> None:
        self.client = client
        self.password = secrets.token_hex(16)
        env = {"REDIS_PASSWORD": self.password}
        compose = yaml.safe_load((ROOT / "docker/compose.yaml").read_text())
        self.services = substitute(compose["services"], env)
        self.workers: list[Any] = []
        self.redis: Any = None
        self.api: Any = None
        self.api_url = ""
        self.api_key = ""  # made once the stack is up (compose.yaml's API takes keys)
        self.n_workers = workers

    def up(self) -> None:
        labels = {LABEL: "1"}
        inner = self.client.networks.create(f"{PREFIX}-inner", internal=True, labels=labels)
        edge = self.client.networks.create(f"{PREFIX}-edge", labels=labels)
        self.client.volumes.create(f"{PREFIX}-redis-data", labels=labels)
        redis = self.services["redis"]
        self.redis = self.start(
            "redis",
            REDIS_BASE,
            inner,
            command=redis["command"],
            environment=redis["environment"],
            volumes={f"{PREFIX}-redis-data": {"bind": "/data", "mode": "rw"}},
            healthcheck=healthcheck(redis["healthcheck"], interval_s=1),
        )
        wait_healthy(self.redis, timeout_s=60)
        worker = self.services["worker"]
        self.grace_s = seconds(worker["stop_grace_period"])
        for i in range(self.n_workers):
            self.workers.append(
                self.start(
                    f"worker-{i + 1}",
                    WORKER_IMAGE,
                    inner,
                    environment=worker["environment"],
                    healthcheck=healthcheck(worker["healthcheck"], interval_s=2),
                    **filesystem(worker),
                )
            )
        api = self.services["api"]
        self.api = self.start(
            "api",
            API_IMAGE,
            inner,
            environment=api["environment"],
            ports={"8000/tcp": ("127.0.0.1", None)},
            healthcheck=healthcheck({"test": api_healthcheck(self.client)}, interval_s=1),
            connect=[edge],
            **filesystem(api),
        )
        self.api.reload()
        port = self.api.attrs["NetworkSettings"]["Ports"]["8000/tcp"][0]["HostPort"]
        self.api_url = f"http://127.0.0.1:{port}"
        wait_healthy(self.api, timeout_s=120)
        for container in self.workers:
            wait_healthy(container, timeout_s=600)
        # As docs/deploying.md says: the first key, made in the API's container (only the key
        # on stdout).
        code, (out, err) = self.api.exec_run(
            ["batchline", "keys", "create", "--tenant", "check"], demux=True
        )
        if code != 0:
            raise RuntimeError(f"batchline keys create: {(err or b'').decode()}")
        self.api_key = (out or b"").decode().strip()
        log(f"up: redis, {len(self.workers)} workers healthy, API healthy on {self.api_url}")

    def start(
        self,
        name: str,
        image: str,
        network: Any,
        *,
        connect: tuple[Any, ...] | list[Any] = (),
        **kwargs: Any,
    ) -> Any:
        container = self.client.containers.create(
            image,
            name=f"{PREFIX}-{name}",
            labels={LABEL: "1"},
            network=network.name,
            **kwargs,
        )
        # The service name is the host name the others use (redis://...@redis:6379).
        network.disconnect(container)
        network.connect(container, aliases=[name.split("-")[0]])
        for other in connect:
            other.connect(container)
        container.start()
        return container

    def batchline_status(self) -> dict[str, Any]:
        """``batchline status --json`` run inside the API container."""
        code, out = self.api.exec_run(["batchline", "status", "--json"])
        if code != 0:
            raise RuntimeError(f"batchline status: {out.decode()}")
        return dict(json.loads(out))


def api_healthcheck(client: docker.DockerClient) -> list[str]:
    """The API image's own HEALTHCHECK command (compose.yaml gives the API none)."""
    return list(client.images.get(API_IMAGE).attrs["Config"]["Healthcheck"]["Test"])


def wait_healthy(container: Any, *, timeout_s: float) -> None:
    def healthy() -> bool:
        container.reload()
        state = container.attrs["State"]
        if state["Status"] in ("exited", "dead"):
            logs = container.logs(tail=40).decode(errors="replace")
            raise RuntimeError(f"{container.name} exited ({state['ExitCode']}):\n{logs}")
        return bool(state.get("Health", {}).get("Status") == "healthy")

    started = time.monotonic()
    wait_for(f"{container.name} healthy", healthy, timeout_s=timeout_s)
    log(f"{container.name} healthy after {time.monotonic() - started:.0f} s")
