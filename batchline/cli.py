"""The ``batchline`` command: thin (parse, load settings, configure logging, run)."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

__all__ = ["main"]

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

Redis: BATCHLINE_REDIS_URL (default redis://localhost:6379/0). `batchline COMMAND --help`
lists each command's settings with their defaults.
"""

# What --help shows as a setting's default where the value itself says too little.
_SHOWN_DEFAULTS = {
    "model_path": "all-MiniLM-L6-v2",
    "worker_id": "host-pid-random",
    "threads": "available cores",
}


def _shown_default(name: str, info: Any) -> str:
    """A setting's default as the README's configuration table writes it."""
    if name in _SHOWN_DEFAULTS:
        return _SHOWN_DEFAULTS[name]
    value = info.default
    if name == "redis_url":  # the default holds no password; a given URL is never shown
        return str(value.get_secret_value())
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _field_docs(cls: type) -> dict[str, str]:
    """Each setting's description, from the ``Attributes:`` sections of the class docstrings."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        text = inspect.cleandoc(klass.__doc__ or "")
        if "Attributes:" not in text:
            continue
        name = None
        for line in text.split("Attributes:", 1)[1].splitlines():
            match = re.match(r"^    (\w+): (.*)$", line)
            if match:
                name = match.group(1)
                docs[name] = match.group(2)
            elif name and line.startswith("        "):
                docs[name] += " " + line.strip()
            elif line.strip():
                name = None
    return docs


_METAVARS = {"redis_cluster": "{true,false}", "redis_url": "URL", "model": "MODEL"}


def _add_settings(parser: argparse.ArgumentParser, cls: Any) -> None:
    docs = _field_docs(cls)
    for name, info in cls.model_fields.items():
        default = _shown_default(name, info)
        env = f"BATCHLINE_{name.upper()}"
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            metavar=_METAVARS.get(name, "VALUE"),
            help=f"{docs.get(name, '').replace('``', '')} [env {env}; default {default}]",
        )


def _settings(cls: Any, args: argparse.Namespace) -> Any:
    from batchline.config import check_environment

    given = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    try:
        check_environment()
        return cls(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'BATCHLINE_' + str(e['loc'][0]).upper() if e['loc'] else 'settings'}: {e['msg']}"
            for e in exc.errors()
        )
        raise SystemExit(f"batchline: invalid settings: {problems}") from None
    except ValueError as exc:
        raise SystemExit(f"batchline: {exc}") from None


def _worker(args: argparse.Namespace) -> int:
    from batchline.config import WorkerSettings

    settings = _settings(WorkerSettings, args)
    if args.check:
        return asyncio.run(_check(settings, args.max_age_s))
    from batchline.worker._supervisor import report_ready, supervise

    supervised = settings.max_restarts_per_min > 0
    if supervised and args.supervised_child is None:
        # Run the worker in a child process, restarted if it dies.
        return supervise(args.argv, max_restarts_per_min=settings.max_restarts_per_min)
    from batchline.errors import WorkerHung
    from batchline.transport._loop import run
    from batchline.worker import Worker
    from batchline.worker._watchdog import HUNG_EXIT_CODE

    worker = Worker(settings)
    worker.exit_if_loop_blocked = True
    if args.supervised_child is not None:
        report_ready(args.supervised_child, worker.ready)
    if args.bound_file is not None:
        worker.bound_file = Path(args.bound_file)
    try:
        run(worker.run(), event_loop=settings.event_loop)
    except WorkerHung:
        logging.shutdown()
        os._exit(HUNG_EXIT_CODE)  # the hung model's thread cannot be stopped otherwise
    return 0


async def _check(settings: Any, max_age_s: float) -> int:
    """Health check: a worker of this host (or ``worker_id``) sent a heartbeat lately."""
    from batchline.transport._redis import connect
    from batchline.transport.keys import host_id

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
        print(f"unhealthy: no heartbeat from {want}* within {max_age_s} s", file=sys.stderr)
        return 1
    print(f"healthy: {', '.join(alive)}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from batchline.config import ServiceSettings

    settings = _settings(ServiceSettings, args)

    # A person typing `batchline status` wants an answer now: one try, unless a wait is set.
    wait_s = settings.redis_wait_s if "redis_wait_s" in settings.model_fields_set else 0.0

    async def run() -> dict[str, Any]:
        from batchline.transport._redis import connect, wait_for_redis
        from batchline.transport.status import collect

        client = connect(settings)
        try:
            await wait_for_redis(client, settings, wait_s=wait_s)
            return await collect(settings, client)
        finally:
            await client.aclose()

    from batchline.transport.status import render

    status = asyncio.run(run())
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0


def _acl(args: argparse.Namespace) -> int:
    from batchline.config import ServiceSettings
    from batchline.transport.acl import ROLES, acl_setuser

    keys = _settings(ServiceSettings, args).keys
    for role in ROLES if args.role == "both" else (args.role,):
        print(acl_setuser(keys, role, user=f"{keys.prefix}-{role}"))
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.generate:
        from batchline.demo.generate import run_generate_demo

        return run_generate_demo(model_path=args.model_path)
    if args.in_process:
        from batchline.demo import run_demo

        return run_demo(items=args.requests or 2000, threads=args.threads)
    from batchline.demo.service import run_service_demo

    return run_service_demo(requests=args.requests, plot=args.plot, step_s=args.step_s)


def _parser() -> argparse.ArgumentParser:
    from batchline.config import ServiceSettings, WorkerSettings
    from batchline.demo.service import RATES

    parser = argparse.ArgumentParser(
        prog="batchline",
        description="Dynamic batching for model inference: run the demo, a worker serving a "
        "queue over Redis, look at a queue, or print its ACL users.",
        epilog=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="INFO", help="logging level [default INFO]")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser(
        "worker",
        help="serve a queue: read requests from Redis, batch them, run the model, answer",
        description="Serve a queue: read requests from Redis, batch them, run the model, "
        "answer. Each setting is a flag or a BATCHLINE_<NAME> environment variable (the flag "
        "wins). SIGTERM or Ctrl-C drains: stop reading, answer what was read, exit 0.",
    )
    _add_settings(worker, WorkerSettings)
    worker.add_argument(
        "--check",
        action="store_true",
        help="health check: exit 0 if a worker of this host is alive",
    )
    worker.add_argument(
        "--max-age-s",
        type=float,
        default=10.0,
        help="with --check: the oldest heartbeat that counts [default 10]",
    )
    worker.add_argument("--supervised-child", type=int, help=argparse.SUPPRESS)
    worker.add_argument("--bound-file", help=argparse.SUPPRESS)
    worker.set_defaults(run=_worker)

    status = commands.add_parser(
        "status",
        help="queue depth, pending, lag, dead letters, workers",
        description="Print a queue's depth, pending requests, lag, dead letters and workers.",
    )
    _add_settings(status, ServiceSettings)
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(run=_status)

    acl = commands.add_parser(
        "acl", help="print the ACL SETUSER lines of the producer and worker users (Redis >= 7)"
    )
    _add_settings(acl, ServiceSettings)
    acl.add_argument("--role", choices=["producer", "worker", "both"], default="both")
    acl.set_defaults(run=_acl)

    about = (
        "the service end to end on one machine: a private Redis (unless BATCHLINE_REDIS_URL "
        "is set), a worker process serving all-MiniLM-L6-v2, sentences at a rising load"
    )
    demo = commands.add_parser("demo", help=about, description=about[0].upper() + about[1:])
    demo.add_argument(
        "--requests",
        type=int,
        default=None,
        help="most sentences to send [default: as many as the load steps send, "
        f"{'/'.join(str(r) for r in RATES)} req/s for --step-s each; with --in-process 2000]",
    )
    demo.add_argument(
        "--plot", metavar="FILE.png", help="draw throughput, latency and batch size vs load"
    )
    demo.add_argument(
        "--step-s", type=float, default=1.5, help="seconds per load step [default 1.5]"
    )
    demo.add_argument(
        "--in-process",
        action="store_true",
        help="instead: the in-process batcher (batchline.dynamically) alone, no Redis",
    )
    demo.add_argument(
        "--threads", type=int, default=64, help="with --in-process: concurrent callers [default 64]"
    )
    demo.add_argument(
        "--generate",
        action="store_true",
        help="instead: a few chat prompts answered live through Redis by a --model generate "
        "worker (SmolLM2-135M-Instruct), with tokens/s",
    )
    demo.add_argument(
        "--model-path",
        help="with --generate: the worker's model_path [default smollm2]",
    )
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchline`` command and ``python -m batchline``."""
    from batchline.transport._redis import RedisUnreachable

    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args))
    except RedisUnreachable as exc:
        print(f"batchline: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("batchline: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
