"""The queue benchmark: ``python -m benchmarks.queue`` (``__main__.py``)."""
