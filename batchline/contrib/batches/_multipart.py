"""``multipart/form-data`` bodies (RFC 7578) read as they arrive, by python-multipart
(Starlette's own parser), with no I/O.

``POST /v1/files`` reads its upload with it as the body arrives, so that a file is never
held whole in memory: :meth:`MultipartReader.feed` hands each chunk of the body to the
parser and returns what it found in it, in order: a part's start (:class:`PartStart`, its
name and file name), pieces of the part's content (bytes) and, at the closing delimiter,
:data:`END`. A part's content may arrive in many pieces; the parser holds back at most a
delimiter's length between chunks (it may be cut in two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

__all__ = ["END", "MAX_HEADER_BYTES", "MultipartError", "MultipartReader", "PartStart", "boundary"]

#: The most bytes of one header of a part.
MAX_HEADER_BYTES = 16 << 10
#: Marks the end of the body (the closing delimiter).
END: Final = "end"

Found = list["PartStart | bytes | str"]


class MultipartError(ValueError):
    """A body that is not well-formed ``multipart/form-data``."""


@dataclass(frozen=True, slots=True)
class PartStart:
    """The start of a part: its form field's ``name`` and, for a file, its ``filename``."""

    name: str
    filename: str | None


def boundary(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` content type (MultipartError without one)."""
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise MultipartError(f"expected multipart/form-data, got {content_type!r}")
    found = params.get(b"boundary")
    if not found:
        raise MultipartError("multipart/form-data without a boundary")
    return found


class MultipartReader:
    """Reads one body, chunk by chunk: ``feed`` each, then ``close`` (MultipartError if the
    body ended before its closing delimiter)."""

    def __init__(self, boundary: bytes) -> None:
        self._found: Found = []
        self._header = self._value = b""
        self._disposition: bytes | None = None
        self._ended = False
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_end": self._end,
            },
            max_header_size=MAX_HEADER_BYTES,
        )

    def feed(self, data: bytes) -> Found:
        """What ``data`` (the next chunk of the body) completes."""
        try:
            self._parser.write(data)
        except MultipartParseError as exc:
            raise MultipartError(f"the multipart body is malformed: {exc}") from None
        found, self._found = self._found, []
        return found

    def close(self) -> None:
        """Check that the body ended where it should."""
        if not self._ended:
            raise MultipartError("the multipart body ended before its closing delimiter")

    def _part_begin(self) -> None:
        self._disposition = None

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.strip().lower() == b"content-disposition":
            self._disposition = self._value
        self._header = self._value = b""

    def _headers_finished(self) -> None:
        self._found.append(_part_start(self._disposition))

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if end > start:
            self._found.append(data[start:end])

    def _end(self) -> None:
        self._ended = True
        self._found.append(END)


def _part_start(disposition: bytes | None) -> PartStart:
    """The name and file name of a part, from its Content-Disposition."""
    if disposition is not None:
        _kind, params = parse_options_header(disposition)
        name = params.get(b"name")
        if name is not None:
            filename = params.get(b"filename")
            return PartStart(
                name.decode("utf-8", "replace"),
                None if filename is None else filename.decode("utf-8", "replace"),
            )
    raise MultipartError("a multipart part has no Content-Disposition with a name")
