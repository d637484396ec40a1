"""The container check's images: cleanup, the stand-in bases, the worker and API images, their checks.

The stand-in bases (``batchline-standin/*``: debootstrap's bookworm with Python 3.11, Debian's
redis-server on it) are built once and kept; the worker and API images are built from
docker/Dockerfile and docker/Dockerfile.api on them, the host's pinned torch wheel served to the
build from 127.0.0.1. Then the worker image is checked CPU-only, and deploy/kubernetes/redis.yaml's
Redis command and probe are run as its pod runs them.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import yaml
from docker.models.containers import Container

from checks.containers._common import (
    API_IMAGE,
    LABEL,
    PY_BASE,
    REDIS_BASE,
    ROOT,
    WORKER_IMAGE,
    log,
    require,
    wait_for,
)

MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
TORCH_WHEEL = "torch-2.13.0*cpu*.whl"


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
