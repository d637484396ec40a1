"""The ``batchline`` command: thin (parse, load settings, configure logging, run).

The argument parser is the one truth of which command takes which option: its help texts,
and :func:`cli_reference` (what the documentation's CLI page is generated from), are both
read from it. Each command adds its own parser and runs from its own module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from batchline.cli._acl import acl_parser, acl_settings
from batchline.cli._batch import batch_parser
from batchline.cli._demo import demo_parser
from batchline.cli._keys import keys_parsers
from batchline.cli._options import CliCommand, UsageError, add_option, reference
from batchline.cli._status import status_parser, status_settings
from batchline.cli._usage import usage_parser, usage_settings
from batchline.cli._worker import worker_parser, worker_settings
from batchline.logs import configure as configure_logs

__all__ = ["cli_reference", "command_settings", "main"]

USAGE = """\
commands:
  batchline demo                   the whole service on one machine: a private Redis, a worker
                                   serving all-MiniLM-L6-v2, a rising load (about 30 s)
  batchline demo --in-process      the in-process batcher (batchline.dynamically), no Redis
  batchline demo --generate        chat prompts answered live by a text-generation worker
  batchline worker [--batch-size 64 ...]
                                   serve a queue (settings: flags, else BATCHLINE_* variables)
  batchline worker --check         exit 0 if a worker on this host is alive
  batchline status [--json]        queue depth, pending, lag, dead letters, workers
  batchline status --by-tenant     per tenant: backlog, in flight, quota use, weight
  batchline usage [--day YYYYMMDD] requests, items, tokens per tenant per day (billing)
  batchline acl [--role worker]    the ACL SETUSER lines of the queue's Redis users
  batchline batch FILE.jsonl [--url http://localhost:8000]
                                   run a file of requests through the web API's /v1/batches
  batchline keys create --tenant NAME [--requests-per-min 60 ...]
                                   a key for the HTTP API (printed once); keys list, revoke
                                   ID, rotate ID, set --tenant NAME: the tenant store

Redis: BATCHLINE_REDIS_URL (default redis://localhost:6379/0). `batchline COMMAND --help`
lists each command's options with their defaults and environment variables.
Exit status: 2 and one line saying what is accepted for a bad option, setting or file; 1
when Redis does not answer, a worker's model does not load, a health check or a batch
fails. Ctrl-C stops any command with exit status 130 (a worker first answers what it read,
the demo first stops what it started); SIGTERM drains a worker the same way, with exit
status 0.
"""

#: The commands that take settings, and how each reads them.
_SETTINGS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "worker": worker_settings,
    "status": status_settings,
    "acl": acl_settings,
    "usage": usage_settings,
}


def cli_reference() -> tuple[CliCommand, ...]:
    """Every command of ``batchline`` (the top level first, then each subcommand), with each
    option's flag, help, default and environment variable, exactly as ``--help`` shows them.

    The documentation's CLI page is generated from this, so it cannot drift from the parser.
    """
    parser, commands = _parsers()
    return reference(parser, commands)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (its own print the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def command_settings(command: str, args: argparse.Namespace) -> Any:
    """The settings ``command`` runs with, from its parsed ``args`` and the environment."""
    if command not in _SETTINGS:
        raise ValueError(f"the command {command!r} takes no settings")
    return _SETTINGS[command](args)


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each command's."""
    parser = _Parser(
        prog="batchline",
        description="Dynamic batching for model inference: run the demo, a worker serving a "
        "queue over Redis, look at a queue, print its ACL users, or manage the HTTP API's "
        "keys.",
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
    commands = {
        "worker": worker_parser(sub),
        "status": status_parser(sub),
        "usage": usage_parser(sub),
        "acl": acl_parser(sub),
        "demo": demo_parser(sub),
        "batch": batch_parser(sub),
        **keys_parsers(sub),
    }
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``batchline`` command and ``python -m batchline``."""
    from batchline.transport import EXIT_INTERRUPTED, RedisUnreachable

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
