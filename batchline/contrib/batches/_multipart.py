"""A streaming reader of ``multipart/form-data`` bodies (RFC 7578), with no I/O.

``POST /v1/files`` reads its upload with it as the body arrives, so that a file is never
held whole in memory: :meth:`MultipartReader.feed` takes each chunk of the body and returns
what it found in it, in order: a part's start (:class:`PartStart`, its name and file name),
pieces of the part's content (bytes) and, at the closing delimiter, :data:`END`. A part's
content may arrive in many pieces; at most the delimiter's length is held back between
chunks (it may be cut in two).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["END", "MAX_HEADER_BYTES", "MultipartError", "MultipartReader", "PartStart", "boundary"]

#: The most bytes of one part's headers.
MAX_HEADER_BYTES = 16 << 10
#: Marks the end of the body (the closing delimiter).
END: Final = "end"

_BOUNDARY = re.compile(r'boundary="?([^";,]{1,70})"?', re.IGNORECASE)
_PARAM = re.compile(r'\b(name|filename)="([^"]*)"', re.IGNORECASE)


class MultipartError(ValueError):
    """A body that is not well-formed ``multipart/form-data``."""


@dataclass(frozen=True, slots=True)
class PartStart:
    """The start of a part: its form field's ``name`` and, for a file, its ``filename``."""

    name: str
    filename: str | None


def boundary(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` content type (MultipartError without one)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise MultipartError(f"expected multipart/form-data, got {content_type!r}")
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise MultipartError("multipart/form-data without a boundary")
    return found.group(1).encode("latin-1")


class MultipartReader:
    """Reads one body, chunk by chunk: ``feed`` each, then ``close`` (MultipartError if the
    body ended before its closing delimiter)."""

    def __init__(self, boundary: bytes) -> None:
        self._delimiter = b"\r\n--" + boundary
        self._buffer = b"\r\n"  # the first delimiter has no line break before it
        self._state = "preamble"

    def feed(self, data: bytes) -> list[PartStart | bytes | str]:
        """What ``data`` (the next chunk of the body) completes."""
        self._buffer += data
        found: list[PartStart | bytes | str] = []
        while self._step(found):
            pass
        return found

    def close(self) -> None:
        """Check that the body ended where it should."""
        if self._state != "done":
            raise MultipartError("the multipart body ended before its closing delimiter")

    def _step(self, found: list[PartStart | bytes | str]) -> bool:
        """Parse what the buffer holds in the current state; whether to go on."""
        if self._state == "preamble":
            at = self._buffer.find(self._delimiter)
            if at < 0:
                self._buffer = self._buffer[-len(self._delimiter) :]
                return False
            self._buffer = self._buffer[at + len(self._delimiter) :]
            self._state = "after"
            return True
        if self._state == "after":  # "\r\n": a part follows; "--": the end
            if len(self._buffer) < 2:
                return False
            mark, self._buffer = self._buffer[:2], self._buffer[2:]
            if mark == b"--":
                self._state = "done"
                found.append(END)
                return False
            if mark != b"\r\n":
                raise MultipartError("a multipart delimiter is followed by neither CRLF nor --")
            self._state = "headers"
            return True
        if self._state == "headers":
            at = self._buffer.find(b"\r\n\r\n")
            if at < 0:
                if len(self._buffer) > MAX_HEADER_BYTES:
                    raise MultipartError(f"a part's headers exceed {MAX_HEADER_BYTES} bytes")
                return False
            found.append(_part_start(self._buffer[:at]))
            self._buffer = self._buffer[at + 4 :]
            self._state = "content"
            return True
        if self._state == "content":
            at = self._buffer.find(self._delimiter)
            if at < 0:
                keep = len(self._delimiter) - 1  # a delimiter may be cut between two chunks
                if len(self._buffer) > keep:
                    found.append(self._buffer[:-keep])
                    self._buffer = self._buffer[-keep:]
                return False
            if at:
                found.append(self._buffer[:at])
            self._buffer = self._buffer[at + len(self._delimiter) :]
            self._state = "after"
            return True
        return False  # done: an epilogue is ignored


def _part_start(raw: bytes) -> PartStart:
    """The name and file name of a part, from its headers."""
    for line in raw.decode("utf-8", "replace").split("\r\n"):
        header, _, value = line.partition(":")
        if header.strip().lower() == "content-disposition":
            params = {k.lower(): v for k, v in _PARAM.findall(value)}
            if "name" not in params:
                break
            return PartStart(params["name"], params.get("filename"))
    raise MultipartError("a multipart part has no Content-Disposition with a name")
