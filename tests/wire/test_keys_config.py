"""Key names and settings: one hash tag per queue, names validated, settings from the
environment, and the Redis password kept out of every repr, log line and printout."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import pytest
from pydantic import ValidationError
from redis.crc import key_slot

from batchline.cli import main
from batchline.config import (
    ProducerSettings,
    ServiceSettings,
    WorkerSettings,
    check_environment,
    redact_url,
)
from batchline.keys import QueueKeys, check_name
from batchline.producer import Producer

from tests.support.service import WorkerThread, run_cli

# -- keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("queue", "prefix", "priorities"),
    [("default", "batchline", 3), ("embed-v2.small_1", "acme.prod", 16), ("q", "p", 1)],
)
def test_every_key_of_a_queue_has_its_hash_tag(queue: str, prefix: str, priorities: int) -> None:
    k = QueueKeys(queue, prefix, priorities)
    names = [
        *k.streams,
        k.result("req-1"),
        k.reply("producer-1"),
        k.cancels,
        k.dead,
        k.workers,
        k.worker_stats("host-1-abc"),
        k.model,
        k.facts,
    ]
    assert len(k.streams) == priorities
    assert len(set(names)) == len(names)
    for name in names:
        assert name.startswith(f"{prefix}:{{{queue}}}:")
        assert name.count("{") == 1
        assert name.count("}") == 1
    assert len({key_slot(name.encode()) for name in names}) == 1  # one Redis Cluster slot
    assert k.streams[0] == k.stream(priorities - 1)  # highest priority first


def test_queues_do_not_share_keys() -> None:
    a, b = QueueKeys("a"), QueueKeys("b")
    assert not {*a.streams, a.dead, a.workers} & {*b.streams, b.dead, b.workers}
    assert QueueKeys("a", "p1").dead != QueueKeys("a", "p2").dead


@pytest.mark.parametrize(
    "name", ["", "a b", "a{b", "a}b", "a:b", "a*", "x" * 129, "é", "a\nb", 123, None]
)
def test_invalid_names_are_rejected(name: object) -> None:
    with pytest.raises(ValueError, match="queue must be 1-128 characters"):
        QueueKeys(name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix"):
        QueueKeys("ok", name)  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        ServiceSettings(queue=name)
    with pytest.raises(ValueError, match="request id"):
        check_name("request id", name)  # type: ignore[arg-type]


def test_valid_names_pass() -> None:
    assert check_name("queue", "A-z_0.9") == "A-z_0.9"
    assert check_name("queue", "x" * 128) == "x" * 128


@pytest.mark.parametrize("priorities", [0, 17, -1])
def test_priority_levels_are_bounded(priorities: int) -> None:
    with pytest.raises(ValueError, match="priorities"):
        QueueKeys("q", "p", priorities)


def test_streams_exist_only_for_the_priority_levels() -> None:
    k = QueueKeys("q", priorities=2)
    assert k.stream(0) != k.stream(1)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="priority must be in 0..1"):
            k.stream(bad)


def test_the_default_priority_is_one_of_the_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer with one priority level sends at 0 (not the default 1, which every call
    would be refused); one named outside the levels is refused as the settings are read."""
    assert ProducerSettings().default_priority == 1
    assert ProducerSettings(priorities=1).default_priority == 0
    monkeypatch.setenv("BATCHLINE_PRIORITIES", "1")
    assert ProducerSettings().default_priority == 0
    with pytest.raises(ValueError, match=r"default_priority must be below priorities \(1: 0..0\)"):
        ProducerSettings(default_priority=1)


# -- settings from the environment ---------------------------------------------------------


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_BATCH_SIZE", "7")
    monkeypatch.setenv("BATCHLINE_QUEUE", "from-env")
    monkeypatch.setenv("BATCHLINE_TIMEOUT_MS", "2.5")
    monkeypatch.setenv("BATCHLINE_MAX_QUEUE_DEPTH", "11")
    monkeypatch.setenv("batchline_max_deliveries", "5")  # names are case-insensitive
    worker = WorkerSettings()
    assert (worker.batch_size, worker.queue, worker.timeout_ms) == (7, "from-env", 2.5)
    assert worker.max_deliveries == 5
    assert worker.keys == QueueKeys("from-env")
    producer = ProducerSettings()  # a worker's variables do not bother a producer
    assert (producer.queue, producer.max_queue_depth) == ("from-env", 11)
    assert WorkerSettings(batch_size=3).batch_size == 3  # arguments win over the environment
    check_environment()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("BATCHLINE_BATCH_SIZE", "0"),
        ("BATCHLINE_BATCH_SIZE", "many"),
        ("BATCHLINE_TIMEOUT_MS", "-1"),
        ("BATCHLINE_CLAIM_IDLE_MS", "5"),
        ("BATCHLINE_DTYPE", "float8"),
        ("BATCHLINE_PRIORITIES", "17"),
        ("BATCHLINE_QUEUE", "no spaces"),
    ],
)
def test_an_invalid_value_names_its_setting(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(name, value)
    setting = name.removeprefix("BATCHLINE_").lower()
    with pytest.raises(ValidationError, match=setting):
        WorkerSettings()
    assert main(["worker", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert f"invalid settings: {name}: " in capsys.readouterr().err


def test_a_heartbeat_period_that_liveness_cannot_follow_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Beats further apart than half of the 10 s within which a heartbeat counts a worker
    live (--check, status) would make a healthy worker look dead between them."""
    from batchline.transport.status import LIVE_WITHIN_S

    assert WorkerSettings(heartbeat_s=LIVE_WITHIN_S / 2).heartbeat_s == 5
    for period in (5.5, LIVE_WITHIN_S, 30):
        with pytest.raises(ValidationError, match="heartbeat_s must be at most 5: a worker"):
            WorkerSettings(heartbeat_s=period)
    with pytest.raises(ValidationError, match="heartbeat_s must be at most 5"):  # a queue's own
        WorkerSettings(serve="q=batchline.worker.models:echo,heartbeat_s=30")
    argv = ["worker", "--redis-url", "redis://127.0.0.1:1/0", "--heartbeat-s", "30"]
    assert main(argv) == 2
    assert "--heartbeat-s: heartbeat_s must be at most 5" in capsys.readouterr().err


def test_unknown_variables_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_BACTH_SIZE", "8")  # a typo must not pass silently
    with pytest.raises(ValueError, match="BATCHLINE_BACTH_SIZE"):
        check_environment()
    check_environment({"BATCHLINE_BATCH_SIZE": "8", "OTHER": "x"})
    with pytest.raises(ValueError, match="batchline_nope"):
        check_environment({"batchline_nope": "1"})
    done = run_cli("status", env={"BATCHLINE_BACTH_SIZE": "8"})
    assert done.returncode != 0
    assert "BATCHLINE_BACTH_SIZE" in done.stderr


def test_unknown_arguments_are_an_error() -> None:
    with pytest.raises(ValidationError):
        WorkerSettings(batch_sise=8)  # type: ignore[call-arg]


# -- the password stays secret -------------------------------------------------------------


SECRET = "s3cr3t-Pa55word"


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{SECRET}@redis.example:6379/0",
        f"rediss://:{SECRET}@[::1]:6380/1",
        f"unix:///run/redis.sock?db=0&password={SECRET}",
        f"redis://redis.example/0?password={SECRET}&db=2",
    ],
)
def test_settings_never_show_the_password(url: str) -> None:
    for cls in (ServiceSettings, ProducerSettings, WorkerSettings):
        settings = cls(redis_url=url)
        shown = [
            repr(settings),
            str(settings),
            json.dumps(settings.describe()),
            settings.model_dump_json(),
            str(settings.model_dump()),
        ]
        for text in shown:
            assert SECRET not in text
        assert settings.redis_url.get_secret_value() == url  # kept, only hidden
        assert "***" in settings.describe()["redis_url"]
    assert SECRET not in redact_url(url)


def test_redact_url_keeps_the_rest() -> None:
    assert redact_url("redis://u:pw@h:1/2") == "redis://u:***@h:1/2"
    assert redact_url("redis://h:1/2?db=3") == "redis://h:1/2?db=3"
    assert redact_url("unix:///s.sock?password=pw&db=1") == "unix:///s.sock?password=***&db=1"


@pytest.mark.slow
def test_worker_logs_and_status_never_show_the_password(
    secret_redis: tuple[str, str],
    queue: str,
    caplog: pytest.LogCaptureFixture,
    start_worker: Callable[..., WorkerThread],
) -> None:
    url, password = secret_redis
    caplog.set_level(logging.DEBUG)
    worker = start_worker(redis_url=url, worker_id=f"secret-{queue}"[:100])
    with Producer(redis_url=url, queue=queue) as producer:
        assert producer.infer("hello", timeout_s=60) == "hello"
        assert password not in repr(producer)
    env = {"BATCHLINE_REDIS_URL": url, "BATCHLINE_QUEUE": queue}
    status = run_cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["redis"].startswith("redis://bltest:***@")
    rendered = run_cli("status", env=env)
    assert rendered.returncode == 0, rendered.stderr
    check = run_cli("worker", "--check", "--worker-id", worker.worker.worker_id, env=env)
    assert check.returncode == 0, check.stderr
    worker.stop()
    for done in (status, rendered, check):
        assert password not in done.stdout + done.stderr
    assert password not in repr(worker.worker)
    messages = [record.getMessage() for record in caplog.records]
    assert any("bltest:***@" in m for m in messages), messages  # the start-up line is there
    assert not [m for m in messages if password in m]
    assert password not in caplog.text
