"""The FastAPI app in a process of its own, for tests that look into that process:
``python app_process.py PORT`` (settings from ``BATCHLINE_*`` variables).

Serves the app with uvicorn on 127.0.0.1:PORT, prints ``ready`` once it listens, then waits
for a line on stdin; then prints, as one JSON line, which heavy modules the process has
imported (``torch``, ``transformers``, ``tokenizers``, ``sentence_transformers``), and stops.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from batchline.contrib.fastapi import create_app

HEAVY = ("torch", "transformers", "tokenizers", "sentence_transformers")


@contextlib.contextmanager
def app_in_process(env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """This script in a process of its own, with ``env`` (all of it: see
    ``tests.support.service.subprocess_env``), once it serves: the process (its stdin and
    stdout piped, ``ready`` read) and the app's base URL. Killed at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    repo = Path(__file__).resolve().parents[2]
    with subprocess.Popen(
        [sys.executable, __file__, str(port)],
        env=env,
        cwd=repo,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            yield proc, f"http://127.0.0.1:{port}"
        finally:
            proc.kill()


def main() -> None:
    port = int(sys.argv[1])
    config = uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:  # uvicorn offers no event for it
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SystemExit("uvicorn did not start")
        time.sleep(0.02)
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(sorted(m for m in HEAVY if m in sys.modules)), flush=True)
    server.should_exit = True
    thread.join(30)


if __name__ == "__main__":
    main()
