"""The in-process benchmark: ``python -m benchmarks.inprocess`` (``__main__.py``)."""
