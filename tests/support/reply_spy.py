"""A spy on a producer's reply reader, shared by test_reliability.py and producer_script.py
(a script run on its own, which imports this module from its directory)."""

from __future__ import annotations

from collections import Counter

from batchline.codec import Result
from batchline.producer import AsyncProducer, Producer


def count_replies(producer: Producer | AsyncProducer) -> Counter[str]:
    """Count every reply the producer's reader receives, by request id.

    A spy on a private method: the public API settles a request once and drops any further
    reply for it silently, so a duplicate answer can only be seen where it arrives.
    """
    replies: Counter[str] = Counter()
    inner = producer._async if isinstance(producer, Producer) else producer
    deliver = inner._replies.deliver

    def counting(result: Result) -> None:
        replies[result.id] += 1
        deliver(result)

    inner._replies.deliver = counting  # type: ignore[method-assign]
    return replies
