"""The generation benchmark: ``python -m benchmarks.generate`` (``__main__.py``)."""
