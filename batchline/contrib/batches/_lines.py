"""The OpenAI Batch API's data, with no I/O: input lines, their answers, file checks, statuses.

An input file is JSONL, one request a line: ``{"custom_id", "method": "POST", "url",
"body"}``. :class:`FileScan` reads a file's lines as they are uploaded (counting them,
and finding a repeated ``custom_id``); :func:`file_errors` says why a batch may not run a
file (OpenAI's validation: an empty file, too many requests, a repeated ``custom_id``).
:func:`parse_line` reads one line for a batch: what is wrong with a line (not JSON, an
unknown ``url``, a ``custom_id`` that is not Unicode text, lists and objects nested deeper
than ``MAX_JSON_DEPTH``) is that line's error (:class:`LineError`), written to the error file;
the other lines run.
:func:`output_line` and :func:`error_line` build the lines of the output and error files,
matched to the input by ``custom_id``. :data:`NEXT` holds the statuses a batch may move to
from each.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from batchline._json_depth import loads
from batchline.errors import NestingTooDeep
from batchline.tenants import tenant_id

__all__ = [
    "ENDPOINTS",
    "FINAL",
    "MAX_CUSTOM_ID_CHARS",
    "MAX_FILE_BYTES",
    "MAX_FILE_LINES",
    "NEXT",
    "FileScan",
    "Line",
    "LineError",
    "error_line",
    "file_errors",
    "moves",
    "output_line",
    "output_pieces",
    "parse_line",
    "request_id",
]

#: The routes a batch may run (its ``endpoint``; every line's ``url`` must be the same).
ENDPOINTS: Final = ("/v1/embeddings", "/v1/completions", "/v1/chat/completions")
#: OpenAI's limits of one input file: its requests, and its size.
MAX_FILE_LINES: Final = 50_000
MAX_FILE_BYTES: Final = 200 * 1000 * 1000
#: The longest ``custom_id`` (OpenAI sets none; this one keeps the output lines bounded).
MAX_CUSTOM_ID_CHARS: Final = 512

#: The statuses a batch may move to from each (OpenAI's; the last four are final).
NEXT: Final[dict[str, frozenset[str]]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired", "failed"}),
    "finalizing": frozenset({"completed"}),
    "cancelling": frozenset({"cancelled"}),
    "failed": frozenset(),
    "completed": frozenset(),
    "expired": frozenset(),
    "cancelled": frozenset(),
}
FINAL: Final = frozenset(s for s, after in NEXT.items() if not after)


def moves(status: str, to: str) -> bool:
    """Whether a batch in ``status`` may move to ``to``."""
    return to in NEXT.get(status, frozenset())


class LineError(Exception):
    """What is wrong with one line of an input file (its error in the error file).

    Attributes:
        code: OpenAI's error code (``invalid_json_line``, ``invalid_url`` ...).
        custom_id: the line's ``custom_id``, when it has one.
    """

    def __init__(self, code: str, message: str, *, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


@dataclass(frozen=True, slots=True)
class Line:
    """One request of a batch."""

    custom_id: str
    url: str
    body: dict[str, Any]


def _custom_id(obj: Any) -> str | None:
    value = obj.get("custom_id") if isinstance(obj, dict) else None
    if isinstance(value, str) and 0 < len(value) <= MAX_CUSTOM_ID_CHARS:
        return value
    return None


def parse_line(raw: str | bytes, endpoint: str) -> Line:
    """One line of a batch's input file (LineError if it is not a request for ``endpoint``;
    ``invalid_json_line`` for one nested deeper than MAX_JSON_DEPTH, found before parsing)."""
    try:
        obj = loads(raw, "the line")
    except NestingTooDeep as exc:
        raise LineError("invalid_json_line", str(exc)) from None
    except ValueError as exc:
        raise LineError("invalid_json_line", f"the line is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_json_line", "the line is not a JSON object")
    cid = _custom_id(obj)
    if cid is None:
        raise LineError(
            "missing_required_parameter",
            f"custom_id must be a text of 1 to {MAX_CUSTOM_ID_CHARS} characters",
        )
    try:
        cid.encode()
    except UnicodeEncodeError:  # (its request id is made of its UTF-8 bytes)
        message = "custom_id must be Unicode text: it holds a lone surrogate (\\ud800 to \\udfff)"
        raise LineError("invalid_custom_id", message, custom_id=cid) from None
    if obj.get("method") != "POST":
        raise LineError("invalid_method", "method must be POST", custom_id=cid)
    url = obj.get("url")
    if url != endpoint:
        if url in ENDPOINTS:
            message = f"the line's url {url!r} is not the batch's endpoint {endpoint!r}"
            raise LineError("mismatched_endpoint", message, custom_id=cid)
        raise LineError("invalid_url", f"unknown url {url!r}: one of {ENDPOINTS}", custom_id=cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object", custom_id=cid)
    return Line(cid, endpoint, body)


def request_id(file_id: str, endpoint: str, custom_id: str, tenant: str | None = None) -> str:
    """The queue's request id of one line: the same for the same file, endpoint and
    ``custom_id``, so that a batch created twice, or driven again after a restart, resubmits
    the ids it submitted before (the queue answers each id once). A tenant's batch's ids
    are in its namespace (``<tenant>.<file id>.<32 hex>``, within the 128 characters of an
    id), as the queue's admission requires of a tenant's requests."""
    digest = hashlib.sha256(f"{endpoint}\n{custom_id}".encode()).hexdigest()
    if tenant is None:
        return f"{file_id}.{digest[:40]}"
    return tenant_id(tenant, f"{file_id}.{digest[:32]}")


@dataclass
class FileScan:
    """What uploading a file finds in its lines (given one by one, without line breaks)."""

    lines: int = 0
    size: int = 0
    duplicate: str | None = None  # the first custom_id seen twice
    _seen: set[str] = field(default_factory=set, repr=False)

    def add(self, line: bytes) -> None:
        """Count one line (of ``size``: its bytes and its line break)."""
        self.lines += 1
        self.size += len(line) + 1
        if self.duplicate is not None or self.lines > MAX_FILE_LINES:
            return  # the file fails validation already: no more ids are kept
        try:
            cid = _custom_id(loads(line, "the line"))
        except ValueError:  # (too deep included)
            return  # this line's own error, when a batch runs it
        if cid is not None:
            if cid in self._seen:
                self.duplicate = cid
            self._seen.add(cid)


def file_errors(lines: int, duplicate: str | None) -> list[dict[str, Any]]:
    """Why a batch may not run a file of ``lines`` lines (OpenAI's ``errors.data``)."""
    if lines == 0:
        return [{"code": "empty_file", "message": "the input file has no requests"}]
    if lines > MAX_FILE_LINES:
        message = f"the input file has {lines} requests, more than {MAX_FILE_LINES}"
        return [{"code": "too_many_requests", "message": message}]
    if duplicate is not None:
        message = f"the custom_id {duplicate!r} is used by more than one request"
        return [{"code": "duplicate_custom_id", "message": message, "param": "custom_id"}]
    return []


def _line(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def output_pieces(
    custom_id: str | None, rid: str, status: int, body: dict[str, Any]
) -> Iterator[bytes]:
    """:func:`output_line`'s bytes, in pieces: the body's list values (or iterators: a lazy
    list) one item at a time, so that a large answer (an embedding per item) is encoded,
    measured and bounded as it goes rather than at once."""
    yield _line({"id": f"batch_req_{rid}", "custom_id": custom_id})[:-1]
    yield b',"response":' + _line({"status_code": status, "request_id": rid})[:-1] + b',"body":{'
    for i, (name, value) in enumerate(body.items()):
        yield (b"," if i else b"") + _line(name) + b":"
        if isinstance(value, (list, Iterator)):
            yield b"["
            for j, item in enumerate(value):
                yield (b"," if j else b"") + _line(item)
            yield b"]"
        else:
            yield _line(value)
    yield b'}},"error":null}'


def output_line(custom_id: str | None, rid: str, status: int, body: dict[str, Any]) -> bytes:
    """A line of the output file (``status`` 200) or, for a request its route refused, of the
    error file: the response the route would have given."""
    return b"".join(output_pieces(custom_id, rid, status, body))


def error_line(custom_id: str | None, rid: str, code: str, message: str) -> bytes:
    """A line of the error file for a request that got no response (a malformed line, a
    cancelled or expired batch, an answer over the output limits)."""
    error = {"code": code, "message": message}
    return _line(
        {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": None, "error": error}
    )
