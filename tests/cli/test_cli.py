"""The ``batchline`` command as a new user meets it: help texts that are true (each option a
command lists is one it reads, with the default it uses; the parser is what the docs are
generated from), and one clear line (no traceback) when Redis is not there; a worker waits
for Redis before loading its model. The configuration and command-line pages, generated from
the same settings and parser, are checked against ``--help`` in
tests/docs/test_generated_pages.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline.cli import CliCommand, CliOption, cli_reference, command_settings, main
from batchline.cli._main import _parsers
from batchline.config import ServiceSettings, WorkerSettings
from batchline.demo.embedded import EmbeddedRedis
from batchline.devices import cpu_bf16_flags
from batchline.keys import QueueKeys
from batchline.producer import Producer

from tests.support.service import (
    REPO,
    RESULT_TIMEOUT_S,
    START_TIMEOUT_S,
    AtTerminal,
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


def _commands() -> dict[str, CliCommand]:
    return {c.name.removeprefix("batchline").strip(): c for c in cli_reference()}


def _settings_options(command: str) -> dict[str, CliOption]:
    """A command's options that are settings (those with a variable), by setting name."""
    return {
        o.env.removeprefix("BATCHLINE_").lower(): o
        for o in _commands()[command].options
        if o.env is not None
    }


def _help_options(command: str) -> dict[str, str]:
    """Each option of ``batchline COMMAND --help`` (``-h`` aside): its line(s), joined."""
    args = [command, "--help"] if command else ["--help"]
    done = run_cli(*args, env={"COLUMNS": "2000"})
    assert done.returncode == 0, done.stderr
    body = done.stdout.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    found: dict[str, str] = {}
    last = None
    for line in body.splitlines():
        match = re.match(r"^  (--[\w-]+)(.*)$", line)
        if match:
            last = match.group(1)
            found[last] = match.group(2).strip()
        elif line.startswith("  -h, --help"):
            last = None
        elif last is not None and line.startswith(" " * 8):  # a long value pushes its text
            found[last] += " " + line.strip()
        else:
            raise AssertionError(f"an option line that is not one: {line!r}")
    return found


@pytest.mark.parametrize("command", ["", "worker", "status", "acl", "demo"])
@pytest.mark.slow
def test_each_help_shows_exactly_the_reference(command: str) -> None:
    """What ``--help`` prints and what the docs are generated from are the same, option by
    option: flag, value, text, variable and default."""
    reference = _commands()[command]
    shown = _help_options(command)
    assert list(shown) == [o.name for o in reference.options]
    for option in reference.options:
        suffix = "; ".join(
            p
            for p in (
                option.env and f"env {option.env}",
                option.default is not None and f"default {option.default}",
            )
            if p
        )
        want = f"{option.metavar or ''} {option.help}".strip() + (f" [{suffix}]" if suffix else "")
        assert re.sub(r"\s+", " ", shown[option.name]) == want, option.name
    assert "``" not in str(reference)
    assert "(secret)" not in str(reference)


def test_no_help_text_states_a_default_of_its_own() -> None:
    """The default is said once, in the ``[... default X]`` the parser writes: a text that
    gave one too drifted from it (``worker_id``'s host-pid against host-pid-random)."""
    for command in cli_reference():
        for option in command.options:
            assert not re.search(r"\(default|default:", option.help), (command.name, option)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "get_secret_value"):
        return str(value.get_secret_value())
    return "none" if value is None else str(value)


#: Settings whose default (none) the help says in words, with what the worker makes of it.
SAID_IN_WORDS = {"model_path", "worker_id", "threads"}


@pytest.mark.parametrize("command", ["worker", "status", "acl"])
def test_each_default_shown_is_the_one_the_command_uses(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.upper().startswith("BATCHLINE_"):
            monkeypatch.delenv(name)
    settings = command_settings(command, _parsers()[0].parse_args([command]))
    for name, option in _settings_options(command).items():
        value = getattr(settings, name)
        if name in SAID_IN_WORDS:
            assert value is None
            assert option.default not in (None, "none"), name
        else:
            assert option.default == _shown(value), (command, name, value)
    # status tries Redis once unless told otherwise, and says so.
    if command == "status":
        assert settings.redis_wait_s == 0
    parsed = _parsers()[0].parse_args([command])
    for action in _parsers()[1][command]._actions:
        option = getattr(action, "batchline_option", None)
        if option is not None and option.env is None and option.default is not None:
            default = getattr(parsed, action.dest)
            if default is not None:  # an option whose default the command fills in
                assert option.default == str(default), option.name


def test_the_worker_takes_every_worker_setting_and_the_others_only_theirs() -> None:
    assert set(_settings_options("worker")) == set(WorkerSettings.model_fields)
    assert set(_settings_options("status")) < set(ServiceSettings.model_fields)
    assert set(_settings_options("acl")) < set(ServiceSettings.model_fields)
    for command in ("worker", "status", "acl"):
        for name, option in _settings_options(command).items():
            assert option.env == "BATCHLINE_" + name.upper()
            assert option.name == "--" + name.replace("_", "-")


def _recording(cls: type, read: set[str]) -> type:
    """A subclass of the settings class ``cls`` that notes each setting read into ``read``."""

    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
        if name in cls.model_fields:  # type: ignore[attr-defined]
            read.add(name)
        return cls.__getattribute__(self, name)  # type: ignore[arg-type]

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["status"], "status"),
        (["status", "--json"], "status"),
        (["acl"], "acl"),
        (["acl", "--role", "worker"], "acl"),
    ],
)
def test_a_command_reads_exactly_the_settings_its_help_lists(
    args: list[str],
    command: str,
    redis_url: str,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import batchline.config

    read: set[str] = set()
    monkeypatch.setattr(batchline.config, "ServiceSettings", _recording(ServiceSettings, read))
    monkeypatch.setenv("BATCHLINE_REDIS_URL", redis_url)
    monkeypatch.setenv("BATCHLINE_QUEUE", queue)
    assert main(args) == 0, capsys.readouterr()
    assert read == set(_settings_options(command)), args


@pytest.mark.slow
def test_a_worker_reads_every_setting_its_help_lists(
    redis_url: str, queue: str, rclient: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batchline worker`` in this process (no supervisor), serving until SIGTERM: an
    embedding-style worker and a generation worker read every setting between them."""
    pytest.importorskip("transformers")
    import batchline.config

    read: set[str] = set()
    monkeypatch.setattr(batchline.config, "WorkerSettings", _recording(WorkerSettings, read))
    keys = QueueKeys(queue)
    runs = [
        ["--model", spec("echo")],
        ["--model", "generate", "--model-path", spec("tiny_llama"), "--batch-size", "2"],
        # A worker of several queues (one here) and a model loaded by demand:
        ["--serve", f"{queue}={spec('echo')},load=demand,unload_idle_s=60"]
        + ["--serve-turns", "true", "--memory-budget-mb", "64"],
    ]
    for k, model in enumerate(runs):
        worker_id = f"reads-{k}-{queue}"[:80]
        serving = f"{worker_id}-{queue}" if "--serve" in model else worker_id

        def stop_when_serving(worker_id: str = serving) -> None:
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if rclient.zscore(keys.workers, worker_id) is not None:
                    os.kill(os.getpid(), signal.SIGTERM)  # the worker's own handler drains
                    return
                time.sleep(0.05)

        stopper = threading.Thread(target=stop_when_serving, daemon=True)
        stopper.start()
        args = ["--redis-url", redis_url, "--queue", queue, "--worker-id", worker_id]
        args += ["--max-restarts-per-min", "0", "--heartbeat-s", "0.2", *model]
        assert main(["worker", *args]) == 0
        stopper.join(5)
    assert read == set(_settings_options("worker"))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo", "--in-process", "--step-s", "1"], "--in-process does not take --step-s"),
        (["demo", "--in-process", "--plot", "a.png"], "--in-process does not take --plot"),
        (["demo", "--generate", "--requests", "5"], "--generate does not take --requests"),
        (["demo", "--threads", "8"], "the demo over Redis does not take --threads"),
        (["demo", "--model-path", "x"], "the demo over Redis does not take --model-path"),
        (["demo", "--generate", "--in-process"], "not both"),
        (["demo", "--in-process", "--redis-server", "x"], "--in-process does not take --redis-"),
        (["demo", "--redis-server", "/no/such/redis-server"], "is not a redis-server that runs"),
        (["worker", "--max-age-s", "3"], "--max-age-s is for --check only"),
    ],
)
def test_an_option_a_mode_would_ignore_is_refused(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    assert says in capsys.readouterr().err


def test_the_demo_starts_a_private_redis_or_uses_the_named_one_not_both(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_REDIS_URL", "redis://localhost:1/0")
    assert main(["demo", "--generate", "--redis-server", "redis-server"]) == 2
    assert "BATCHLINE_REDIS_URL names one to use: give one or the other" in capsys.readouterr().err


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- Ctrl-C: one exit status, 130, from every command -------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "--model", "no_such_module_anywhere:predict"],  # supervised, as by default
        ["worker", "--model", "no_such_module_anywhere:predict", "--max-restarts-per-min", "0"],
        ["status"],
    ],
    ids=["worker", "worker-unsupervised", "status"],
)
@pytest.mark.slow
def test_ctrl_c_while_waiting_for_redis_exits_130_with_one_line(args: list[str]) -> None:
    env = {
        "BATCHLINE_REDIS_URL": f"redis://127.0.0.1:{_free_port()}/0",
        "BATCHLINE_REDIS_WAIT_S": "120",
    }
    with AtTerminal(*args, env=env) as command:
        command.wait_for("retrying in")
        status, took_s, _after = command.ctrl_c()
    out = command.output
    assert status == 130, out
    assert took_s < 10.0, (took_s, out)
    assert "Traceback" not in out, out
    last = out.strip().splitlines()[-1]
    if args[0] == "worker":  # it stops (once, however many SIGINTs reach it) and says so
        assert last.endswith(": SIGINT: stopping before it served"), out
        assert out.count("SIGINT") == 1, out
    else:
        assert last == "batchline: interrupted", out


@pytest.mark.parametrize("supervised", [True, False])
@pytest.mark.slow
def test_ctrl_c_while_serving_drains_then_exits_130(
    supervised: bool, redis_url: str, queue: str, rclient: redis.Redis
) -> None:
    keys = QueueKeys(queue)
    worker_id = f"ctrl-c-{supervised}-{queue}"[:100]
    args = ["worker", "--redis-url", redis_url, "--queue", queue, "--model", spec("echo")]
    args += ["--worker-id", worker_id, "--heartbeat-s", "0.2"]
    if not supervised:
        args += ["--max-restarts-per-min", "0"]
    with AtTerminal(*args) as worker:
        worker.wait_for(f"ready: queue {queue}")
        with Producer(redis_url=redis_url, queue=queue) as producer:
            assert producer.infer("before", timeout_s=RESULT_TIMEOUT_S) == "before"
        status, took_s, _after = worker.ctrl_c()
    assert status == 130, worker.output
    assert took_s < 10.0, (took_s, worker.output)
    assert "Traceback" not in worker.output, worker.output
    assert "SIGINT: draining" in worker.output, worker.output
    assert rclient.zscore(keys.workers, worker_id) is None  # it took itself off the list


@pytest.mark.slow
def test_sigterm_drains_a_worker_with_exit_status_0(redis_url: str, queue: str) -> None:
    args = ["worker", "--redis-url", redis_url, "--queue", queue, "--model", spec("echo")]
    with AtTerminal(*args) as worker:
        worker.wait_for(f"ready: queue {queue}")
        os.kill(worker.proc.pid, signal.SIGTERM)  # the supervisor, as an orchestrator does
        assert worker.proc.wait(30) == 0, worker.output
    assert "SIGTERM: draining" in worker.output, worker.output


# -- the ready line ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "ready"),
    [
        (
            ["--model", "sentence-transformers"],
            "model sentence-transformers all-MiniLM-L6-v2, device cpu, "
            f"dtype {'bfloat16' if cpu_bf16_flags() else 'float32'}, batch 32",  # dtype auto
        ),
        (
            ["--model", "generate", "--model-path", spec("tiny_llama"), "--batch-size", "4"],
            f"model generate {spec('tiny_llama')}, device cpu, dtype float64, "
            "batch 4 sequences, KV budget 16384 tokens",
        ),
        (
            ["--model", spec("echo"), "--target-p99-ms", "50"],
            f"model {spec('echo')}, batch up to 32, chosen for p99 <= 50 ms",
        ),
    ],
    ids=["embeddings", "generation", "function"],
)
@pytest.mark.slow
def test_a_worker_says_once_it_serves_with_what(
    model: list[str], ready: str, redis_url: str, queue: str
) -> None:
    """The last line a starting worker logs is its ready line, after its model's own output
    (a weights-loading progress bar)."""
    if model[1] == "sentence-transformers":
        pytest.importorskip("sentence_transformers")
    if model[1] == "generate":
        pytest.importorskip("transformers")
    args = ["worker", "--redis-url", redis_url, "--queue", queue, "--device", "cpu", *model]
    with AtTerminal(*args, env={"HF_HUB_OFFLINE": "1"}) as worker:
        worker.wait_for("ready:", timeout_s=120)
        lines = [line for line in worker.output.splitlines() if line.strip()]
        with Producer(redis_url=redis_url, queue=queue) as producer:
            value = {"prompt": "hi", "max_new_tokens": 2} if "generate" in model else "hi"
            producer.infer(value, timeout_s=RESULT_TIMEOUT_S)  # it serves
        status, _took_s, _after = worker.ctrl_c()
    assert status == 130, worker.output
    (line,) = [line for line in lines if "ready:" in line]
    assert line == lines[-1], worker.output
    assert line.split(" INFO batchline.worker._worker: ", 1)[1] == f"ready: queue {queue}, {ready}"


GPU_2 = "gpu-2"
# Two pods of one Deployment whose names (55 characters) share their first 49.
POD_A = "batchline-embedding-workers-production-7d9f8c6b5d-xk2lq"
POD_B = "batchline-embedding-workers-production-7d9f8c6b5d-q8v2n"


@pytest.mark.parametrize(
    ("host", "healthy"),
    [("gpu", False), (POD_A, False), (GPU_2, True), (POD_B, True)],
)
def test_worker_check_counts_the_workers_of_this_host_only(
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    host: str,
    healthy: bool,
) -> None:
    """Heartbeats from a worker of host gpu-2 and one of pod B: the check on host gpu, or on
    pod A (whose own worker is gone), finds none of its own; on gpu-2 or pod B it does."""
    from batchline.keys import host_id

    assert len(POD_A) == len(POD_B) == 55
    assert POD_A[:40] == POD_B[:40]
    beats = {}
    for pid, name in enumerate((GPU_2, POD_B), start=7):  # each worker's id, as on its host
        monkeypatch.setattr(socket, "gethostname", lambda name=name: name)
        beats[name] = f"{host_id()}-{pid}-0a1b2c"
    rclient.zadd(QueueKeys(queue).workers, {worker: time.time() for worker in beats.values()})
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    code = main(["worker", "--check", "--redis-url", redis_url, "--queue", queue])
    assert code == (0 if healthy else 1)
    assert beats[POD_B].startswith(POD_B[:33] + "-")  # readable: the name, then a hash
    assert len(beats[POD_B].rsplit("-", 2)[0]) == 40
