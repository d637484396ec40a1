"""How much one read of the work streams may bring into a worker.

Redis cannot be asked for "entries up to N bytes", only for COUNT entries per stream, and a
worker learns an entry's size only once it holds it. So the reader keeps the size of the
largest entry it has seen lately (halved after each read that brought nothing as large) and
asks for at most ``max_read_bytes`` / (that size x streams) entries per stream: after one
large entry the next reads ask for few, and a run of small ones brings COUNT back up.

An entry larger than any valid request (the request limits: value header plus value data,
plus the small fields) is dead-lettered as soon as it is seen, before it is decoded; its
producer gets an error result when its id is valid, and nothing that large is decoded or
kept past the read. The cap is learnt, not a promise: the read that first brings large
entries after a run of small ones may hold up to COUNT x streams of them (Redis returns
whole entries, and their size is known only once read); every read after it is capped.
"""

from __future__ import annotations

from collections.abc import Sequence

from batchline.codec import Limits

__all__ = ["ENTRY_SLACK_BYTES", "Entry", "ReadCap", "entry_bytes"]

#: One entry read: stream index, entry id, fields (None: deleted while pending).
Entry = tuple[int, bytes, dict[bytes, bytes] | None]

#: Room for the fields of a request besides its value (id, reply, version, timestamps).
ENTRY_SLACK_BYTES = 64 << 10


def entry_bytes(raw: dict[bytes, bytes] | None) -> int:
    """The size of one stream entry's fields and values."""
    return sum(map(len, raw)) + sum(map(len, raw.values())) if raw else 0


class ReadCap:
    """The COUNT of the next read, and which entries are too large to take.

    Args:
        max_read_bytes: most bytes of entries one read should bring.
        max_entry_bytes: the largest entry a valid request can make.

    Attributes:
        largest_bytes: the largest entry seen lately (decays by half per read).
        refused: entries refused for their size so far.
    """

    def __init__(self, *, max_read_bytes: int, max_entry_bytes: int) -> None:
        self.max_read_bytes = max_read_bytes
        self.max_entry_bytes = max_entry_bytes
        self.largest_bytes = 0
        self.refused = 0

    @classmethod
    def within(cls, limits: Limits, *, max_read_bytes: int) -> ReadCap:
        """The cap of a worker that accepts requests within ``limits``."""
        largest = limits.max_meta_bytes + limits.max_blob_bytes + ENTRY_SLACK_BYTES
        return cls(max_read_bytes=max_read_bytes, max_entry_bytes=largest)

    def count(self, room: int, streams: int) -> int:
        """COUNT for one read of ``streams`` streams (COUNT applies to each stream) with
        room for ``room`` entries: the room split over the streams, lowered so that entries
        as large as the largest seen lately fill at most ``max_read_bytes``."""
        per_stream = max(1, -(-room // streams))
        if self.largest_bytes:
            per_stream = min(per_stream, self.max_read_bytes // (self.largest_bytes * streams))
        return max(1, per_stream)

    def split(self, batch: Sequence[Entry]) -> tuple[list[Entry], list[tuple[Entry, int]]]:
        """Note the sizes of one read's entries; return the entries to take, and those too
        large to be a valid request, each with its size."""
        kept: list[Entry] = []
        too_large: list[tuple[Entry, int]] = []
        largest = 0
        for item in batch:
            size = entry_bytes(item[2])
            largest = max(largest, size)
            if size > self.max_entry_bytes:
                too_large.append((item, size))
            else:
                kept.append(item)
        self.refused += len(too_large)
        self.largest_bytes = max(largest, self.largest_bytes // 2)
        return kept, too_large
