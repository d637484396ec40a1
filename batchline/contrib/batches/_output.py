"""What bounds a running batch's memory and output: :class:`Window` and :class:`Output`.

A batch's lines run a window at a time (:class:`Window`), counted in inputs: a line of an
embeddings batch weighs its texts, any other line one, and a long line one per
:data:`WEIGHT_BYTES` of it at least. A line holds its share from before it is submitted until
its answer is written, so that the results, answers and lines a driver holds are bounded by
the window whatever the size of one line: a line heavier than the whole window runs alone.

Answers are encoded one at a time and a piece at a time (:class:`Output`,
:func:`~._lines.output_pieces`), the driver's event loop running between pieces, so
that a large answer neither holds the loop (the batch's lease is renewed there) nor is ever
made whole in memory past the limits: a line's answer at most ``max_answer_bytes``, the
batch's output files together at most ``max_output_bytes`` and ``output_ratio`` times its
input file. A line over either gets its own error in the error file (``answer_too_large``,
``batch_output_limit``) and the batch goes on; once the batch's output is full, the lines
still waiting are not run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from batchline.contrib.batches._lines import Line, LineError, error_line, output_pieces

__all__ = ["WEIGHT_BYTES", "Encoded", "Output", "Window", "weight"]

#: A line weighs at least one input per this many of its bytes.
WEIGHT_BYTES = 64 << 10
#: The driver's loop runs after each this many bytes of an answer encoded.
_YIELD_BYTES = 256 << 10
ANSWER_TOO_LARGE = "answer_too_large"
OUTPUT_FULL = "batch_output_limit"


def weight(parsed: Line | LineError, raw: bytes) -> int:
    """A line's share of the window: its texts (an embeddings line), else one; and at least
    one per :data:`WEIGHT_BYTES` of the line."""
    inputs = 1
    if isinstance(parsed, Line) and parsed.url == "/v1/embeddings":
        value = parsed.body.get("input")
        if isinstance(value, list):
            inputs = max(1, len(value))
    return max(inputs, -(-len(raw) // WEIGHT_BYTES))


class Window:
    """At most ``size`` inputs of one batch under way (one taker: the batch's submitter)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"the window must be at least 1, got {size}")
        self.size, self.used = size, 0
        self._freed = asyncio.Event()
        self._stopped = False

    async def take(self, n: int) -> int:
        """Wait for room for ``n`` (a line heavier than the window: for all of it); the share
        taken. Returns 0 once :meth:`stop` was called (nothing is taken)."""
        n = min(n, self.size)
        while self.used + n > self.size and not self._stopped:
            self._freed.clear()
            await self._freed.wait()
        if self._stopped:
            return 0
        self.used += n
        return n

    def give(self, n: int) -> None:
        """Give back a share (its line's answer is written)."""
        self.used -= n
        self._freed.set()

    def stop(self) -> None:
        """Wake the taker for good (the run is failing)."""
        self._stopped = True
        self._freed.set()


@dataclass(frozen=True, slots=True)
class Encoded:
    """One line's answer: ``ok`` (for the output file) or not (the error file); ``full``:
    the line refused because the batch's output is full."""

    ok: bool
    line: bytes
    full: bool = False


class Output:
    """A batch's output against its limits; every answer goes through it, in turn.

    Args:
        max_answer_bytes: the most bytes of one line's answer.
        max_output_bytes: the most bytes of the batch's output and error files together.
        output_ratio: the same, as a multiple of the input file's bytes (the lower wins).
        input_bytes: the input file's size.
        used: the bytes written already (a run resumed), and ``full``: whether the output
            was found full before.
    """

    def __init__(
        self,
        *,
        max_answer_bytes: int,
        max_output_bytes: int,
        output_ratio: float,
        input_bytes: int,
        used: int = 0,
        full: bool = False,
    ) -> None:
        self.max_answer_bytes = max_answer_bytes
        self.cap = min(max_output_bytes, int(output_ratio * input_bytes))
        self._why = (
            f"max_output_bytes={max_output_bytes}"
            if self.cap == max_output_bytes
            else f"output_ratio={output_ratio:g} times the input file's {input_bytes} bytes"
        )
        self.used, self.full = used, full
        self._turn = asyncio.Lock()

    def error(self, custom_id: str | None, rid: str, code: str, message: str) -> Encoded:
        """An error file line (counted; written whatever the limits: it is small)."""
        return self.counted(False, error_line(custom_id, rid, code, message))

    def counted(self, ok: bool, line: bytes, *, full: bool = False) -> Encoded:
        """``line`` counted as written."""
        self.used += len(line) + 1
        return Encoded(ok, line, full)

    def refused(self, custom_id: str | None, rid: str, *, ran: bool) -> Encoded:
        """The error of a line the batch's full output leaves out."""
        self.full = True
        what = "its answer was left out" if ran else "it was not run"
        message = f"the batch's output reached its limit of {self.cap} bytes ({self._why}): {what}"
        line = error_line(custom_id, rid, OUTPUT_FULL, message)
        return self.counted(False, line, full=True)

    async def answer(
        self, custom_id: str | None, rid: str, status: int, body: dict[str, Any]
    ) -> Encoded:
        """A response line (``status`` 200: the output file), encoded a piece at a time
        within the limits, or the error of the limit it passes."""
        async with self._turn:
            room = self.cap - self.used - 1
            limit = min(self.max_answer_bytes, room)
            pieces: list[bytes] = []
            size = since = 0
            for piece in output_pieces(custom_id, rid, status, body):
                pieces.append(piece)
                size += len(piece)
                since += len(piece)
                if size > limit:
                    break
                if since >= _YIELD_BYTES:
                    since = 0
                    await asyncio.sleep(0)  # the lease is renewed meanwhile
            if size > self.max_answer_bytes:
                message = (
                    f"the answer of this line is over max_answer_bytes={self.max_answer_bytes}"
                    " bytes: ask for fewer inputs a line, or encoding_format base64 (about a "
                    "quarter of float's size)"
                )
                return self.error(custom_id, rid, ANSWER_TOO_LARGE, message)
            if size > self.cap - self.used - 1:  # (error lines may have come meanwhile)
                return self.refused(custom_id, rid, ran=True)
            return self.counted(status == 200, b"".join(pieces))
