"""W3C trace context as it travels in a request entry: ``traceparent`` and ``tracestate``
parsed and checked by hand (pure, no OpenTelemetry), so that a malformed value is told
apart and counted, never refused."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MAX_TRACESTATE_BYTES", "Parent", "parse_traceparent", "parse_tracestate"]

#: The longest ``tracestate`` a worker takes (W3C: at most 32 members, 512 characters is
#: the length a vendor may count on); a longer one is dropped, the traceparent kept.
MAX_TRACESTATE_BYTES = 512

# version 00: 2 hex, 32 hex trace id, 16 hex span id, 2 hex flags. A later version may add
# fields after a dash (W3C: parse the first four as version 00 does).
_TRACEPARENT = re.compile(
    rb"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\x21-\x7e]*)?$"
)


@dataclass(frozen=True, slots=True)
class Parent:
    """A remote parent: the trace and span a request entry names."""

    trace_id: int
    span_id: int
    flags: int
    tracestate: str = ""

    def traceparent(self) -> str:
        """The parent as a version-00 ``traceparent`` header."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"


def parse_traceparent(
    value: bytes | str | None, tracestate: bytes | str | None = None
) -> Parent | None:
    """The parent ``value`` names, or None where it is malformed: not version 00's shape
    (a later version's extra fields allowed), version ff, or an all-zero trace or span id.
    ``tracestate`` rides along where it is printable ASCII of at most
    :data:`MAX_TRACESTATE_BYTES` bytes (else it is dropped)."""
    if value is None:
        return None
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else value
    found = _TRACEPARENT.match(raw.strip())
    if found is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = found.groups()
    if version == b"ff" or (version == b"00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return Parent(trace_id, span_id, int(flags_hex, 16), parse_tracestate(tracestate))


def parse_tracestate(value: bytes | str | None) -> str:
    """``value`` as text where it may travel on (printable ASCII, at most
    :data:`MAX_TRACESTATE_BYTES` bytes), else ``""``."""
    if not value:
        return ""
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else value
    if len(raw) > MAX_TRACESTATE_BYTES or not all(0x20 <= b < 0x7F for b in raw):
        return ""
    return raw.decode("ascii").strip()
