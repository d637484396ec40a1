"""The way into a worker: what it reads decoded, validated and preprocessed (tokenized):
:func:`prepare` for one read, run by :class:`Preparer`.

For a model whose preprocessing is heavy (the tokenizer models), reads are prepared on
threads of their own, so that tokenizing the next batches overlaps the current batch's
compute on the model's thread: the reader brings in up to ``read_ahead`` batches ahead, and
each read is prepared as it arrives. With ``prep_threads`` > 1 a read is split across that
many threads (the fast tokenizers encode a list without holding the GIL), for a model fast
enough (a GPU) that one thread's tokenizing would cap the served rate. A light model is
prepared inline on the event loop.

The time spent preparing (each thread's wall time, summed over the threads) and the
requests prepared are counted, for the worker's statistics (``prepare``): beside the model's
time per batch they tell whether preparing keeps up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, cast

from batchline.codec import DecodeError, Limits, request_value
from batchline.codec._requests import check_priority, decode_requests
from batchline.worker.models import Model, Prepared
from batchline.worker.models._lazy import LazyModel
from batchline.worker.models._tokenize import TokenOps, op_of, token_ops
from batchline.worker.serving._answers import Outcome, Unprepared, answer, dead_letter
from batchline.worker.shared._held import Entry, Meta, Record

__all__ = ["Outcome", "Preparer", "prepare", "settle_tokenizer"]

logger = logging.getLogger(__name__)


class Preparer:
    """Prepares the entries of one read: ``await preparer(entries)``, in order."""

    def __init__(self, model: Model, limits: Limits, worker_id: str, *, threads: int) -> None:
        self._model = model
        self._limits = limits
        self._worker_id = worker_id
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ops: TokenOps | None = None  # once the model is loaded (start)
        self.seconds = 0.0  # preparing (wall), summed over the threads
        self.requests = 0
        self.preparing = 0  # entries being prepared now (they hold room in the window)

    def start(self) -> None:
        """Start the threads, if the model's preprocessing is heavy (once it is loaded),
        after one preprocess here (:func:`settle_tokenizer`)."""
        self._ops = token_ops(self._model)
        if self._model.heavy_preprocess and self._pool is None:
            if not getattr(self._model, "lazy", False):  # (a lazy one settles as it loads)
                settle_tokenizer(self._model)
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix="batchline-prep"
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def stats(self) -> dict[str, Any]:
        """Seconds spent preparing (summed over the threads) and requests prepared so far."""
        return {
            "seconds": round(self.seconds, 6),
            "requests": self.requests,
            "threads": self._threads if self._pool is not None else 0,
        }

    async def __call__(self, batch: list[Entry]) -> list[Outcome]:
        self.preparing += len(batch)
        try:
            return await self._prepare_all(batch)
        finally:
            self.preparing -= len(batch)

    async def _prepare_all(self, batch: list[Entry]) -> list[Outcome]:
        if self._pool is None:
            outcomes, took = self._prepare(batch)
            self._count(took, len(batch))
            return outcomes
        if not batch:  # every entry of the read was too large: dead-lettered unread
            return []
        loop = asyncio.get_running_loop()
        size = -(-len(batch) // min(self._threads, len(batch)))
        chunks = [batch[i : i + size] for i in range(0, len(batch), size)]
        done = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self._prepare, chunk) for chunk in chunks)
        )
        self._count(sum(took for _, took in done), len(batch))
        return [outcome for outcomes, _ in done for outcome in outcomes]

    def _prepare(self, batch: list[Entry]) -> tuple[list[Outcome], float]:
        started = time.perf_counter()
        outcomes = prepare(batch, self._model, self._limits, self._worker_id, ops=self._ops)
        return outcomes, time.perf_counter() - started

    def _count(self, seconds: float, requests: int) -> None:
        self.seconds += seconds
        self.requests += requests


def prepare(
    batch: list[Entry],
    model: Model,
    limits: Limits,
    worker_id: str,
    *,
    ops: TokenOps | None = None,
) -> list[Outcome]:
    """Decode, validate and preprocess the entries of one read: each becomes its request's
    prepared items, or the record that answers it at once (malformed: dead-lettered;
    expired; refused by the model's ``preprocess``; deleted while pending: acknowledged; a
    tokenize or detokenize value, where the model has ``ops``: answered here). Where the
    model, loaded by demand, does not load, the requests that need it are
    :class:`Unprepared` (not answered)."""
    now = time.time()
    out: list[Outcome | None] = []  # None: a request being preprocessed, filled in below
    waiting: list[tuple[int, Meta]] = []  # (its place in out, request) to preprocess
    tokens: list[tuple[int, Meta]] = []  # (its place in out, request) to tokenize
    requests = iter(decode_requests([raw for _sidx, _entry, raw in batch if raw]))
    for sidx, entry, raw in batch:
        if not raw:  # deleted while pending: nothing to answer, only to acknowledge
            out.append(Record(sidx, entry))
            continue
        request = next(requests)
        try:
            if isinstance(request, DecodeError):
                raise request
            check_priority(request, sidx)  # the stream decides
            value = request_value(request, limits)
        except DecodeError as exc:
            out.append(
                dead_letter(sidx, entry, raw, "MalformedRequest", str(exc), worker_id=worker_id)
            )
            continue
        meta = Meta(sidx, entry, request, value, now)
        deadline_ms = request.get("dl")
        if deadline_ms is not None and deadline_ms <= now * 1e3:
            out.append(answer(meta, "expired", worker_id))
            continue
        (tokens if ops is not None and op_of(value) is not None else waiting).append(
            (len(out), meta)
        )
        out.append(None)
    error = _load_error(model) if waiting or tokens else None
    if error is not None:  # nothing that needs the model is answered: it goes back
        for index, meta in (*waiting, *tokens):
            out[index] = Unprepared(meta, error)
        return cast("list[Outcome]", out)
    for index, meta in tokens:
        out[index] = _token_answer(meta, cast("TokenOps", ops), worker_id)
    counts = bool(getattr(model, "counts_tokens", False))
    for (index, meta), prepared in zip(
        waiting, _preprocess(model, [m.value for _, m in waiting]), strict=True
    ):
        if isinstance(prepared, Exception):  # the input's fault: this request alone fails
            out[index] = answer(meta, "error", worker_id, error=prepared)
        else:
            if counts:  # its items' lengths are the tokenizer's counts
                meta.tokens = sum(p.length for p in prepared)
            meta.items = len(prepared)
            out[index] = (meta, prepared)
    return cast("list[Outcome]", out)  # the strict zip above filled every None


def _load_error(model: Model) -> Exception | None:
    """What the load of a model loaded by demand raised (None: it is loaded, by now; or the
    model is loaded at start)."""
    if not isinstance(model, LazyModel):
        return None
    try:
        model.ensure()
    except Exception as exc:  # logged by the model
        return exc
    return None


def _token_answer(meta: Meta, ops: TokenOps, worker_id: str) -> Record:
    """The answer to a tokenize or detokenize value, computed here (never batched)."""
    try:
        output = ops.answer(meta.value)
    except Exception as exc:  # this request alone fails
        return answer(meta, "error", worker_id, error=exc)
    return answer(meta, "ok", worker_id, output=output)


def settle_tokenizer(model: Model) -> None:
    """Preprocess one short text, its outcome dropped (a model that takes no text refuses
    it, which is fine), so that the tokenizer's settings are set once. A fast tokenizer
    sets its truncation and padding on its first call with them
    (``set_truncation_and_padding`` mutates the Rust tokenizer): done once here, before the
    preparing threads start, rather than by concurrent first calls, which may fail with
    "Already borrowed"."""
    _preprocess(model, ["settle"])


def _preprocess(model: Model, values: list[Any]) -> list[list[Prepared] | Exception]:
    """Each value's prepared items, or the exception ``preprocess`` raised for it; all at
    once where the model has ``preprocess_many`` (the tokenizer models: one call per read)."""
    many = getattr(model, "preprocess_many", None)
    if many is not None and values:
        try:
            return list(many(values))
        except Exception:  # one value broke the call: each alone, so that only it fails
            logger.debug("preprocess_many failed; preprocessing one by one", exc_info=True)
    out: list[list[Prepared] | Exception] = []
    for value in values:
        try:
            out.append(model.preprocess(value))
        except Exception as exc:
            out.append(exc)
    return out
