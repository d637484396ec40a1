"""The FastAPI app in a process of its own, for tests that look into that process:
``python app_process.py PORT`` (settings from ``BATCHLINE_*`` variables).

Serves the app with uvicorn on 127.0.0.1:PORT, prints ``ready`` once it listens, then waits
for a line on stdin; then prints, as one JSON line, which heavy modules the process has
imported (``torch``, ``transformers``, ``tokenizers``, ``sentence_transformers``), and stops.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import uvicorn

from batchline.contrib.fastapi import create_app

HEAVY = ("torch", "transformers", "tokenizers", "sentence_transformers")


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
