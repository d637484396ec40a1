"""The ``batchline`` command: thin (parse, load settings, configure logging, run).

The argument parser is the one truth of which command takes which option: its help texts,
and :func:`cli_reference` (what the documentation's CLI page is generated from), are both
read from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from batchline.cli._batch import batch_parser
from batchline.cli._options import (
    CliCommand,
    add_option,
    add_settings,
    positive,
    reference,
    settings_from,
)
from batchline.logs import bind as bind_logs
from batchline.logs import configure as configure_logs

__all__ = ["cli_reference", "main"]

USAGE = """\
commands:
  batchline demo                   the whole service on one machine: a private Redis, a worker
                                   serving all-MiniLM-L6-v2, a rising load (about 1 minute)
  batchline demo --in-process      the in-process batcher (batchline.dynamically), no Redis
  batchline demo --generate        chat prompts answered live by a text-generation worker
  batchline worker [--batch-size 64 ...]
                                   serve a queue (settings: flags, else BATCHLINE_* variables)
  batchline worker --check         exit 0 if a worker on this host is alive
  batchline status [--json]        queue depth, pending, lag, dead letters, workers
  batchline acl [--role worker]    the ACL SETUSER lines of the queue's Redis users
  batchline batch FILE.jsonl [--url http://localhost:8000]
                                   run a file of requests through the web API's /v1/batches

Redis: BATCHLINE_REDIS_URL (default redis://localhost:6379/0). `batchline COMMAND --help`
lists each command's options with their defaults and environment variables.
Exit status: 2 and one line saying what is accepted for a bad option, setting or file; 1
when Redis does not answer, a worker's model does not load, a health check or a batch
fails. Ctrl-C stops any command with exit status 130 (a worker first answers what it read,
the demo first stops what it started); SIGTERM drains a worker the same way, with exit
status 0.
"""

#: The settings each command takes (the worker: all of WorkerSettings). ``status`` and
#: ``acl`` read no model and write nothing: the Redis and queue settings, or the names alone.
_STATUS_SETTINGS = ("redis_url", "redis_cluster", "queue", "prefix", "priorities", "redis_wait_s")
_ACL_SETTINGS = ("queue", "prefix")
#: A person typing ``batchline status`` wants an answer now: one try, unless a wait is set.
_STATUS_DEFAULTS = {"redis_wait_s": 0.0}

#: Which ``batchline demo`` options each of its three modes reads.
_DEMO_MODES = {
    "service": ("requests", "plot", "step_s"),
    "in_process": ("requests", "threads"),
    "generate": ("model_path",),
}
_DEMO_STEP_S = 1.5
_DEMO_THREADS = 64
_DEMO_IN_PROCESS_ITEMS = 2000


def cli_reference() -> tuple[CliCommand, ...]:
    """Every command of ``batchline`` (the top level first, then each subcommand), with each
    option's flag, help, default and environment variable, exactly as ``--help`` shows them.

    The documentation's CLI page is generated from this, so it cannot drift from the parser.
    """
    parser, commands = _parsers()
    return reference(parser, commands)


class UsageError(ValueError):
    """A bad option, setting or file, or options that do not go together (exit status 2 and
    one line, as the parser's own errors)."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (its own print the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _settings(cls: Any, args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> Any:
    from batchline.config import check_environment

    try:
        check_environment()
        return settings_from(cls, args, defaults or {})
    except ValidationError as exc:
        problems = "; ".join(_problem(error, args) for error in exc.errors())
        raise UsageError(f"invalid settings: {problems}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _problem(error: Any, args: argparse.Namespace) -> str:
    """One invalid setting: the flag or the variable that gave it, what is wrong, and (but
    for the URL, which may hold a password) the value."""
    name = str(error["loc"][0]) if error["loc"] else ""
    message = str(error["msg"]).removeprefix("Value error, ")
    if not name:
        return f"settings: {message}"
    given = getattr(args, name, None)
    where = f"--{name.replace('_', '-')}" if given is not None else f"BATCHLINE_{name.upper()}"
    shown = given if given is not None else os.environ.get(f"BATCHLINE_{name.upper()}")
    if name != "redis_url" and shown is not None and "got " not in message:
        message += f", got {shown!r}"
    return f"{where}: {message}"


def command_settings(command: str, args: argparse.Namespace) -> Any:
    """The settings ``command`` runs with, from its parsed ``args`` and the environment."""
    from batchline.config import ServiceSettings, WorkerSettings

    if command == "worker":
        return _settings(WorkerSettings, args)
    if command == "status":
        return _settings(ServiceSettings, args, _STATUS_DEFAULTS)
    if command == "acl":
        return _settings(ServiceSettings, args)
    raise ValueError(f"the command {command!r} takes no settings")


def _model(spec: str, path: str | None, **options: Any) -> None:
    """UsageError if the model settings are wrong in a way seen without loading it (an
    unknown kind, a local path that is not there, options of another backend)."""
    from batchline.worker.models import load_model

    try:
        load_model(spec, path=path, **options)  # made, not loaded
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _worker(args: argparse.Namespace) -> int:
    settings = command_settings("worker", args)
    if args.check:
        return asyncio.run(_check(settings, args.max_age_s))
    if args.max_age_s is not None:
        raise UsageError("--max-age-s is for --check only")
    s = settings
    _model(s.model, s.model_path, backend=s.backend, device=s.device, calibration=s.calibration)
    from batchline.worker._supervisor import report_ready, supervise

    supervised = settings.max_restarts_per_min > 0
    if supervised and args.supervised_child is None:
        # Run the worker in a child process, restarted if it dies.
        return supervise(args.argv, max_restarts_per_min=settings.max_restarts_per_min)
    import signal

    from batchline.errors import ModelNotLoaded, WorkerHung
    from batchline.transport._event_loop import EXIT_INTERRUPTED, run
    from batchline.worker import Worker
    from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE

    worker = Worker(settings)
    bind_logs(worker_id=worker.worker_id, queue=worker.keys.queue)
    worker.exit_if_loop_blocked = True
    if args.supervised_child is not None:
        report_ready(args.supervised_child, worker.ready)
    if args.bound_file is not None:
        worker.bound_file = Path(args.bound_file)
    try:
        run(worker.run(), event_loop=settings.event_loop)
    except ModelNotLoaded as exc:
        print(f"batchline: {exc}", file=sys.stderr)
        return 1
    except WorkerHung:
        logging.shutdown()
        os._exit(HUNG_EXIT_CODE)  # the hung model's thread cannot be stopped otherwise
    return EXIT_INTERRUPTED if worker.stop_signal == signal.SIGINT else 0


async def _check(settings: Any, max_age_s: float | None) -> int:
    """Health check: a worker of this host (or ``worker_id``) sent a heartbeat lately."""
    from batchline.keys import host_id
    from batchline.transport._redis import connect
    from batchline.transport.status import LIVE_WITHIN_S

    max_age_s = LIVE_WITHIN_S if max_age_s is None else max_age_s
    client = connect(settings)
    try:
        beats = await client.zrangebyscore(settings.keys.workers, time.time() - max_age_s, "+inf")
    except Exception as exc:
        print(f"unhealthy: Redis unreachable ({type(exc).__name__})", file=sys.stderr)
        return 1
    finally:
        await client.aclose()
    want = settings.worker_id or host_id() + "-"
    names = [b.decode() for b in beats]
    # A worker_id names one worker (w1 is not w12); without one, any worker of this host.
    alive = [n for n in names if n == want or (not settings.worker_id and n.startswith(want))]
    if not alive:
        print(f"unhealthy: no heartbeat from {want}* within {max_age_s:g} s", file=sys.stderr)
        return 1
    print(f"healthy: {', '.join(alive)}")
    return 0


def _status(args: argparse.Namespace) -> int:
    settings = command_settings("status", args)

    async def run() -> dict[str, Any]:
        from batchline.transport._redis import connect, wait_for_redis
        from batchline.transport.status import collect

        client = connect(settings)
        try:
            await wait_for_redis(client, settings, wait_s=settings.redis_wait_s)
            return await collect(settings, client)
        finally:
            await client.aclose()

    from batchline.transport.status import render

    status = asyncio.run(run())
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0


def _acl(args: argparse.Namespace) -> int:
    from batchline.acl import ROLES, acl_setuser
    from batchline.keys import QueueKeys

    settings = command_settings("acl", args)
    keys = QueueKeys(settings.queue, settings.prefix)  # the rules cover every priority's stream
    if args.batch_api and args.role == "worker":
        raise UsageError("--batch-api adds to the producer user: not with --role worker")
    for role in ROLES if args.role == "both" else (args.role,):
        batch_api = args.batch_api and role == "producer"
        print(acl_setuser(keys, role, user=f"{keys.prefix}-{role}", batch_api=batch_api))
    return 0


def demo_mode(args: argparse.Namespace) -> str:
    """The demo's mode (``service``, ``in_process``, ``generate``); UsageError naming any
    option given that this mode would ignore."""
    if args.generate and args.in_process:
        raise UsageError("demo takes --generate or --in-process, not both")
    mode = "generate" if args.generate else "in_process" if args.in_process else "service"
    ignored = [
        f"--{name.replace('_', '-')}"
        for other in _DEMO_MODES.values()
        for name in other
        if name not in _DEMO_MODES[mode] and getattr(args, name) is not None
    ]
    if ignored:
        what = {"service": "the demo over Redis", "in_process": "--in-process"}.get(
            mode, "--generate"
        )
        raise UsageError(f"{what} does not take {', '.join(sorted(set(ignored)))}")
    return mode


#: The files ``--plot`` writes, by suffix.
_PLOTS = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp")


def _demo(args: argparse.Namespace) -> int:
    mode = demo_mode(args)
    if mode != "in_process":
        from batchline.config import ServiceSettings

        _settings(ServiceSettings, argparse.Namespace())  # BATCHLINE_REDIS_URL, if set
    if args.plot is not None:
        plot = Path(args.plot)
        if plot.suffix.lower() not in _PLOTS or not plot.parent.is_dir():
            raise UsageError(
                f"--plot takes a {', '.join(_PLOTS)} file in a directory that exists, got "
                f"{args.plot!r}"
            )
    if mode == "generate":
        _model("generate", args.model_path)
        from batchline.demo.generate import run_generate_demo

        return run_generate_demo(model_path=args.model_path)
    if mode == "in_process":
        from batchline.demo import run_demo

        return run_demo(
            items=args.requests or _DEMO_IN_PROCESS_ITEMS, threads=args.threads or _DEMO_THREADS
        )
    from batchline.demo.service import run_service_demo

    step_s = _DEMO_STEP_S if args.step_s is None else args.step_s
    return run_service_demo(requests=args.requests, plot=args.plot, step_s=step_s)


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each command's."""
    from batchline.config import ServiceSettings, WorkerSettings
    from batchline.demo.service import RATES
    from batchline.transport.status import LIVE_WITHIN_S

    parser = _Parser(
        prog="batchline",
        description="Dynamic batching for model inference: run the demo, a worker serving a "
        "queue over Redis, look at a queue, or print its ACL users.",
        epilog=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_option(
        parser,
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        metavar="LEVEL",
        text="logging level: DEBUG, INFO, WARNING or ERROR",
        shown="INFO",
    )
    add_option(
        parser,
        "--log-format",
        default="text",
        choices=("text", "json"),
        metavar="FORMAT",
        text="log lines as text, or json: one object per line (time, level, logger, message, "
        "and the worker id, queue, request id and trace id where known)",
        shown="text",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = sub.add_parser(
        "worker",
        help="serve a queue: read requests from Redis, batch them, run the model, answer",
        description="Serve a queue: read requests from Redis, batch them, run the model, "
        "answer; it logs one line starting with 'ready:' once it serves. Each setting is a "
        "flag or a BATCHLINE_<NAME> environment variable (the flag wins). SIGTERM drains "
        "(stop reading, answer what was read) and exits 0; Ctrl-C drains the same way and "
        "exits 130, also while the worker still waits for Redis or loads its model.",
    )
    add_settings(worker, WorkerSettings, tuple(WorkerSettings.model_fields))
    add_option(
        worker,
        "--check",
        action="store_true",
        text="health check instead of serving: exit 0 if a worker of this host (or the one "
        "--worker-id names) sent a heartbeat within --max-age-s, else 1; reads only the Redis, "
        "queue and worker_id settings",
    )
    add_option(
        worker,
        "--max-age-s",
        type=positive(float),
        metavar="SECONDS",
        default=None,
        text="with --check: the oldest heartbeat that counts, in seconds",
        shown=f"{LIVE_WITHIN_S:g}",
    )
    worker.add_argument("--supervised-child", type=int, help=argparse.SUPPRESS)
    worker.add_argument("--bound-file", help=argparse.SUPPRESS)
    worker.set_defaults(run=_worker)

    status = sub.add_parser(
        "status",
        help="queue depth, pending, lag, dead letters, workers",
        description="Print a queue's depth, pending requests, lag, dead letters and live "
        "workers. It tries Redis once, unless --redis-wait-s (or BATCHLINE_REDIS_WAIT_S) "
        "allows a wait.",
    )
    add_settings(status, ServiceSettings, _STATUS_SETTINGS, _STATUS_DEFAULTS)
    add_option(
        status,
        "--json",
        action="store_true",
        text="print the figures as JSON (per work stream: length, pending, lag, backlog)",
    )
    status.set_defaults(run=_status)

    about_acl = "print the ACL SETUSER lines of the producer and worker users (Redis >= 7)"
    acl = sub.add_parser(
        "acl",
        help=about_acl,
        description="Print the ACL SETUSER commands (redis-cli arguments) that create the "
        "queue's producer and worker users, named <prefix>-producer and <prefix>-worker, "
        "each allowed the queue's keys and commands only (Redis >= 7; docs/protocol.md, "
        "Access control). Add each user's password ('>secret') before running them. It "
        "connects to nothing.",
    )
    add_settings(acl, ServiceSettings, _ACL_SETTINGS)
    add_option(
        acl,
        "--role",
        choices=["producer", "worker", "both"],
        default="both",
        text="whose line to print: the producer's, the worker's, or both",
        shown="both",
    )
    add_option(
        acl,
        "--batch-api",
        action="store_true",
        text="give the producer user the Batch API's keys too (<prefix>:{batchapi}:*, every "
        "tenant's files and batches): for the web backend serving /v1/files and /v1/batches",
    )
    acl.set_defaults(run=_acl)

    about = (
        "the service end to end on one machine: a private Redis (unless BATCHLINE_REDIS_URL "
        "is set), a worker process serving all-MiniLM-L6-v2, sentences at a rising load"
    )
    demo = sub.add_parser(
        "demo",
        help=about,
        description=about[0].upper() + about[1:] + ". With --in-process, the in-process "
        "batcher instead; with --generate, a text-generation worker. Ctrl-C stops it in any "
        "phase with one line and exit status 130.",
    )
    rates = "/".join(str(r) for r in RATES)
    add_option(
        demo,
        "--requests",
        type=positive(int),
        metavar="N",
        text="most sentences to send (over Redis, or with --in-process)",
        shown=f"as many as the load steps send ({rates} req/s for --step-s each); with "
        f"--in-process {_DEMO_IN_PROCESS_ITEMS}",
    )
    add_option(
        demo,
        "--plot",
        metavar="FILE.png",
        text="over Redis: draw throughput, latency and batch size against the offered load",
    )
    add_option(
        demo,
        "--step-s",
        type=positive(float),
        metavar="SECONDS",
        text="over Redis: seconds per load step",
        shown=f"{_DEMO_STEP_S:g}",
    )
    add_option(
        demo,
        "--in-process",
        action="store_true",
        text="instead: the in-process batcher (batchline.dynamically) alone, no Redis",
    )
    add_option(
        demo,
        "--threads",
        type=positive(int),
        metavar="N",
        text="with --in-process: concurrent callers",
        shown=str(_DEMO_THREADS),
    )
    add_option(
        demo,
        "--generate",
        action="store_true",
        text="instead: a few chat prompts answered live through Redis by a --model generate "
        "worker (SmolLM2-135M-Instruct), with tokens/s",
    )
    add_option(
        demo,
        "--model-path",
        metavar="PATH",
        text="with --generate: the worker's model_path",
        shown="smollm2",
    )
    demo.set_defaults(run=_demo)
    batch = batch_parser(sub)
    return parser, {"worker": worker, "status": status, "acl": acl, "demo": demo, "batch": batch}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchline`` command and ``python -m batchline``."""
    from batchline.transport._event_loop import EXIT_INTERRUPTED
    from batchline.transport._redis import RedisUnreachable

    try:
        args = _parsers()[0].parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        configure_logs(args.log_level, args.log_format)
        return int(args.run(args))
    except UsageError as exc:
        print(f"batchline: {exc}", file=sys.stderr)
        return 2
    except RedisUnreachable as exc:
        print(f"batchline: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("batchline: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
