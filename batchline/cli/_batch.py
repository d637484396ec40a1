"""``batchline batch``: run a JSONL file of requests through a web backend's Batch API.

It uploads the file (``POST /v1/files``), creates a batch of it (``POST /v1/batches``),
follows its progress (a bar on a terminal, a line per change elsewhere) and writes the
output and error files where it is told. It speaks HTTP only (httpx): the API, not Redis,
is what it needs to reach. Interrupted, it leaves the batch running (its id is printed). An
API that takes keys gets the one in ``BATCHLINE_API_KEY`` (else ``OPENAI_API_KEY``), as
``Authorization: Bearer``: never on the command line, where other users' ``ps`` would see it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from batchline.cli._options import add_option, positive

__all__ = ["BatchFailed", "Submit", "batch_parser", "submit"]

#: The statuses a batch ends in.
_FINAL = ("completed", "failed", "expired", "cancelled")
_BAR = 30


class BatchFailed(RuntimeError):
    """The API refused a request (its error message), or the batch did not complete."""


@dataclass(frozen=True, slots=True)
class Submit:
    """What ``batchline batch`` was asked to do."""

    file: Path
    url: str
    endpoint: str
    output: Path
    errors: Path
    poll_s: float
    api_key: str | None = field(default=None, repr=False)


def _body(response: Any) -> dict[str, Any]:
    """The JSON of a successful answer; BatchFailed with the API's message otherwise."""
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise BatchFailed(
            f"{response.request.method} {response.request.url.path}: "
            f"{response.status_code} {message}"
        )
    body: dict[str, Any] = response.json()
    return body


def _progress(batch: dict[str, Any], out: TextIO, *, last: bool) -> None:
    counts = batch["request_counts"]
    total, done = counts["total"], counts["completed"] + counts["failed"]
    share = done / total if total else 0.0
    bar = "#" * round(share * _BAR) + "." * (_BAR - round(share * _BAR))
    line = (
        f"{batch['id']} [{bar}] {done}/{total} lines ({share:.0%}), "
        f"{counts['failed']} failed, {batch['status']}"
    )
    if out.isatty():
        out.write("\r" + line + ("\n" if last else ""))
    else:
        out.write(line + "\n")
    out.flush()


def _download(http: Any, file_id: str | None, dest: Path) -> int:
    """Write a file of the API to ``dest``; its size (0, and nothing written, without one)."""
    if file_id is None:
        return 0
    size = 0
    with http.stream("GET", f"/files/{file_id}/content") as response, dest.open("wb") as f:
        if response.status_code >= 400:
            response.read()
            _body(response)
        for chunk in response.iter_bytes():
            f.write(chunk)
            size += len(chunk)
    return size


def submit(job: Submit, out: TextIO) -> dict[str, Any]:
    """Run ``job.file`` as a batch and write its files; the finished batch's object
    (BatchFailed if the API refused it or the batch did not complete)."""
    try:
        import httpx
    except ImportError:
        raise BatchFailed("batchline batch needs httpx: pip install httpx") from None
    try:
        headers = {"Authorization": f"Bearer {job.api_key}"} if job.api_key else {}
        with httpx.Client(
            base_url=job.url.rstrip("/") + "/v1", timeout=60, headers=headers
        ) as http:
            with job.file.open("rb") as f:
                files = {"file": (job.file.name, f, "application/jsonl")}
                uploaded = _body(http.post("/files", files=files, data={"purpose": "batch"}))
            body = {
                "input_file_id": uploaded["id"],
                "endpoint": job.endpoint,
                "completion_window": "24h",
            }
            batch = _body(http.post("/batches", json=body))
            shown = None
            while batch["status"] not in _FINAL:
                now = (batch["status"], batch["request_counts"])
                if now != shown or out.isatty():
                    _progress(batch, out, last=False)
                    shown = now
                time.sleep(job.poll_s)
                batch = _body(http.get(f"/batches/{batch['id']}"))
            _progress(batch, out, last=True)
            written = _download(http, batch.get("output_file_id"), job.output)
            failed = _download(http, batch.get("error_file_id"), job.errors)
    except httpx.HTTPError as exc:
        raise BatchFailed(f"{job.url}: {type(exc).__name__}: {exc}") from None
    out.write(f"output: {job.output} ({written} bytes)\n" if written else "output: none\n")
    if failed:
        out.write(f"errors: {job.errors} ({failed} bytes)\n")
    if batch["status"] != "completed":
        errors = (batch.get("errors") or {}).get("data") or []
        why = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
        raise BatchFailed(f"the batch ended {batch['status']}" + (f": {why}" if why else ""))
    return batch


def _batch(args: argparse.Namespace) -> int:
    path = Path(args.file)
    # Input errors: one line and exit status 2, as the parser's own.
    if not path.is_file():
        print(f"batchline: {args.file}: no such file (FILE.jsonl: the requests)", file=sys.stderr)
        return 2
    if not args.url.startswith(("http://", "https://")):
        print(
            f"batchline: --url is the web backend's http:// or https:// URL, got {args.url!r}",
            file=sys.stderr,
        )
        return 2
    job = Submit(
        file=path,
        url=args.url,
        endpoint=args.endpoint,
        output=Path(args.output or path.with_suffix(".output.jsonl")),
        errors=Path(args.errors or path.with_suffix(".errors.jsonl")),
        poll_s=args.poll_s,
        api_key=os.environ.get("BATCHLINE_API_KEY") or os.environ.get("OPENAI_API_KEY") or None,
    )
    try:
        submit(job, sys.stdout)
    except BatchFailed as exc:
        print(f"batchline: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the file, or one of the files written
        print(f"batchline: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def batch_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``batch`` command to the ``batchline`` parser's subcommands ``sub``."""
    about = "run a JSONL file of requests through a web backend's Batch API (/v1/batches)"
    batch: argparse.ArgumentParser = sub.add_parser(
        "batch",
        help=about,
        description="Upload a JSONL file of requests (each line: custom_id, method, url, "
        "body) to a batchline web backend, run it as a batch, show its progress and write "
        "its output and error files. Exit status 0 once the batch completed, 1 if the API "
        "refused it or it ended otherwise (failed, cancelled, expired), 2 for a file that "
        "is not there or a URL that is not http(s); interrupted, the batch goes on in the "
        "API. An API that takes keys gets the one in BATCHLINE_API_KEY (else OPENAI_API_KEY).",
    )
    add_option(batch, "file", metavar="FILE.jsonl", text="the requests, one JSON object a line")
    add_option(
        batch,
        "--url",
        default="http://localhost:8000",
        metavar="URL",
        text="the web backend's base URL (its /v1 routes)",
        shown="http://localhost:8000",
    )
    add_option(
        batch,
        "--endpoint",
        default="/v1/embeddings",
        choices=["/v1/embeddings", "/v1/completions", "/v1/chat/completions"],
        text="the route every line calls",
        shown="/v1/embeddings",
    )
    add_option(
        batch,
        "--output",
        metavar="PATH",
        text="where the output file goes",
        shown="FILE.output.jsonl",
    )
    add_option(
        batch,
        "--errors",
        metavar="PATH",
        text="where the error file goes (written only if some line failed)",
        shown="FILE.errors.jsonl",
    )
    add_option(
        batch,
        "--poll-s",
        type=positive(float),
        default=1.0,
        metavar="SECONDS",
        text="how often to read the batch's progress",
        shown="1",
    )
    batch.set_defaults(run=_batch)
    return batch
