"""The ``batchline`` command as a new user meets it: help texts for users, and one clear line
(no traceback) when Redis is not there; a worker waits for Redis before loading its model.
The configuration and command-line pages, generated from the same settings and parser, are
checked against ``--help`` in tests/docs/test_generated_pages.py."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import redis

from batchline.demo.embedded import EmbeddedRedis
from batchline.keys import QueueKeys

from .conftest import (
    REPO,
    run_cli,
    spec,
    subprocess_env,
    wait_until,
)


def _free_port() -> int:
    """A loopback port nothing listens on (bound and released: nothing answers there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_top_level_help_is_for_users() -> None:
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr
    assert "``" not in done.stdout
    demo = re.search(r"^\s+demo\s+(.*?)\n\n", done.stdout, re.M | re.S)
    assert demo is not None, done.stdout
    assert "Redis" in demo.group(1), done.stdout
    assert "BATCHLINE_REDIS_URL" in done.stdout


def _one_clear_line(stderr: str, url_shown: str, password: str) -> None:
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("batchline: Redis at " + url_shown), stderr
    assert "BATCHLINE_REDIS_URL" in last
    assert password not in stderr


def test_status_without_redis_is_one_line_naming_the_url_and_setting() -> None:
    port = _free_port()
    url = f"redis://user:s3cret-pw@127.0.0.1:{port}/0"
    done = run_cli("status", env={"BATCHLINE_REDIS_URL": url}, timeout_s=30)
    assert done.returncode != 0
    _one_clear_line(done.stderr, f"redis://user:***@127.0.0.1:{port}/0", "s3cret-pw")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_worker_gives_up_after_redis_wait_s_without_loading_its_model() -> None:
    port = _free_port()
    url = f"redis://:s3cret-pw@127.0.0.1:{port}/0"
    # A model that cannot be imported: loading it first would fail with ModuleNotFoundError.
    done = run_cli(
        "worker",
        "--model",
        "no_such_module_anywhere:predict",
        "--redis-wait-s",
        "1",
        env={"BATCHLINE_REDIS_URL": url},
        timeout_s=60,
    )
    assert done.returncode == 1, done.stderr
    _one_clear_line(done.stderr, f"redis://:***@127.0.0.1:{port}/0", "s3cret-pw")
    assert "retrying in" in done.stderr  # it did retry, and said so
    assert "ModuleNotFoundError" not in done.stderr


def test_worker_started_before_redis_waits_for_it_then_serves(tmp_path: Path) -> None:
    server = EmbeddedRedis()
    log_path = tmp_path / "worker.log"
    queue = "t-wait-for-redis"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchline", "worker", "--model", spec("echo")],
            env=subprocess_env(
                {
                    "BATCHLINE_REDIS_URL": server.url,
                    "BATCHLINE_QUEUE": queue,
                    "BATCHLINE_REDIS_WAIT_S": "120",
                    "BATCHLINE_HEARTBEAT_S": "0.5",
                }
            ),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: "retrying in" in log_path.read_text(), "the worker to retry")
        assert proc.poll() is None, log_path.read_text()
        server.start()
        client = redis.Redis.from_url(server.url)
        keys = QueueKeys(queue)
        wait_until(lambda: client.zcard(keys.workers) > 0, "the worker's first heartbeat")
        from batchline.producer import Producer

        with Producer(redis_url=server.url, queue=queue) as producer:
            assert producer.infer("hello", timeout_s=60) == "hello"
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
        server.stop()
    assert proc.returncode == 0, log_path.read_text()
    assert "Traceback" not in log_path.read_text()
